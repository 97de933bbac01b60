"""Per-page gradient magnitude of the KV cache: the signal of gradient-aware KV retention.

TinyServe (Liu & Yu, arXiv 2509.12211) keeps, during fine-tuning, the KV entries whose gradients are
large and frees the others. :func:`page_grad_norms` reduces the pool-shaped gradients that the
attention backward writes (``k_cache.grad``, ``v_cache.grad``) to one number per physical page and KV
head::

    norms[p, h] = sum_{s, d} dk[p, s, h, d]^2 + dv[p, s, h, d]^2

One small Triton kernel (``kernels.attention_bwd.page_grad_norm_kernel``, one read of each gradient)
or one vectorised torch expression on the CPU: cheap enough to run after every backward.
"""

from __future__ import annotations

import torch

from . import validation as V

__all__ = ["page_grad_norms"]


def page_grad_norms(dk_cache: torch.Tensor, dv_cache: torch.Tensor, *, backend=None) -> torch.Tensor:
    """Squared L2 norm of the key and value gradients of each physical page and KV head.

    Args:
        dk_cache, dv_cache: ``[num_pages, page_size, Hkv, D]`` gradients of ``k_cache`` / ``v_cache``
            (fp16 / bf16 / fp32 / fp64), e.g. ``k_cache.grad`` after a backward through
            :func:`tinyattn.sparse_paged_attention`. Pages the forward did not read hold zeros and get 0.
        backend: ``None`` (by device), ``"torch"`` or ``"triton"``.

    Returns:
        fp32 ``[num_pages, Hkv]``: ``sum over slots and channels of dk^2 + dv^2`` (math in fp32, fp64 for fp64).

    Raises:
        TypeError / ValueError naming the argument for a non-tensor, a wrong rank, dtype, shape or device.
    """
    from .api import resolve_backend

    for name, x in (("dk_cache", dk_cache), ("dv_cache", dv_cache)):
        V.expect_tensor(name, x)
        V.expect_dim(name, x, (4,), "[num_pages, page_size, Hkv, D]")
        V.expect_dtype(name, x, V.FLOAT_DTYPES + (torch.float64,))
    V.expect_shape("dv_cache", dv_cache, tuple(dk_cache.shape), "(that of dk_cache)")
    V.expect_device("dv_cache", dv_cache, dk_cache.device, "dk_cache")
    num_pages, page_size, num_kv_heads, _ = dk_cache.shape
    backend = resolve_backend(backend, dk_cache.device)
    if backend == "torch" or dk_cache.dtype == torch.float64 or page_size & (page_size - 1):
        dt = torch.float64 if dk_cache.dtype == torch.float64 else torch.float32
        k, v = dk_cache.to(dt), dv_cache.to(dt)
        return ((k * k).sum((1, 3)) + (v * v).sum((1, 3))).float()
    from .attention.triton_impl import page_grad_norms as launch

    out = torch.empty(num_pages, num_kv_heads, dtype=torch.float32, device=dk_cache.device)
    launch(dk_cache, dv_cache, out=out)
    return out
