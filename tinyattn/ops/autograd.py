"""Differentiable paged attention: ``torch.library`` custom ops with a fake (meta) kernel and a backward.

Two ops, one for each direction, both covering dense and sparse attention (``page_indices`` is
``None`` for the dense Triton walk, otherwise canonical logical pages ``[B, Hkv, K]``):

- ``tinyattn::paged_attention_fwd(q, k_cache, v_cache, block_table, seq_lens, page_indices, scale, backend,
  window_left) -> (out, lse)``
- ``tinyattn::paged_attention_bwd(dout, dlse, q, k_cache, v_cache, block_table, seq_lens, page_indices, out,
  lse, scale, backend, window_left) -> (dq, dk_cache, dv_cache)``

``window_left`` (FlashInfer's convention, ``-1`` = none): a query at position ``p`` sees keys in
``[p - window_left, p]``; the mask is the same in both directions.

``register_autograd`` ties them together, so the public ops are differentiable in ``q``, ``k_cache`` and
``v_cache`` in eager mode, under ``torch.compile(fullgraph=True)`` (the ops are opaque to the compiler,
their fake kernels give it shapes) and under ``torch.library.opcheck``.

Backends: ``"triton"`` runs ``tinyattn.kernels.attention`` forward and
``tinyattn.kernels.attention_bwd`` backward (probabilities P recomputed from q, k and the saved lse; dK/dV
accumulated atomically in fp32 pool-shaped buffers, then cast). ``"torch"`` is the CPU fallback and the
float64 path for ``torch.autograd.gradcheck``: gather the listed pages, one batched softmax, and in
backward ``index_add_`` of the per-key gradients into the pool. Both save only their inputs, ``out`` and
``lse`` (no ``[Tq, keys]`` probability matrix is kept between forward and backward).

Gradients reach a page slot only if the forward read it: slots of unselected pages, of ``-1`` entries,
of pages past a row's end and padding slots of a partial last page get exactly ``0``. A query that sees
no key (``lse = -inf``) contributes nothing and never produces NaN, even when the pool's unused slots
hold NaN. Selection (which pages) has no gradient.

``lse`` comes back in the math dtype (fp32, or fp64 for fp64 inputs); the public ops cast it to fp32.
"""

from __future__ import annotations

from typing import Optional

import torch
from einops import rearrange
from torch import Tensor

from . import core
from . import torch_backend as T

__all__ = ["attention", "paged_attention_fwd", "paged_attention_bwd", "needs_grad"]


def needs_grad(*tensors: Tensor) -> bool:
    """True when autograd is on and one of ``tensors`` requires grad (the public ops then use the custom op)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ---------------------------------------------------------------------------- torch backend
def _gather(q4, k_cache, v_cache, block_table, seq_lens, page_indices, window_left=-1):
    """Listed keys/values of each (row, KV head) and their mask, from the one torch core (:mod:`.core`).

    Returns ``qg [B, Hkv, Tq, G, D]``, ``k, v [B, Hkv, N, D]`` (N = K * page_size; a hidden slot holds a
    valid key of its row, never an unused slot, so no NaN can enter), ``visible [B, Hkv, Tq, 1, N]``,
    ``key_ok [B, Hkv, N]`` (some query sees the key) and ``slot [B, Hkv, N]``, the flat pool row
    ``(page * page_size + slot) * Hkv + head`` of each key.
    """
    B, Tq, Hq, D = q4.shape
    page_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    dt = core.math_dtype(q4)
    rows, _, visible = core.page_rows(block_table, seq_lens, page_indices, page_size=page_size, num_kv_heads=Hkv,
                                      num_query_tokens=Tq, window_left=window_left)   # [B, Hkv, K, S], [.., Tq, K, S]
    slot = rows.reshape(B, Hkv, -1)                                                     # [B, Hkv, N]
    k = k_cache.reshape(-1, D)[slot].to(dt)
    v = v_cache.reshape(-1, D)[slot].to(dt)
    visible = visible.reshape(B, Hkv, Tq, 1, -1)
    qg = rearrange(q4.to(dt), "b t (h g) d -> b h t g d", h=Hkv)
    return qg, k, v, visible, visible.any(2)[:, :, 0], slot


def _softmax_parts(qg, k, visible, scale):
    """Masked logits -> (p [B, Hkv, Tq, G, N] unnormalised by the max, m, denom), no NaN for empty rows."""
    logits = scale * torch.einsum("bhtgd,bhnd->bhtgn", qg, k)
    return core.softmax_parts(logits.masked_fill(~visible, float("-inf")))


def _torch_fwd(q4, k_cache, v_cache, block_table, seq_lens, page_indices, scale, window_left=-1):
    """The torch backend's attention (:func:`core.attend_rows`) over the gathered keys of the listed pages."""
    qg, k, v, visible, _, _ = _gather(q4, k_cache, v_cache, block_table, seq_lens, page_indices, window_left)
    B, Hkv, Tq, G, D = qg.shape
    M = Tq * G                                                   # query rows ordered (t, g), as core.group_queries
    out, lse = core.attend_rows(qg.reshape(B, Hkv, M, D), k, v, visible.expand(B, Hkv, Tq, G, -1).reshape(B, Hkv, M, -1),
                                scale)
    return (rearrange(out, "b h (t g) d -> b t (h g) d", t=Tq).to(q4.dtype).contiguous(),
            rearrange(lse, "b h (t g) -> b t (h g)", t=Tq).contiguous())


