"""The public ops of DESIGN.md §3: validation, then dispatch to the Triton kernels or the torch backend.

Backends (DESIGN.md §4): CUDA tensors, or any tensor when ``TRITON_INTERPRET=1``, run the Triton
kernels; CPU tensors otherwise run :mod:`tinyattn.ops.torch_backend`. ``backend="triton" | "torch"``
forces one.

Method: Quest (Tang et al., ICML 2024) and TinyServe (Liu & Yu, arXiv 2509.12211). The page bound
is Quest §3.2 / TinyServe eq. 2: ``ub(q, j) = Σ_i max(q_i·k_min[j,i], q_i·k_max[j,i]) ≥ max_{t∈j} q·k_t``.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from . import boxes, core, quant
from . import torch_backend as T
from .spans import span
from . import library as L
from . import validation as V
from .autograd import attention as differentiable_attention
from .plan import BACKENDS, PagedAttentionPlan, resolve_backend  # noqa: F401 (re-exported)

def _kernels():
    from .. import kernels       # imported lazily: a CPU-only user never needs triton
    return kernels


def _int32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int32).contiguous()


def _restore_q_shape(q, out, lse):
    if q.dim() == 3:
        return out.squeeze(1), lse.squeeze(1)
    return out, lse


def _dequantized(q, k_cache, v_cache, k_scale, v_scale, backend):
    """Whole quantized pools -> values (the ``torch.compile`` path; eager runs dequantize only the rows they
    gather, the Triton kernels in registers): fp32 math on the torch backend, ``q``'s dtype for the kernels."""
    if k_scale is None:
        return k_cache, v_cache
    dt = q.dtype if backend == "triton" or q.dtype == torch.float64 else torch.float32
    return quant.dequantize(k_cache, k_scale, dt), quant.dequantize(v_cache, v_scale, dt)


def _nothing_to_attend(q4, k_cache, block_table, page_indices) -> bool:
    """Empty batch, no query token, an empty pool or table, or an empty page list: no key is visible."""
    return (q4.numel() == 0 or k_cache.shape[0] == 0 or block_table.shape[1] == 0
            or (page_indices is not None and page_indices.shape[-1] == 0))


def _attention(q, q4, k_cache, v_cache, block_table, seq_lens, page_indices, scale, return_lse, backend,
               selection=None, window_left=-1):
    """The ops under ``torch.compile``: canonical inputs -> out (+ lse) through the custom op, which is opaque to
    the compiler (eager calls go through :class:`PagedAttentionPlan` instead).

    ``selection``: the budget and forced-page rules the sparse ``page_indices`` were chosen under, for the
    profiler's oracle comparison (None for dense).
    """
    if _nothing_to_attend(q4, k_cache, block_table, page_indices):
        out, lse = _restore_q_shape(q, *core.empty_attention(q4, k_cache, v_cache))
        return (out, lse) if return_lse else out
    with span("attention", q=q4, k_cache=k_cache, block_table=block_table, seq_lens=seq_lens,
              page_indices=page_indices, scale=scale, selection=selection, window_left=window_left):
        out, lse = differentiable_attention(q4, k_cache, v_cache, block_table, seq_lens, page_indices, scale, backend,
                                            window_left)
    out, lse = _restore_q_shape(q, out, lse)
    return (out, lse) if return_lse else out


_plans = threading.local()


def _planned(op: str, backend: str, checked, block_table, seq_lens) -> PagedAttentionPlan:
    """The calling thread's plan for ``op`` (``"dense"`` / ``"sparse"``) on ``backend`` (its workspaces and per-step
    tables are reused from call to call), planned for this call's validated tables. One plan per op, so that a
    loop alternating dense and sparse calls on the same tables (a benchmark, a model with dense layers calling
    the public ops) does not re-plan at every call.

    ``checked``: what validation returned (:func:`_checked_dense` / :func:`_checked_sparse`); the same object as
    at the last call means :func:`V.recall` found the same signature and the same table values, so the planned
    step (the plan's own copy of those values) stands.
    """
    plan = getattr(_plans, op + backend, None)
    if plan is None:
        plan = PagedAttentionPlan(backend=backend)
        setattr(_plans, op + backend, plan)
    if plan._api_key is checked and plan.step is not None:
        return plan
    plan._api_key = None            # set once planning succeeded: a failed plan is never reused
    shapes, scale, selection = checked.shapes, checked.scale, checked.selection
    plan.plan(block_table, seq_lens, num_q_heads=shapes.num_q_heads, num_kv_heads=shapes.num_kv_heads,
              head_dim=shapes.head_dim, page_size=shapes.page_size,
              num_query_tokens=shapes.num_query_tokens, scale=scale, trusted=True, **selection)
    plan._api_key = checked
    return plan


