"""The ops, laid out by rule (docs/layout.md): ``attention/``, ``selection/`` and ``kv_cache/`` each hold a rule's
reference loops, torch form and Triton launchers side by side; :mod:`.api` holds the public functions (validate once,
then the plan implementation of the backend: :mod:`.plan`, :mod:`.plan_torch`, :mod:`.plan_triton`)."""

from . import reference
from .api import (encode_key_codes, page_scores, paged_attention, rerank_scores, select_pages, sparse_paged_attention,
                  update_page_metadata)
from .validation import value_checks

__all__ = ["paged_attention", "update_page_metadata", "page_scores", "select_pages", "sparse_paged_attention",
           "rerank_scores", "encode_key_codes",
           "reference", "value_checks"]
