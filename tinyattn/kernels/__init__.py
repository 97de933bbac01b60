"""Triton kernels of tinyattn and their launchers.

Nothing here validates, allocates user-visible outputs or records autograd: the launchers take
canonical, already-validated tensors from ``tinyattn.ops`` (q is ``[B, Tq, Hq, D]``; block_table,
seq_lens and page_indices are contiguous int32; page_indices sorted, deduplicated, -1 padded) and
write into preallocated outputs.

Kernels (one module each, kernels first, then the block-size heuristics, then the launcher):

- ``metadata.update_page_metadata``  per-page key bounding boxes (Quest, Tang et al., ICML 2024)
- ``scoring.page_scores``            upper bound of q.k per page (Quest eq.; TinyServe eq. 2)
- ``topk.select_pages``              recent + sink + top-k page selection, one program per (row, KV head)
- ``chunk_topk.score_and_select_pages``  the same selection in two stages for small batches / long rows:
  fused score + per-chunk top-k over ``(B, Hkv, chunks)`` programs, then a merge per (row, KV head)
- ``attention.paged_attention``      fused dense / sparse paged attention with split-K merge
- ``kv_write.write_kv``              the step's K/V into the pool + box growth (+ int8 / fp8 scale growth and
  re-quantization) in one launch per layer

``launches.py`` records the launches the ops make under the interpreter over a table of shapes (runtime models,
benchmarks, vLLM), and ``compile.py`` compiles each recorded launch for a real GPU target with Triton's own JIT
specialisation (``python -m tinyattn.kernels.compile --arch 80 --arch 90 --table``).
"""
import os

import triton


def is_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def pad_head_dim(head_dim: int) -> int:
    """Head dim padded to a power of two >= 16 (``tl.arange`` and ``tl.dot`` need both)."""
    return max(16, triton.next_power_of_2(head_dim))


def needs_upcast(dtype) -> bool:
    """bf16 arithmetic is wrong in the interpreter: upcast to fp32 after loading there only."""
    import torch

    return is_interpreting() and dtype == torch.bfloat16


from .attention import paged_attention  # noqa: E402
from .metadata import update_page_metadata  # noqa: E402
from .scoring import page_scores  # noqa: E402
from .topk import select_pages  # noqa: E402
from . import chunk_topk  # noqa: E402

__all__ = [
    "paged_attention",
    "update_page_metadata",
    "page_scores",
    "select_pages",
    "chunk_topk",
    "is_interpreting",
    "pad_head_dim",
    "needs_upcast",
]