class _Checked(NamedTuple):
    """A validated call: sizes, softmax scale, backend, and the selection rules of the plan."""
    shapes: V.PagedShapes
    scale: float
    backend: str
    selection: dict


def _checked_dense(q, k_cache, v_cache, block_table, seq_lens, scale, backend, k_scale=None,
                   v_scale=None) -> _Checked:
    """Validate ``paged_attention``'s arguments, or recall the last identical call's result."""
    sig = V.signature(q, k_cache, v_cache, block_table, seq_lens, scale, backend, k_scale, v_scale)
    tables = (block_table, seq_lens)
    hit = V.recall("dense", sig, tables) if isinstance(block_table, torch.Tensor) and isinstance(
        seq_lens, torch.Tensor) else None
    if hit is not None:
        return hit
    _, shapes = V.check_paged_inputs(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale)
    scale = V.check_scale(scale, shapes.head_dim)
    backend = resolve_backend(backend, q.device)
    if backend == "triton":
        V.check_kernel_page_size(shapes.page_size)
        V.check_kv_backend(k_cache, backend)
    return V.remember("dense", sig, tables, _Checked(shapes, scale, backend, {}))


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, *, scale=None, return_lse=False, backend=None,
                    k_scale=None, v_scale=None, window_left=-1):
    """Dense paged attention over every valid page of each row: the baseline of the sparse op.

    Args:
        q: ``[B, Hq, D]`` (decode) or ``[B, Tq, Hq, D]``, fp16 / bf16 / fp32. With ``Tq > 1`` the queries
            are the last ``Tq`` tokens of each row, causal with bottom-right alignment: query ``t`` sits at
            position ``seq_lens[b] - Tq + t`` and sees keys at positions ``<=`` its own::

                Tq=2, seq_len=5     keys: 0 1 2 3 4
                query 0 (pos 3)           x x x x .
                query 1 (pos 4)           x x x x x

            With a sliding window (``window_left >= 0``) query ``t`` sees only the keys at positions
            ``[p - window_left, p]``, ``p`` its own::

                Tq=2, seq_len=5, window_left=1     keys: 0 1 2 3 4
                query 0 (pos 3)                          . . x x .
                query 1 (pos 4)                          . . . x x
        k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` page pool, same dtype as ``q``, or quantized
            (both int8 or both float8_e4m3fn, :class:`tinyattn.PagedKVCache` with ``kv_cache_dtype="int8"`` /
            ``"fp8_e4m3"``) with ``k_scale`` / ``v_scale``. ``Hq % Hkv == 0`` (GQA; MQA when ``Hkv == 1``).
        block_table: ``[B, max_pages_per_seq]`` int32 (int64 accepted): physical page of each logical page;
            entries past a row's last page are ignored.
        seq_lens: ``[B]`` int32 (int64 accepted): valid tokens per row, including the ``Tq`` queries; 0 allowed.
        scale: softmax scale, default ``D ** -0.5``.
        return_lse: also return the natural-log log-sum-exp of the scaled logits, fp32 ``[B, Hq]`` or
            ``[B, Tq, Hq]``, ``-inf`` where a query sees no key.
        backend: ``None`` (by device), ``"torch"`` or ``"triton"``.
        k_scale, v_scale: fp32 ``[num_pages, Hkv]`` per-(page, KV head) scales of quantized pools (a value
            reads ``k_cache.float() * k_scale[page, head]``); required with int8 / fp8 pools, ``None`` otherwise.
            The torch backend gathers the quantized rows and their scales and multiplies before attending; the
            Triton kernel dequantizes its K/V tiles in registers (fp8 e4m3 needs sm_89+: below, a ``ValueError``).
        window_left: sliding window in FlashInfer's convention (Mistral / Gemma ``sliding_window - 1``): a query at
            position ``p`` attends the keys at positions ``[p - window_left, p]``; ``-1`` (default) = no limit.
            Pages wholly before a query block's window are not read (the Triton walk and the torch gather start at
            the window's first page).

    Returns:
        ``out`` with the shape and dtype of ``q`` (zeros where a query sees no key), and ``lse`` if asked.

    Raises:
        TypeError / ValueError naming the argument, expected and actual value, for bad shapes, dtypes,
        devices, ``Hq % Hkv != 0``, ``seq_lens`` above ``max_pages_per_seq * page_size`` or block-table ids
        outside ``[0, num_pages)`` for valid pages; a quantized pool without ``k_scale``/``v_scale``, scales of
        the wrong shape or dtype, scales with a float pool; ``ValueError`` naming ``kv_cache_dtype`` and the
        supported formats for a format the backend cannot run (fp8 e4m3 on the Triton backend below sm_89);
        ``TypeError`` / ``ValueError`` for a ``window_left`` that is not an int ``>= -1``.
    """
    checked = _checked_dense(q, k_cache, v_cache, block_table, seq_lens, scale, backend, k_scale, v_scale)
    window_left = V.check_window_left(window_left)
    if not torch.compiler.is_compiling():       # plan + run (validated above: the plan trusts the tables)
        return _planned("dense", checked.backend, checked, block_table, seq_lens).run(
            q, k_cache, v_cache, return_lse=return_lse, k_scale=k_scale, v_scale=v_scale, window_left=window_left)
    shapes, scale, backend = checked.shapes, checked.scale, checked.backend
    k_cache, v_cache = _dequantized(q, k_cache, v_cache, k_scale, v_scale, backend)
    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    page_indices = None                          # the Triton kernel walks every valid page itself
    if backend == "torch" or q.dtype == torch.float64:
        page_indices = T.dense_page_indices(seq_lens, shapes.num_kv_heads, shapes.max_pages_per_seq,
                                            shapes.page_size)
    return _attention(q, q4, k_cache, v_cache, block_table, seq_lens, page_indices, scale, return_lse, backend,
                      window_left=window_left)


