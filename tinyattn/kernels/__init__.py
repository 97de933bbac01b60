"""Triton kernels of tinyattn (their launchers: ``tinyattn/ops/<rule>/triton_impl.py``).

Nothing here validates, allocates user-visible outputs or records autograd: the launchers take
canonical, already-validated tensors (q is ``[B, Tq, Hq, D]``; block_table, seq_lens and page_indices are
contiguous int32; page_indices sorted, deduplicated, -1 padded) and write into preallocated outputs.

Kernels (one module each: ``@triton.jit`` functions, then the block-size heuristics the launchers and the compile
tier share). Their launchers live beside the reference and torch forms of their rule (docs/layout.md):

- ``metadata.page_minmax_kernel``        per-page key bounding boxes (Quest, Tang et al., ICML 2024)
  and ``kv_write.kv_write_kernel``       the step's K/V into the pool + box growth (+ int8 / fp8 scale growth and
  re-quantization) in one launch per layer: launched by :mod:`tinyattn.ops.kv_cache.triton_impl`
- ``scoring.page_scores_kernel``         upper bound of q.k per page (Quest eq.; TinyServe eq. 2), or the box
                                         estimate ``q.c + gamma |q|.r`` (issue 35),
  ``topk.select_pages_kernel``           recent + sink + top-k page selection, one program per (row, KV head),
  ``topk.top_p_filter_kernel``           the top-p pruning of a selection over the estimated mass (Twilight), and
  ``chunk_topk``                         the same selection in two stages for small batches / long rows: launched
  by :mod:`tinyattn.ops.selection.triton_impl`
- ``attention.attn_fwd_kernel``          fused dense / sparse paged attention with split-K merge, and
  ``attention_bwd.attn_bwd_kernel``      its backward: launched by :mod:`tinyattn.ops.attention.triton_impl`

``launches.py`` records the launches the ops make under the interpreter over a table of shapes (runtime models,
benchmarks, vLLM), and ``compile.py`` compiles each recorded launch for a real GPU target with Triton's own JIT
specialisation (``python -m tinyattn.kernels.compile --arch 80 --arch 90 --table``).
"""
import os

import triton


def is_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def strides(name: str, t, axes: str) -> dict:
    """The stride keywords of one tensor argument: ``{"stride_<name><axis>": t.stride(i)}`` for each letter of
    ``axes`` (``strides("q", q, "bthd")`` gives ``stride_qb`` ... ``stride_qd``); zeros when ``t`` is ``None`` (an
    argument the kernel never reads, its constexpr off)."""
    if t is None:
        return {f"stride_{name}{a}": 0 for a in axes}
    assert len(axes) <= t.dim(), (name, axes, tuple(t.shape))
    return {f"stride_{name}{a}": s for a, s in zip(axes, t.stride())}


def pad_head_dim(head_dim: int) -> int:
    """Head dim padded to a power of two >= 16 (``tl.arange`` and ``tl.dot`` need both)."""
    return max(16, triton.next_power_of_2(head_dim))


def needs_upcast(dtype) -> bool:
    """bf16 arithmetic is wrong in the interpreter: upcast to fp32 after loading there only."""
    import torch

    return is_interpreting() and dtype == torch.bfloat16


__all__ = ["is_interpreting", "pad_head_dim", "needs_upcast"]
