"""``torch.library`` custom ops: what autograd and ``torch.compile`` see of tinyattn.

- ``tinyattn::paged_attention_fwd(q, k_cache, v_cache, block_table, seq_lens, page_indices, scale, backend,
  window_left) -> (out, lse)``, with ``register_autograd`` tying it to
- ``tinyattn::paged_attention_bwd(dout, dlse, q, k_cache, v_cache, block_table, seq_lens, page_indices, out, lse,
  scale, backend, window_left) -> (dq, dk_cache, dv_cache)``;
- ``tinyattn::select_pages_planned(q, k_min, k_max, block_table, seq_lens, page_size, page_budget, num_sink_pages,
  num_recent_pages, window_left, backend, gamma, top_p, scale) -> page_indices``: the plan's selection (one or two
  stages, as in eager; the box estimate ``gamma``, the top-p pruning with its softmax ``scale``);
- ``tinyattn::page_scores`` and ``tinyattn::select_pages``: the stand-alone public ops under ``torch.compile``.

Every body is a call into a plan implementation (:class:`tinyattn.ops.plan_torch.TorchPlan`,
:class:`tinyattn.ops.plan_triton.TritonPlan`) or a launcher of the Triton form, so eager, autograd and compiled
calls compute the same thing. The fake kernels give the compiler shapes; the ops are opaque to it (their bodies
launch Triton kernels or make host-side size decisions).

Autograd (``page_indices`` ``None``: dense; else canonical logical pages ``[B, Hkv, K]``): the Triton backend's
backward is ``kernels/attention_bwd.py`` (probabilities recomputed from q, k and the saved lse; dK / dV accumulated
atomically in fp32 pool-shaped buffers, then cast). The torch backend's backward is the plan's
:meth:`~tinyattn.ops.plan_torch.TorchPlan.attend_backward`: the same rows and mask as its forward, probabilities
recomputed, gradients accumulated into the pool with ``index_add_``. Both save only their inputs, ``out`` and
``lse``. Gradients reach a page slot only if the forward
read it: slots of unselected pages, of ``-1`` entries, past a row's end and padding slots of a partial last page
get exactly ``0``; a query that sees no key contributes nothing and never produces NaN. Selection has no gradient.
``lse`` comes back in the math dtype (fp32, or fp64 for fp64 inputs); the public ops cast it to fp32.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch
from torch import Tensor

__all__ = ["paged_attention_fwd", "paged_attention_bwd", "select_pages_planned", "page_scores_op",
           "select_pages_op", "attention", "needs_grad"]

_local = threading.local()      # per thread: one plan per backend for the ops' bodies (workspaces reused)


def needs_grad(*tensors: Tensor) -> bool:
    """True when autograd is on and one of ``tensors`` requires grad."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _plan_for(backend: str, q4: Tensor, num_kv_heads: int, page_size: int, block_table: Tensor, seq_lens: Tensor,
              **selection):
    """A plan of this thread (one per backend and purpose) planned for these checked tables (``trusted``); kept
    while the sizes, the rules and the tables' values stay the same (CPU tables: layers of one step share it)."""
    from .plan import PagedAttentionPlan

    key = backend + ("select" if selection else "attend")
    plan = getattr(_local, key, None)
    if plan is None:
        plan = PagedAttentionPlan(backend=backend)
        setattr(_local, key, plan)
    B, Tq, Hq, D = q4.shape
    args = dict(num_q_heads=Hq, num_kv_heads=num_kv_heads, head_dim=D, page_size=page_size, num_query_tokens=Tq,
                **selection)
    if (plan.step is None or plan._args != args or not block_table.is_cpu
            or not torch.equal(plan._impl.block_table, block_table) or not torch.equal(plan._impl.seq_lens, seq_lens)):
        plan.plan(block_table, seq_lens, trusted=True, **args)
        plan._args = args
    return plan


# ------------------------------------------------------------------------------------------- attention
def _torch_forward(q, k_cache, v_cache, block_table, seq_lens, page_indices, scale, window_left):
    """The torch backend's attention with its lse, through the plan (``[B, Tq, Hq, D]``, ``[B, Tq, Hq]``)."""
    plan = _plan_for("torch", q, k_cache.shape[2], k_cache.shape[1], block_table, seq_lens)
    return plan._impl.attend(q, k_cache, v_cache, None, None, page_indices, True, scale, None, window_left)