def update_page_metadata(k_cache, block_table, seq_lens, k_min, k_max, *, backend=None, k_scale=None):
    """Recompute the bounding box of every page the rows touch, in place; returns ``None``.

    ``k_min[p, h, i]`` / ``k_max[p, h, i]`` = min / max over the valid tokens of physical page ``p`` of
    ``k_cache[p, t, h, i]`` (DESIGN.md §1; padding slots of a partial last page are excluded). Pages no row
    touches are left as they are. A page shared by several rows must hold the same valid tokens in each.

    Args:
        k_cache: ``[num_pages, page_size, Hkv, D]`` fp16 / bf16 / fp32 (keys after RoPE).
        block_table, seq_lens: as in :func:`paged_attention`.
        k_min, k_max: ``[num_pages, Hkv, D]``, dtype of ``k_cache``, fp32, or bf16 / fp16 (then rounded outward,
            ``k_min`` down and ``k_max`` up, so the Quest bound stays an upper bound; :mod:`tinyattn.ops.boxes`);
            written in place.
        k_scale: ``[num_pages, Hkv]`` fp32 scales of an int8 / float8_e4m3fn ``k_cache`` (then ``k_min``/``k_max``
            are fp32 boxes of the dequantized keys ``code.float() * scale``, the values attention reads);
            ``None`` for a float pool.

    Raises:
        TypeError / ValueError naming the argument (as :func:`paged_attention`), a quantized pool without
        ``k_scale`` or with scales of the wrong shape, ``kv_cache_dtype`` the backend cannot run.
    """
    _, page_size, _, _ = V.check_metadata_inputs(k_cache, block_table, seq_lens, k_min, k_max, k_scale)
    backend = resolve_backend(backend, k_cache.device)
    if backend == "triton":
        V.check_kernel_page_size(page_size)
        V.check_kv_backend(k_cache, backend)
    with span("metadata", k_cache=k_cache, block_table=block_table, seq_lens=seq_lens, k_min=k_min):
        if backend == "torch" or k_cache.dtype == torch.float64:
            T.update_page_metadata(k_cache, block_table, seq_lens, k_min, k_max, k_scale)
        elif _boxes_exact(k_cache, k_min, k_scale):
            _kernels().update_page_metadata(k_cache, _int32(block_table), _int32(seq_lens), k_min, k_max,
                                            k_scale=k_scale)
        else:   # narrower boxes: the kernel's fp32 min / max, then rounded outward (tinyattn.ops.boxes)
            lo, hi = k_min.float(), k_max.float()
            _kernels().update_page_metadata(k_cache, _int32(block_table), _int32(seq_lens), lo, hi, k_scale=k_scale)
            k_min.copy_(boxes.round_down(lo, k_min.dtype))
            k_max.copy_(boxes.round_up(hi, k_max.dtype))


