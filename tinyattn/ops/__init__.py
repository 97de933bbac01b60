"""Public ops (validation + dispatch), the PyTorch reference twins and the vectorised torch backend."""

from . import reference
from .api import page_scores, paged_attention, select_pages, sparse_paged_attention, update_page_metadata
from .validation import value_checks

__all__ = ["paged_attention", "update_page_metadata", "page_scores", "select_pages", "sparse_paged_attention",
           "reference", "value_checks"]