@torch.library.custom_op("tinyattn::paged_attention_fwd", mutates_args=())
def paged_attention_fwd(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                        page_indices: Optional[Tensor], scale: float, backend: str,
                        window_left: int = -1) -> tuple[Tensor, Tensor]:
    """(out, lse) of q ``[B, Tq, Hq, D]`` over the listed pages (``None``: every valid page)."""
    if backend == "triton":
        from .attention.triton_impl import paged_attention as launch
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        launch(q, k_cache, v_cache, block_table, seq_lens, page_indices=page_indices, scale=scale, out=out, lse=lse,
               window_left=window_left)
        return out, lse
    out, lse = _torch_forward(q, k_cache, v_cache, block_table, seq_lens, page_indices, scale, window_left)
    return out.contiguous(), lse.to(q.dtype if q.dtype == torch.float64 else torch.float32).contiguous()


@paged_attention_fwd.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, page_indices, scale, backend, window_left=-1):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=lse_dtype)


@torch.library.custom_op("tinyattn::paged_attention_bwd", mutates_args=())
def paged_attention_bwd(dout: Tensor, dlse: Optional[Tensor], q: Tensor, k_cache: Tensor, v_cache: Tensor,
                        block_table: Tensor, seq_lens: Tensor, page_indices: Optional[Tensor], out: Tensor,
                        lse: Tensor, scale: float, backend: str,
                        window_left: int = -1) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk_cache, dv_cache) of :func:`paged_attention_fwd`; dk/dv are pool-shaped, 0 where not read."""
    if backend == "triton":
        from .attention.triton_impl import paged_attention_bwd as launch
        dq = torch.empty_like(q)
        dk = torch.zeros(k_cache.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v_cache.shape, dtype=torch.float32, device=q.device)
        launch(dout, q, k_cache, v_cache, block_table, seq_lens, page_indices=page_indices, out=out, lse=lse,
               dlse=None if dlse is None else dlse.float(), scale=scale, dq=dq, dk=dk, dv=dv, window_left=window_left)
        return dq, dk.to(k_cache.dtype), dv.to(v_cache.dtype)
    plan = _plan_for("torch", q, k_cache.shape[2], k_cache.shape[1], block_table, seq_lens)
    return plan._impl.attend_backward(q, k_cache, v_cache, page_indices, dout, dlse, scale, window_left)


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
    """Differentiable ``(out, lse fp32)`` through :func:`paged_attention_fwd` on validated, canonical inputs
    (``page_indices``: ascending, de-duplicated, ``-1`` padded, or ``None`` for dense). float64 runs the torch
    backend (the Triton kernels compute in fp32 at most)."""
    if backend == "triton" and q4.dtype != torch.float64:
        block_table = block_table.to(torch.int32).contiguous()
        seq_lens = seq_lens.to(torch.int32).contiguous()
        page_indices = None if page_indices is None else page_indices.to(torch.int32).contiguous()
    else:
        backend = "torch"
    out, lse = paged_attention_fwd(q4, k_cache, v_cache, block_table, seq_lens, page_indices, float(scale), backend,
                                   int(window_left))
    return out, lse.float()


# ------------------------------------------------------------------------------------------- selection
@torch.library.custom_op("tinyattn::select_pages_planned", mutates_args=())
def select_pages_planned(q: Tensor, k_min: Tensor, k_max: Tensor, block_table: Tensor, seq_lens: Tensor,
                         page_size: int, page_budget: int, num_sink_pages: int, num_recent_pages: int,
                         window_left: int, backend: str, gamma: float = 1.0, top_p: Optional[float] = None,
                         scale: float = 1.0) -> Tensor:
    """The plan's selection (:meth:`TorchPlan.select` / :meth:`TritonPlan.select`): ``[B, Hkv, page_budget]`` int32
    logical pages, canonical (ascending, ``-1`` padded), of q ``[B, Tq, Hq, D]`` (``gamma``: the page estimate;
    ``top_p`` with the softmax ``scale`` of its mass)."""
    from .selection.torch_impl import canonical_page_indices

    plan = _plan_for(backend, q, k_min.shape[1], page_size, block_table, seq_lens, page_budget=page_budget,
                     num_sink_pages=num_sink_pages, num_recent_pages=num_recent_pages, gamma=gamma, top_p=top_p)
    B, Hkv = q.shape[0], k_min.shape[1]
    if not plan.step.selects or plan.step.nothing:      # every valid page fits the budget
        from .attention.torch_impl import dense_page_indices
        pages = dense_page_indices(plan.seq_lens, Hkv, block_table.shape[1], page_size)[..., :page_budget]
        return torch.nn.functional.pad(pages, (0, page_budget - pages.shape[-1]), value=-1).contiguous()
    pages = plan._impl.select(q, k_min, k_max, window_left, scale=scale)
    return canonical_page_indices(pages, plan.seq_lens, page_size).reshape(B, Hkv, page_budget)


@select_pages_planned.register_fake
def _(q, k_min, k_max, block_table, seq_lens, page_size, page_budget, num_sink_pages, num_recent_pages,
      window_left, backend, gamma=1.0, top_p=None, scale=1.0):
    return q.new_empty((q.shape[0], k_min.shape[1], page_budget), dtype=torch.int32)


@torch.library.custom_op("tinyattn::page_scores", mutates_args=())
def page_scores_op(q: Tensor, k_min: Tensor, k_max: Tensor, block_table: Tensor, seq_lens: Tensor,
                   page_size: int, backend: str, gamma: float = 1.0) -> Tensor:
    """The public :func:`tinyattn.page_scores` under ``torch.compile`` (validated inputs, q ``[B, Tq, Hq, D]``)."""
    from .api import run_page_scores
    return run_page_scores(q, k_min, k_max, block_table, seq_lens, page_size, backend, gamma)


@page_scores_op.register_fake
def _(q, k_min, k_max, block_table, seq_lens, page_size, backend, gamma=1.0):
    return q.new_empty((q.shape[0], k_min.shape[1], block_table.shape[1]), dtype=torch.float32)


@torch.library.custom_op("tinyattn::select_pages", mutates_args=())
def select_pages_op(scores: Tensor, seq_lens: Tensor, page_size: int, page_budget: int, num_sink_pages: int,
                    num_recent_pages: int, num_query_tokens: int, backend: str, top_p: Optional[float] = None,
                    scale: float = 1.0) -> Tensor:
    """The public :func:`tinyattn.select_pages` under ``torch.compile`` (validated inputs)."""
    from .api import run_select_pages
    return run_select_pages(scores, seq_lens, page_size, page_budget, num_sink_pages, num_recent_pages,
                            num_query_tokens, backend, top_p, scale)


@select_pages_op.register_fake
def _(scores, seq_lens, page_size, page_budget, num_sink_pages, num_recent_pages, num_query_tokens, backend,
      top_p=None, scale=1.0):
    return scores.new_empty((scores.shape[0], scores.shape[1], page_budget), dtype=torch.int32)


# ------------------------------------------------------------------------------------------- the route
def differentiable(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_lens: Tensor, *,
                   page_size: int, backend: str, scale: float, window_left: int, k_min=None, k_max=None,
                   page_indices=None, selection: dict | None = None, scales=None, select=None, nothing=False):
    """Attention through the custom ops: the route of autograd (Triton backend) and of ``torch.compile`` (both).

    Selection first, without gradient: ``select(q4, k_min, k_max, window_left)`` (the plan's own, eager) or, when
    ``None``, :func:`select_pages_planned` (the same plan selection as a custom op: the compiled route); then
    :func:`paged_attention_fwd` over the canonical pages, with its backward. ``selection``: ``page_budget``,
    ``num_sink_pages``, ``num_recent_pages``, ``gamma``, ``top_p`` when boxes select (``None``: every valid page fits the budget, or no
    budget). ``scales``: ``(k_scale, v_scale)`` of an int8 / fp8 pool (dequantized whole: the custom op reads
    float pools). Returns ``(out [B, Tq, Hq, D], lse [B, Tq, Hq] fp32)``.
    """
    from .attention.torch_impl import empty_attention
    from .quant import dequantize
    from .selection.torch_impl import canonical_page_indices

    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    if scales is not None:
        dt = q.dtype if backend == "triton" or q.dtype == torch.float64 else torch.float32
        k_cache, v_cache = dequantize(k_cache, scales[0], dt), dequantize(v_cache, scales[1], dt)
    if page_indices is None and k_min is not None and selection is not None and not nothing:
        if select is not None:
            page_indices = select(q4.detach(), k_min, k_max, window_left, scale=scale)
        else:
            page_indices = select_pages_planned(q4.detach(), k_min, k_max, block_table, seq_lens, page_size,
                                                selection["page_budget"], selection["num_sink_pages"],
                                                selection["num_recent_pages"], window_left, backend,
                                                float(selection.get("gamma", 1.0)), selection.get("top_p"),
                                                float(scale))
    if page_indices is not None and page_indices.shape[-1]:
        # canonical (ascending, de-duplicated, -1 past the end); also a copy of the Triton selection buffer,
        # which the next layer rewrites behind autograd's back
        page_indices = canonical_page_indices(page_indices, seq_lens, page_size)
    if nothing or k_cache.shape[0] == 0 or (page_indices is not None and page_indices.shape[-1] == 0):
        return empty_attention(q4, k_cache, v_cache)
    if needs_grad(q, k_cache, v_cache):      # autograd keeps the tables: a plan rewrites its own at the next step
        block_table, seq_lens = block_table.clone(), seq_lens.clone()
    return attention(q4, k_cache, v_cache, block_table, seq_lens, page_indices, scale, backend, window_left)