def _boxes_exact(k_cache, k_min, k_scale) -> bool:
    """Whether boxes of ``k_min``'s dtype hold every key value exactly (then the kernel stores them directly)."""
    keys = torch.float32 if k_scale is not None else k_cache.dtype
    return k_min.dtype == keys or k_min.dtype == torch.float32


def page_scores(q, k_min, k_max, block_table, seq_lens, *, page_size, backend=None):
    """Quest upper bound of ``q·k`` for every logical page: fp32 ``[B, Hkv, max_pages_per_seq]``.

    ``ub(q, j) = Σ_i max(q_i·k_min[j,h,i], q_i·k_max[j,h,i])`` (Quest §3.2; TinyServe eq. 2), maximised over
    the ``G = Hq / Hkv`` query heads of each KV head's group and over the ``Tq`` queries, so it bounds every
    logit the group can produce from page ``j``. Pages past a row's end score ``-inf``. Unscaled (no ``scale``).

    Args:
        q: ``[B, Hq, D]`` or ``[B, Tq, Hq, D]``. k_min, k_max: ``[num_pages, Hkv, D]``.
        block_table, seq_lens: as in :func:`paged_attention`. page_size: tokens per page (int >= 1).
    """
    q4, page_size = V.check_scoring_inputs(q, k_min, k_max, block_table, seq_lens, page_size)
    backend = resolve_backend(backend, q.device)
    if backend == "triton":
        V.check_kernel_page_size(page_size)
    return _page_scores(q4, k_min, k_max, block_table, seq_lens, page_size, backend)


def _page_scores(q4, k_min, k_max, block_table, seq_lens, page_size, backend):
    """page_scores on validated inputs (sparse_paged_attention calls it without validating twice)."""
    with span("score", q=q4, k_min=k_min, block_table=block_table, seq_lens=seq_lens, page_size=page_size):
        # under torch.compile: the opaque custom op (the body launches Triton or makes host-side choices)
        run = L.page_scores_op if torch.compiler.is_compiling() else L.run_page_scores
        return run(q4, k_min, k_max, block_table, seq_lens, page_size, backend)