def _torch_bwd(dout, dlse, q4, k_cache, v_cache, block_table, seq_lens, page_indices, scale, window_left=-1):
    qg, k, v, visible, key_ok, slot = _gather(q4, k_cache, v_cache, block_table, seq_lens, page_indices,
                                              window_left)
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    dt = qg.dtype
    p, _, denom = _softmax_parts(qg, k, visible, scale)
    p = p / torch.where(denom > 0, denom, 1.0)  # [B, Hkv, Tq, G, N], exactly 0 where masked
    do = rearrange(dout.to(dt), "b t (h g) d -> b h t g d", h=Hkv)
    dp = torch.einsum("bhtgd,bhnd->bhtgn", do, v)
    delta = (p * dp).sum(-1, keepdim=True)  # = rowsum(dO * O), computed without rounding O
    if dlse is not None:
        delta = delta - rearrange(dlse.to(dt), "b t (h g) -> b h t g", h=Hkv)[..., None]
    ds = p * (dp - delta)
    dq = scale * torch.einsum("bhtgn,bhnd->bhtgd", ds, k)
    dk = scale * torch.einsum("bhtgn,bhtgd->bhnd", ds, qg)  # [B, Hkv, N, D]
    dv = torch.einsum("bhtgn,bhtgd->bhnd", p, do)
    ok = key_ok[..., None]
    flat = slot.reshape(-1)
    dk_pool = torch.zeros(k_cache.numel() // D, D, dtype=dt, device=q4.device)
    dv_pool = torch.zeros(v_cache.numel() // D, D, dtype=dt, device=q4.device)
    # a physical page listed by several rows (or logical pages) accumulates; missing keys add exact zeros
    dk_pool.index_add_(0, flat, torch.where(ok, dk, 0.0).reshape(-1, D))
    dv_pool.index_add_(0, flat, torch.where(ok, dv, 0.0).reshape(-1, D))
    dq = rearrange(dq, "b h t g d -> b t (h g) d").to(q4.dtype).contiguous()
    return dq, dk_pool.view(k_cache.shape).to(k_cache.dtype), dv_pool.view(v_cache.shape).to(v_cache.dtype)


# ---------------------------------------------------------------------------- custom ops
@torch.library.custom_op("tinyattn::paged_attention_fwd", mutates_args=())
def paged_attention_fwd(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                        page_indices: Optional[Tensor], scale: float, backend: str,
                        window_left: int = -1) -> tuple[Tensor, Tensor]:
    """(out, lse) of q ``[B, Tq, Hq, D]`` over the listed pages (``None``: every valid page, Triton only)."""
    if backend == "triton":
        from ..kernels.attention import paged_attention as launch
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        launch(q, k_cache, v_cache, block_table, seq_lens, page_indices=page_indices, scale=scale, out=out, lse=lse,
               window_left=window_left)
        return out, lse
    if page_indices is None:
        page_indices = T.dense_page_indices(seq_lens, k_cache.shape[2], block_table.shape[1], k_cache.shape[1])
    return _torch_fwd(q, k_cache, v_cache, block_table, seq_lens, page_indices, scale, window_left)


@paged_attention_fwd.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, page_indices, scale, backend, window_left=-1):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=lse_dtype)


