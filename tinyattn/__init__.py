"""tinyattn: query-aware sparse paged attention (Quest / TinyServe) as Triton kernels and PyTorch ops.

Public contract: ``docs/api.md`` (and ``../shared/spec/DESIGN.md``). The kernels live in
``tinyattn.kernels``, the public functions and their PyTorch twins in ``tinyattn.ops``.
"""

from .ops import (page_scores, paged_attention, reference, select_pages, sparse_paged_attention,
                  update_page_metadata, value_checks)

__version__ = "0.1.0"

__all__ = ["paged_attention", "update_page_metadata", "page_scores", "select_pages", "sparse_paged_attention",
           "reference", "value_checks", "PagedKVCache", "__version__"]


def __getattr__(name):
    # the cache is imported lazily so that `import tinyattn` stays light
    if name == "PagedKVCache":
        from .cache import PagedKVCache
        return PagedKVCache
    raise AttributeError(f"module 'tinyattn' has no attribute {name!r}")