def select_pages(scores, seq_lens, *, page_size, page_budget, num_sink_pages=0, num_recent_pages=1,
                 num_query_tokens=1, backend=None):
    """Keep ``page_budget`` logical pages per (row, KV head): int32 ``[B, Hkv, page_budget]``.

    Kept, in this order until the budget is full: the last ``max(num_recent_pages, 1)`` valid pages (the
    partial last page always; with ``num_query_tokens > 1`` every page holding a query), the first
    ``num_sink_pages`` pages (attention sinks, StreamingLLM), then the highest ``scores``; ties go to the lower
    page index. A row with at most ``page_budget`` valid pages keeps them all. Output is ascending, ``-1``
    padded, never a duplicate, never a page past the row's end. The token budget is ``page_budget * page_size``.
    NaN scores count as ``-inf`` (ties with it go to the lower page index). ``ValueError`` when
    ``num_sink_pages + max(num_recent_pages, 1) > page_budget``.

    Args:
        scores: fp32 ``[B, Hkv, max_pages_per_seq]`` (from :func:`page_scores`). seq_lens: ``[B]`` int.
        page_size, page_budget (>= 1), num_sink_pages (>= 0), num_recent_pages (>= 0), num_query_tokens (>= 1): ints.
    """
    options = V.check_select_inputs(scores, seq_lens, page_size, page_budget, num_sink_pages, num_recent_pages,
                                    num_query_tokens)
    return _select_pages(scores, seq_lens, options, resolve_backend(backend, scores.device))


def _select_pages(scores, seq_lens, options, backend):
    """select_pages on validated inputs; ``options`` holds its keyword arguments."""
    with span("topk", scores=scores, seq_lens=seq_lens, page_budget=options["page_budget"]):
        run = L.select_pages_op if torch.compiler.is_compiling() else L.run_select_pages
        return run(scores, seq_lens, options["page_size"], options["page_budget"], options["num_sink_pages"],
                   options["num_recent_pages"], options["num_query_tokens"], backend)


def sparse_paged_attention(q, k_cache, v_cache, block_table, seq_lens, *, page_indices=None, k_min=None,
                           k_max=None, page_budget=None, num_sink_pages=0, num_recent_pages=1, scale=None,
                           return_lse=False, backend=None, k_scale=None, v_scale=None, window_left=-1):
    """Query-aware sparse paged attention: attend only to the selected pages of each (row, KV head).

    Either pass ``page_indices`` (``[B, Hkv, K]`` logical pages, e.g. from :func:`select_pages`), or pass
    ``k_min``, ``k_max`` and ``page_budget`` and the op scores (:func:`page_scores`) and selects
    (:func:`select_pages`) itself. All query heads of a GQA group read the pages of their KV head. With every
    valid page selected the result equals :func:`paged_attention`. Page ids that are ``-1`` or past the row's
    end are ignored, and so are duplicates (the reference raises on them instead).

    Args:
        q, k_cache, v_cache, block_table, seq_lens, scale, return_lse, backend, k_scale, v_scale: as in
            :func:`paged_attention` (quantized pools with their scales).
        page_indices: ``[B, Hkv, K]`` int32 (int64 accepted) logical page ids, ``-1`` = padding.
        k_min, k_max: ``[num_pages, Hkv, D]`` page bounding boxes (:func:`update_page_metadata`); for a
            quantized pool, fp32 (or ``q``'s dtype) boxes of the dequantized keys.
        page_budget: pages kept per (row, KV head), >= 1; token budget = ``page_budget * page_size``.
        num_sink_pages, num_recent_pages: pages always kept at the start and at the end of each row. With
            ``page_indices`` they describe how those were chosen (read by :mod:`tinyattn.profiler`'s oracle).
        window_left: sliding window as in :func:`paged_attention` (``-1`` = none). The window is a mask on top of
            the selection: a query attends the selected keys inside its window. Selecting by boxes, the pages
            wholly before the window of the row's earliest query score ``-inf`` (ranked after every page that
            overlaps the window, so the budget goes to the window; when the window's pages fit the budget the
            result equals dense windowed attention), and ``num_sink_pages`` must be 0 (the window hides the
            first pages once it slides past them).

    Returns:
        ``out`` like ``q`` (and fp32 ``lse`` if ``return_lse``).

    Raises:
        ValueError / TypeError as :func:`paged_attention`, and when neither ``page_indices`` nor
        ``k_min``/``k_max``/``page_budget`` are given, or the budget cannot hold the ``Tq`` query pages or
        ``num_sink_pages + max(num_recent_pages, 1)`` pages; ``window_left`` not an int ``>= -1``, or
        ``num_sink_pages > 0`` with a window and a selection by boxes.

    Source: Quest (Tang et al., ICML 2024, §3.2-3.3), TinyServe (Liu & Yu, arXiv 2509.12211, §3, eq. 2).
    """
    checked = _checked_sparse(q, k_cache, v_cache, block_table, seq_lens, page_indices, k_min, k_max, page_budget,
                              num_sink_pages, num_recent_pages, scale, backend, k_scale, v_scale)
    if page_indices is None:       # unfilled boxes (torch.empty, NaN): an error, not arbitrary pages (issue 28)
        V.check_boxes_filled(k_min, k_max, k_cache, block_table, seq_lens, checked.shapes.page_size, k_scale)
    window_left = V.check_window_left(window_left)
    if page_indices is None:
        V.check_window_selection(window_left, num_sink_pages)
    if not torch.compiler.is_compiling():       # plan + run (validated above: the plan trusts the tables)
        return _planned("sparse", checked.backend, checked, block_table, seq_lens).run(
            q, k_cache, v_cache, k_min=k_min, k_max=k_max, page_indices=page_indices, return_lse=return_lse,
            k_scale=k_scale, v_scale=v_scale, window_left=window_left)
    shapes, scale, backend = checked.shapes, checked.scale, checked.backend
    k_cache, v_cache = _dequantized(q, k_cache, v_cache, k_scale, v_scale, backend)
    selection = checked.selection if page_indices is None else dict(checked.selection,
                                                                      page_budget=page_indices.shape[-1])
    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    if page_indices is None:
        if _nothing_to_attend(q4, k_cache, block_table, None):
            return _attention(q, q4, k_cache, v_cache, block_table, seq_lens, None, scale, return_lse, backend)
        # inputs are validated once above; selection has no gradient, so it scores a detached q
        scores = _page_scores(q4.detach(), k_min, k_max, block_table, seq_lens, shapes.page_size, backend)
        scores = core.mask_pages_before_window(scores, seq_lens, shapes.page_size, shapes.num_query_tokens,
                                               window_left)
        page_indices = _select_pages(scores, seq_lens, dict(selection, page_size=shapes.page_size,
                                                            num_query_tokens=shapes.num_query_tokens), backend)
    else:
        page_indices = T.canonical_page_indices(page_indices, seq_lens, shapes.page_size)
    return _attention(q, q4, k_cache, v_cache, block_table, seq_lens, page_indices.contiguous(), scale,
                      return_lse, backend, selection, window_left)