@torch.library.custom_op("tinyattn::paged_attention_bwd", mutates_args=())
def paged_attention_bwd(dout: Tensor, dlse: Optional[Tensor], q: Tensor, k_cache: Tensor, v_cache: Tensor,
                        block_table: Tensor, seq_lens: Tensor, page_indices: Optional[Tensor], out: Tensor,
                        lse: Tensor, scale: float, backend: str, window_left: int = -1) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk_cache, dv_cache) of :func:`paged_attention_fwd`; dk/dv are pool-shaped, 0 where not read."""
    if backend == "triton":
        from ..kernels.attention_bwd import paged_attention_bwd as launch
        dq = torch.empty_like(q)
        dk = torch.zeros(k_cache.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v_cache.shape, dtype=torch.float32, device=q.device)
        launch(dout, q, k_cache, v_cache, block_table, seq_lens, page_indices=page_indices, out=out, lse=lse,
               dlse=None if dlse is None else dlse.float(), scale=scale, dq=dq, dk=dk, dv=dv, window_left=window_left)
        return dq, dk.to(k_cache.dtype), dv.to(v_cache.dtype)
    if page_indices is None:
        page_indices = T.dense_page_indices(seq_lens, k_cache.shape[2], block_table.shape[1], k_cache.shape[1])
    return _torch_bwd(dout, dlse, q, k_cache, v_cache, block_table, seq_lens, page_indices, scale, window_left)


@paged_attention_bwd.register_fake
def _(dout, dlse, q, k_cache, v_cache, block_table, seq_lens, page_indices, out, lse, scale, backend, window_left=-1):
    return torch.empty_like(q), torch.empty_like(k_cache), torch.empty_like(v_cache)


def _setup_context(ctx, inputs, output):
    q, k_cache, v_cache, block_table, seq_lens, page_indices, scale, backend, window_left = inputs
    out, lse = output
    ctx.save_for_backward(q, k_cache, v_cache, block_table, seq_lens, page_indices, out, lse)
    ctx.scale, ctx.backend, ctx.window_left = scale, backend, window_left


def _backward(ctx, dout, dlse):
    q, k_cache, v_cache, block_table, seq_lens, page_indices, out, lse = ctx.saved_tensors
    dq, dk, dv = paged_attention_bwd(dout, dlse, q, k_cache, v_cache, block_table, seq_lens, page_indices, out,
                                     lse, ctx.scale, ctx.backend, ctx.window_left)
    return dq, dk, dv, None, None, None, None, None, None


paged_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention(q4: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
              page_indices: Optional[Tensor], scale: float, backend: str,
              window_left: int = -1) -> tuple[Tensor, Tensor]:
    """Differentiable (out, lse fp32) for the public ops; inputs validated and canonical (see ``api._attention``);
    ``window_left``: the sliding window (FlashInfer's convention, ``-1`` = none).

    float64 always runs the torch backend (the Triton kernels compute in fp32 at most).
    """
    if backend == "triton" and q4.dtype != torch.float64:
        block_table = block_table.to(torch.int32).contiguous()
        seq_lens = seq_lens.to(torch.int32).contiguous()
        page_indices = None if page_indices is None else page_indices.to(torch.int32).contiguous()
    else:
        backend = "torch"
        if page_indices is None:
            page_indices = T.dense_page_indices(seq_lens, k_cache.shape[2], block_table.shape[1], k_cache.shape[1])
    out, lse = paged_attention_fwd(q4, k_cache, v_cache, block_table, seq_lens, page_indices, float(scale), backend,
                                   int(window_left))
    return out, lse.float()
