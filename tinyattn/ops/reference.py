"""Pure-PyTorch twins of the public ops (``tinyattn.reference``): simple loops, fp32 math, written for clarity.

Every kernel and the vectorised torch backend are tested against these functions. They follow DESIGN.md §1-3
literally (per row, per KV head) and share no code with the fast paths beyond argument validation. Same signatures
as the public functions; ``q`` of dtype float64 is computed in float64 (for gradcheck), everything else in float32.
Each lives beside the torch and Triton forms of its rule (docs/layout.md, "Where each rule lives"):

- :func:`paged_attention`, :func:`sparse_paged_attention`: :mod:`tinyattn.ops.attention.reference`
- :func:`page_scores`, :func:`select_pages`, :func:`rerank_scores`: :mod:`tinyattn.ops.selection.reference`
- :func:`update_page_metadata`, :func:`write_kv`, :func:`encode_key_codes`: :mod:`tinyattn.ops.kv_cache.reference`

Method: Quest (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024,
§3.2) and TinyServe (Liu & Yu, arXiv 2509.12211, eq. 2).
"""

from .attention.reference import paged_attention, sparse_paged_attention
from .kv_cache.reference import encode_key_codes, update_page_metadata, write_kv
from .selection.reference import page_scores, rerank_scores, select_pages

__all__ = ["paged_attention", "update_page_metadata", "page_scores", "select_pages", "sparse_paged_attention",
           "write_kv", "rerank_scores", "encode_key_codes"]