def _checked_sparse(q, k_cache, v_cache, block_table, seq_lens, page_indices, k_min, k_max, page_budget,
                    num_sink_pages, num_recent_pages, scale, backend, k_scale=None, v_scale=None) -> _Checked:
    """Validate ``sparse_paged_attention``'s arguments, or recall the last identical call's result.

    The plan's selection rules: with boxes, the budget and forced pages; with ``page_indices``, only the forced
    pages (the profiler reads them; the list's width is its budget).
    """
    sig = V.signature(q, k_cache, v_cache, block_table, seq_lens, page_indices, k_min, k_max, page_budget,
                      num_sink_pages, num_recent_pages, scale, backend, k_scale, v_scale)
    tables = (block_table, seq_lens) if page_indices is None else (block_table, seq_lens, page_indices)
    hit = V.recall("sparse", sig, tables) if all(isinstance(t, torch.Tensor) for t in tables) else None
    if hit is not None:
        return hit
    _, shapes = V.check_paged_inputs(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale)
    selection = V.check_sparse_selection(shapes, q, k_cache, seq_lens, page_indices, k_min, k_max, page_budget,
                                         num_sink_pages, num_recent_pages)
    if page_indices is not None:
        selection = dict(num_sink_pages=selection["num_sink_pages"], num_recent_pages=selection["num_recent_pages"])
    scale = V.check_scale(scale, shapes.head_dim)
    backend = resolve_backend(backend, q.device)
    if backend == "triton":
        V.check_kernel_page_size(shapes.page_size)
        V.check_kv_backend(k_cache, backend)
    return V.remember("sparse", sig, tables, _Checked(shapes, scale, backend, selection))
