"""The public ops of DESIGN.md §3: validate once, then one call into the plan implementation of the backend.

Backends (DESIGN.md §4): CUDA tensors, or any tensor when ``TRITON_INTERPRET=1``, run the Triton forms; CPU tensors
otherwise run the torch forms. ``backend="triton" | "torch"`` forces one. The attention ops keep, per thread and op,
one plan (:class:`tinyattn.PagedAttentionPlan`, FlashInfer's plan / run): the arguments are checked here, and the
plan is re-planned (trusted: no second check) only when the tables or the step's sizes differ from the last call's;
then its implementation runs (:class:`tinyattn.ops.plan_torch.TorchPlan`, :class:`tinyattn.ops.plan_triton.TritonPlan`).
While ``torch.compile`` traces, the same plan steps run inside custom ops (:mod:`tinyattn.ops.custom_ops`).

Method: Quest (Tang et al., ICML 2024) and TinyServe (Liu & Yu, arXiv 2509.12211). The page bound
is Quest §3.2 / TinyServe eq. 2: ``ub(q, j) = Σ_i max(q_i·k_min[j,i], q_i·k_max[j,i]) ≥ max_{t∈j} q·k_t``; its
``gamma`` form is the box estimate ``q·c + gamma·|q|·r``; ``top_p`` is Twilight's adaptive budget (Lin et al., arXiv
2502.02770).
"""

from __future__ import annotations

import threading

import torch

from . import custom_ops
from . import validation as checks
from .kv_cache import torch_impl as kv_cache
from .plan import BACKENDS, PagedAttentionPlan, resolve_backend  # noqa: F401 (re-exported)
from .selection import torch_impl as selection
from .spans import span

__all__ = ["paged_attention", "sparse_paged_attention", "update_page_metadata", "page_scores", "select_pages",
           "rerank_scores", "encode_key_codes",
           "write_kv", "resolve_backend", "resolve_write_backend", "BACKENDS", "WRITE_BACKENDS"]

WRITE_BACKENDS = ("torch", "triton")
_plans = threading.local()


def _kv_kernels():
    from .kv_cache import triton_impl     # imported lazily: a CPU-only user never needs triton
    return triton_impl


def _selection_kernels():
    from .selection import triton_impl
    return triton_impl


def _int32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int32).contiguous()


# ------------------------------------------------------------------------------------------- attention
def _planned(op: str, call: checks.Call, block_table, seq_lens):
    """The implementation of this thread's plan for ``op`` (``"dense"`` / ``"sparse"``), planned for this call.

    One plan per op and backend, so that a loop alternating dense and sparse calls on the same tables (a
    benchmark, a model with dense layers) does not re-plan at every call. A call with the same sizes and rules as
    the plan's step and equal tables reuses it (CPU tables only: comparing GPU tables would be a host sync, as
    planning is); anything else plans again, trusting the checks just made."""
    key = op + call.backend
    plan = getattr(_plans, key, None)
    if plan is None:
        plan = PagedAttentionPlan(backend=call.backend)
        setattr(_plans, key, plan)
    step = plan.step
    seen = getattr(plan, "_seen_tables", None)     # the tables as given (their dtype: a cheaper compare)
    if (step is not None and step[1:17] == call.step and block_table.is_cpu and seen is not None
            and seen[0].dtype == block_table.dtype and seen[1].dtype == seq_lens.dtype
            and torch.equal(seen[0], block_table) and torch.equal(seen[1], seq_lens)):
        if not plan._unchecked or not checks.value_checks_active():
            return plan._impl                  # the same tables, their values checked when it was planned
        checks.check_step_values(block_table, seq_lens, call)     # planned under value_checks(False)
        plan._unchecked = False
        return plan._impl
    plan.step = None                           # a plan whose checks failed must not serve the next call
    plan._seen_tables = None
    checks.check_step_values(block_table, seq_lens, call)
    plan.plan(block_table, seq_lens, trusted=True, **call.plan_args)
    plan._unchecked = not checks.value_checks_active()
    if block_table.is_cpu:   # copies in the caller's dtypes: torch.equal across dtypes costs 4x one within a dtype
        plan._seen_tables = (block_table.clone(), seq_lens.clone())
    return plan._impl


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

    Source: the dense baseline of Quest (Tang et al., ICML 2024); causal alignment as FlashAttention's
    ``flash_attn_with_kvcache``.
    """
    call = checks.check_attention(q, k_cache, v_cache, block_table, seq_lens, scale, backend, k_scale, v_scale,
                                  window_left)
    if torch.compiler.is_compiling():
        return _compiled(q, k_cache, v_cache, block_table, seq_lens, call, None, None, None, return_lse, k_scale,
                         v_scale)
    impl = _planned("dense", call, block_table, seq_lens)
    scales = None if k_scale is None else (k_scale, v_scale)
    return impl.run(q, k_cache, v_cache, None, None, None, return_lse, None, call.scale, scales, call.window_left)


def sparse_paged_attention(q, k_cache, v_cache, block_table, seq_lens, *, page_indices=None, k_min=None,
                           k_max=None, page_budget=None, num_sink_pages=0, num_recent_pages=1, scale=None,
                           return_lse=False, backend=None, k_scale=None, v_scale=None, window_left=-1, gamma=1.0,
                           top_p=None, rerank=None, candidates=1.0, k_code=None):
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
        gamma: the page estimate of a selection by boxes, a number in ``[0, 1]``: :func:`page_scores`' ``gamma``
            (``1.0``, the default: Quest's bound, bit for bit).
        top_p: ``None`` (default: ``page_budget`` pages) or a number in ``(0, 1]``: ``page_budget`` becomes the
            capacity, and the selection keeps, after the forced pages, the fewest best pages whose estimated
            attention mass ``softmax(scale · score)`` (this call's ``scale``), with the forced pages', reaches
            ``top_p`` (:func:`select_pages`). The result equals attention over the pages ``select_pages(
            page_scores(..., gamma=gamma), ..., top_p=top_p, scale=scale)`` keeps. Fixed shapes, no host sync.
        rerank: ``None`` (default) or ``"int4"``: a second stage (Twilight's, arXiv 2502.02770). The estimate picks
            ``C = ceil(candidates · page_budget)`` candidates (``select_pages(page_scores(..., gamma), page_budget=C)``,
            forced pages included), :func:`rerank_scores` estimates each candidate's attention mass from its 4-bit
            key codes, and ``page_budget`` pages are selected by that log-mass (with ``top_p``: pruned by it,
            softmax scale 1). The result equals attention over ``select_pages(rerank_scores(...), ..., top_p=top_p,
            scale=1.0)``. Needs ``k_code``; decode-time only (not while ``torch.compile`` traces).
        candidates: a number ``>= 1``: the candidates as a multiple of ``page_budget`` (``1``: the capacity).
        k_code: ``[num_pages, page_size, Hkv, D/2]`` uint8, the pool's 4-bit key codes (:func:`encode_key_codes`;
            :class:`tinyattn.PagedKVCache` with ``key_codes=True`` keeps them), with ``rerank`` only.

    Returns:
        ``out`` like ``q`` (and fp32 ``lse`` if ``return_lse``).

    Raises:
        ValueError / TypeError as :func:`paged_attention`, and when neither ``page_indices`` nor
        ``k_min``/``k_max``/``page_budget`` are given, or the budget cannot hold the ``Tq`` query pages or
        ``num_sink_pages + max(num_recent_pages, 1)`` pages; ``window_left`` not an int ``>= -1``, or
        ``num_sink_pages > 0`` with a window and a selection by boxes; boxes that do not hold their page's keys
        (never filled by :func:`update_page_metadata`); ``gamma`` outside ``[0, 1]`` or ``top_p`` outside
        ``(0, 1]`` (``ValueError`` naming it; ``TypeError`` for a non-number), ``top_p`` or a ``gamma`` other than 1
        with ``page_indices`` (they shape a selection by boxes only; ignoring them would be silent),
        ``top_p`` with a ``scale <= 0``; ``rerank`` not ``None`` / ``"int4"``, ``candidates`` not a finite number
        ``>= 1``, ``rerank`` with ``page_indices``, ``k_code`` missing or of the wrong shape / dtype / device with
        ``rerank`` (or given without it), an odd ``head_dim`` with ``rerank``.

    Source: Quest (Tang et al., ICML 2024, §3.2-3.3), TinyServe (Liu & Yu, arXiv 2509.12211, §3, eq. 2); the box
    estimate: issue 35 (Quest's slack shrunk by ``gamma``); top-p over the estimated attention mass: Twilight (Lin
    et al., arXiv 2502.02770).
    """
    call = checks.check_sparse_attention(q, k_cache, v_cache, block_table, seq_lens, page_indices, k_min, k_max,
                                         page_budget, num_sink_pages, num_recent_pages, scale, backend, k_scale,
                                         v_scale, window_left, gamma, top_p, rerank, candidates, k_code)
    if torch.compiler.is_compiling():
        if call.plan_args["rerank"] is not None:
            raise NotImplementedError("rerank: the re-ranked selection runs eagerly only (not while torch.compile "
                                      "traces); compile with rerank=None")
        return _compiled(q, k_cache, v_cache, block_table, seq_lens, call, page_indices, k_min, k_max, return_lse,
                         k_scale, v_scale)
    impl = _planned("sparse", call, block_table, seq_lens)     # checks the table values first
    if page_indices is None:       # boxes never filled (torch.empty, NaN): an error, not arbitrary pages
        checks.check_boxes_filled(k_min, k_max, k_cache, block_table, seq_lens, call.plan_args["page_size"], k_scale)
    scales = None if k_scale is None else (k_scale, v_scale)
    return impl.run(q, k_cache, v_cache, k_min, k_max, page_indices, return_lse, None, call.scale, scales,
                    call.window_left, k_code)


def _compiled(q, k_cache, v_cache, block_table, seq_lens, call, page_indices, k_min, k_max, return_lse, k_scale,
              v_scale):
    """The public attention ops while ``torch.compile`` traces: the plan's selection and attention as custom ops
    (planning reads the tables on the host, which a traced graph cannot)."""
    from .attention.torch_impl import finish_output

    args = call.plan_args
    selection_rules = None
    if args["page_budget"] is not None:
        selection_rules = dict(page_budget=args["page_budget"], num_sink_pages=args["num_sink_pages"],
                               num_recent_pages=args["num_recent_pages"], gamma=args["gamma"], top_p=args["top_p"])
    o, lse = custom_ops.differentiable(
        q, k_cache, v_cache, block_table, seq_lens, page_size=args["page_size"], backend=call.backend,
        scale=call.scale, window_left=call.window_left, k_min=k_min, k_max=k_max, page_indices=page_indices,
        selection=selection_rules, scales=None if k_scale is None else (k_scale, v_scale),
        nothing=q.numel() == 0 or block_table.shape[1] == 0)
    return finish_output(q, o, lse, return_lse, None)


# ------------------------------------------------------------------------------------------- scoring, selection
def page_scores(q, k_min, k_max, block_table, seq_lens, *, page_size, gamma=1.0, backend=None):
    """Quest upper bound of ``q·k`` for every logical page (or, with ``gamma < 1``, the box estimate): fp32
    ``[B, Hkv, max_pages_per_seq]``.

    ``ub(q, j) = Σ_i max(q_i·k_min[j,h,i], q_i·k_max[j,h,i])`` (Quest §3.2; TinyServe eq. 2), maximised over
    the ``G = Hq / Hkv`` query heads of each KV head's group and over the ``Tq`` queries, so it bounds every
    logit the group can produce from page ``j``. Pages past a row's end score ``-inf``. Unscaled (no ``scale``).

    With ``gamma`` in ``[0, 1)`` the box estimate ``Σ_i a_i·k_max_i + b_i·k_min_i``, ``a = (q + gamma|q|)/2``,
    ``b = (q - gamma|q|)/2``, i.e. ``q·c + gamma·|q|·r`` (box centre ``c``, half-width ``r``), with the same max
    over the group and the queries: ``0`` is the box centre's logit, and in between an estimate, not a bound, that
    no longer ranks the widest boxes first (issue 35: on RULER ``niah_single_1`` Quest's slack buried the needle's
    narrow page). ``gamma = 1`` (default) is Quest's bound bit for bit.

    Args:
        q: ``[B, Hq, D]`` or ``[B, Tq, Hq, D]``. k_min, k_max: ``[num_pages, Hkv, D]``.
        block_table, seq_lens: as in :func:`paged_attention`. page_size: tokens per page (int >= 1).
        gamma: the share of the box half-width, a number in ``[0, 1]``.
        backend: ``None`` (by device), ``"torch"`` or ``"triton"``.

    Raises:
        TypeError / ValueError naming the argument (shapes, dtypes, devices, table values as
        :func:`paged_attention`); ``page_size`` not a power of two on the Triton backend; ``gamma`` outside
        ``[0, 1]`` (``ValueError``) or not a number (``TypeError``).
    """
    q4, page_size = checks.check_scoring_inputs(q, k_min, k_max, block_table, seq_lens, page_size, gamma)
    gamma = float(gamma)
    backend = resolve_backend(backend, q.device)
    if backend == "triton":
        checks.check_kernel_page_size(page_size)
    with span("score", q=q4, k_min=k_min, block_table=block_table, seq_lens=seq_lens, page_size=page_size):
        if torch.compiler.is_compiling():      # the opaque custom op (its body launches Triton or decides on the host)
            return custom_ops.page_scores_op(q4, k_min, k_max, block_table, seq_lens, page_size, backend, gamma)
        return run_page_scores(q4, k_min, k_max, block_table, seq_lens, page_size, backend, gamma)


def run_page_scores(q4, k_min, k_max, block_table, seq_lens, page_size: int, backend: str,
                    gamma: float = 1.0) -> torch.Tensor:
    """The body of :func:`page_scores` on validated inputs (q ``[B, Tq, Hq, D]``)."""
    if backend == "torch" or q4.dtype == torch.float64:
        return selection.page_scores(q4, k_min, k_max, block_table, seq_lens, page_size=page_size, gamma=gamma)
    out = torch.empty(q4.shape[0], k_min.shape[1], block_table.shape[1], dtype=torch.float32, device=q4.device)
    _selection_kernels().page_scores(q4, k_min, k_max, _int32(block_table), _int32(seq_lens), page_size=page_size,
                                     out=out, gamma=gamma)
    return out


def select_pages(scores, seq_lens, *, page_size, page_budget, num_sink_pages=0, num_recent_pages=1,
                 num_query_tokens=1, backend=None, top_p=None, scale=None):
    """Keep ``page_budget`` logical pages per (row, KV head): int32 ``[B, Hkv, page_budget]``.

    Kept, in this order until the budget is full: the last ``max(num_recent_pages, 1)`` valid pages (the
    partial last page always; with ``num_query_tokens > 1`` every page holding a query), the first
    ``num_sink_pages`` pages (attention sinks, StreamingLLM), then the highest ``scores``; ties go to the lower
    page index. A row with at most ``page_budget`` valid pages keeps them all. Output is ascending, ``-1``
    padded, never a duplicate, never a page past the row's end. The token budget is ``page_budget * page_size``.
    NaN scores count as ``-inf`` (ties with it go to the lower page index).

    **Top-p** (``top_p`` in ``(0, 1]``, with ``scale``): ``page_budget`` is then the capacity. Each page's estimated
    attention mass is ``softmax(scale · scores)`` over the row's valid pages (per KV head; NaN and ``-inf`` weigh 0,
    ``+inf`` counts as ``FLT_MAX``); after the forced pages (recent / query pages, sinks, whose mass counts first)
    the fewest highest-scoring pages whose mass, with the forced pages', reaches ``top_p`` are kept, at most
    ``page_budget`` in all. A row whose scores are all ``-inf`` keeps its capacity; ``top_p=1.0`` keeps the
    capacity (the pages of ``top_p=None``). The output keeps its shape (ascending, ``-1`` padded): no host sync, no
    data-dependent shape, CUDA-graph safe. Rows that fit the budget are pruned too.

    Args:
        scores: fp32 ``[B, Hkv, max_pages_per_seq]`` (from :func:`page_scores`). seq_lens: ``[B]`` int.
        page_size, page_budget (>= 1), num_sink_pages (>= 0), num_recent_pages (>= 0), num_query_tokens (>= 1): ints.
        backend: ``None`` (by device), ``"torch"`` or ``"triton"``.
        top_p: ``None`` (keep ``page_budget`` pages) or the estimated mass to reach, a number in ``(0, 1]``.
        scale: the softmax scale of the mass, a finite number > 0; required with ``top_p`` (``head_dim ** -0.5``
            for the logit-like :func:`page_scores`, the attention's own ``scale`` if it has one).

    Raises:
        ValueError when ``num_sink_pages + max(num_recent_pages, 1) > page_budget`` or the budget cannot hold the
        pages of the ``num_query_tokens`` queries; ``top_p`` outside ``(0, 1]``, ``top_p`` without ``scale``, a
        ``scale`` <= 0 with it; TypeError / ValueError naming the argument otherwise.

    Source: Quest (Tang et al., ICML 2024, §3.3); sink pages: StreamingLLM (Xiao et al., ICLR 2024); top-p over the
    estimated attention mass: Twilight (Lin et al., arXiv 2502.02770).
    """
    options = checks.check_select_inputs(scores, seq_lens, page_size, page_budget, num_sink_pages,
                                         num_recent_pages, num_query_tokens, top_p, scale)
    backend = resolve_backend(backend, scores.device)
    with span("topk", scores=scores, seq_lens=seq_lens, page_budget=options["page_budget"]):
        run = custom_ops.select_pages_op if torch.compiler.is_compiling() else run_select_pages
        return run(scores, seq_lens, options["page_size"], options["page_budget"], options["num_sink_pages"],
                   options["num_recent_pages"], options["num_query_tokens"], backend, options["top_p"],
                   1.0 if options["scale"] is None else options["scale"])


def run_select_pages(scores, seq_lens, page_size: int, page_budget: int, num_sink_pages: int, num_recent_pages: int,
                     num_query_tokens: int, backend: str, top_p: float | None = None,
                     scale: float = 1.0) -> torch.Tensor:
    """The body of :func:`select_pages` on validated inputs."""
    options = dict(page_size=page_size, page_budget=page_budget, num_sink_pages=num_sink_pages,
                   num_recent_pages=num_recent_pages, num_query_tokens=num_query_tokens)
    if backend == "torch":
        return selection.select_pages(scores, seq_lens, top_p=top_p, scale=scale, **options)
    kernels = _selection_kernels()
    scores, seq_lens = scores.contiguous(), _int32(seq_lens)
    out = torch.empty(*scores.shape[:2], page_budget, dtype=torch.int32, device=scores.device)
    kernels.select_pages(scores, seq_lens, **options, out=out)
    if top_p is None:
        return out
    kept = torch.empty_like(out)
    options.pop("page_budget")
    kernels.top_p_filter(scores, out, seq_lens, top_p=top_p, scale=scale, out=kept, **options)
    return kept


def rerank_scores(q, k_code, k_cache, k_min, k_max, candidates, block_table, seq_lens, *, scale=None, window_left=-1,
                  k_scale=None, backend=None):
    """The log of each candidate page's estimated attention mass, from 4-bit key codes: fp32
    ``[B, Hkv, max_pages_per_seq]``, ``-inf`` off the candidates (issue 35's second stage; docs/design_rerank.md).

    For row ``b``, KV head ``h`` and the ``M = Tq·G`` query rows ``q_m`` of its group: each key of a candidate page
    is read as its codes decode, ``k~ = k_min + code · (k_max - k_min) / 15`` per channel (the row's last page: its
    exact keys, as it is always attended and coded only once full); ``λ_mt = scale · q_m·k~_t`` over the keys query
    ``m`` sees (causal, bottom-right; ``window_left``); ``Z_m = logsumexp_t λ_mt`` over all candidates;
    ``μ_j = log Σ_m Σ_{t∈j} exp(λ_mt - Z_m)``: the group's estimated attention mass on page ``j`` (up to ``M``).
    Feed it to :func:`select_pages` with ``scale=1.0`` (top-p over ``softmax(μ)`` is then top-p over that mass).

    Args:
        q: ``[B, Hq, D]`` or ``[B, Tq, Hq, D]``, ``D`` even. k_code: ``[num_pages, page_size, Hkv, D/2]`` uint8
            (:func:`encode_key_codes`). k_cache: the pool ``[num_pages, page_size, Hkv, D]`` (int8 / fp8 with
            ``k_scale``). k_min, k_max: its boxes ``[num_pages, Hkv, D]``.
        candidates: ``[B, Hkv, C]`` int32 / int64 logical pages, ``-1`` padded (e.g. :func:`select_pages`
            of :func:`page_scores`); a page listed twice counts once and ids past a row's end are ignored (the
            list is put in the canonical form of ``page_indices`` first).
        block_table, seq_lens, window_left, backend: as in :func:`paged_attention`. scale: default ``D ** -0.5``.

    Raises:
        TypeError / ValueError naming the argument (shapes, dtypes, devices, table values as
        :func:`page_scores`; ``k_cache`` not ``[num_pages, page_size, Hkv, D]`` with the boxes' ``num_pages`` and
        ``Hkv`` and ``q``'s ``D``; an int8 / fp8 ``k_cache`` without its ``k_scale`` ``[num_pages, Hkv]`` fp32, or a
        ``k_scale`` with a float one; ``k_code`` of another shape than ``[num_pages, page_size, Hkv, D/2]`` or not
        uint8, ``candidates`` not ``[B, Hkv, C]`` int, an odd ``head_dim``).

    Source: Twilight (Lin et al., arXiv 2502.02770: INT4 keys estimate the attention of Quest's candidates); the
    box as the quantization range: this library (docs/design_rerank.md).
    """
    checks.expect_tensor("k_cache", k_cache)
    checks.expect_dim("k_cache", k_cache, (4,), "[num_pages, page_size, Hkv, D]")
    q4, page_size = checks.check_scoring_inputs(q, k_min, k_max, block_table, seq_lens, k_cache.shape[1])
    checks.check_rerank_pool(k_cache, k_scale, k_min, q4)
    checks.check_key_codes(k_code, "int4", k_cache, q4)
    checks.check_candidates(candidates, q4.shape[0], k_min.shape[1], q.device)
    scale = checks.check_scale(scale, q4.shape[-1])
    window_left = checks.check_window_left(window_left)
    backend = resolve_backend(backend, q.device)
    if backend == "triton":
        checks.check_kernel_page_size(page_size)
    # distinct, in-range ids (the forms assume them: a duplicate would count twice, an id >= 2^31 wrap in int32)
    candidates = selection.canonical_page_indices(candidates, seq_lens, page_size)
    if backend == "torch" or q4.dtype == torch.float64:
        return selection.rerank_scores(q4, k_code, k_cache, k_min, k_max, candidates, block_table, seq_lens,
                                       page_size=page_size, scale=scale, window_left=window_left,
                                       k_scale=k_scale).contiguous()
    out = torch.empty(q4.shape[0], k_min.shape[1], block_table.shape[1], dtype=torch.float32, device=q.device)
    _selection_kernels().rerank_scores(q4, k_code, k_cache, k_min, k_max, _int32(candidates), _int32(block_table),
                                       _int32(seq_lens), page_size=page_size, scale=scale, out=out,
                                       window_left=window_left, k_scale=k_scale)
    return out


def encode_key_codes(k_cache, slots, k_min, k_max, k_code, *, k_scale=None, backend=None, trusted=False):
    """Write the 4-bit key codes of every page that a slot of ``slots`` fills (the write of its last slot,
    ``page_size - 1``), in place; returns ``None``. Call it after the write that stored ``slots`` and grew the boxes
    (:meth:`tinyattn.PagedKVCache.write` does, with ``key_codes=True``).

    ``code = clamp(floor((k - k_min) / step + 0.5), 0, 15)``, ``step = (k_max - k_min) / 15`` per (page, KV head,
    channel), in fp32 (``0`` where ``step <= 0``); channel ``i`` in the low nibble of ``k_code[p, s, h, i]``,
    channel ``i + D/2`` in its high nibble. The page's box is the quantization range (no scale is stored): ``D/2``
    bytes per key and head, 1/8 of fp32 keys.

    Args:
        k_cache: ``[num_pages, page_size, Hkv, D]`` float (int8 / fp8 with ``k_scale``: the dequantized keys).
        slots: ``[N]`` int32 / int64 physical slots just written (``page * page_size + offset``).
        k_min, k_max: ``[num_pages, Hkv, D]`` the boxes, already grown by the write.
        k_code: ``[num_pages, page_size, Hkv, D/2]`` uint8, written in place.
        backend: ``None`` (Triton for CUDA pools, torch otherwise), ``"torch"`` or ``"triton"``.
        trusted: the caller made and checked every tensor (:meth:`tinyattn.PagedKVCache.write`): no checks.

    Raises:
        TypeError / ValueError naming the argument (shapes, dtypes, devices; an odd ``head_dim``; ``slots`` outside
        ``[0, num_pages * page_size)``, a value check: one host sync, skipped under :func:`tinyattn.value_checks`
        ``(False)`` and with ``trusted``).

    Source: docs/design_rerank.md (issue 35); Twilight's INT4 keys (Lin et al., arXiv 2502.02770).
    """
    if not trusted:
        checks.check_code_inputs(k_cache, slots, k_min, k_max, k_code, k_scale)
    backend = resolve_write_backend(backend, k_cache.device)
    if backend == "triton" and k_cache.dtype != torch.float64:
        _kv_kernels().encode_key_codes(k_cache, slots, k_min, k_max, k_code, k_scale)
        return
    kv_cache.encode_key_codes(k_cache, slots, k_min, k_max, k_code, k_scale)


# ------------------------------------------------------------------------------------------- the page pool
def update_page_metadata(k_cache, block_table, seq_lens, k_min, k_max, *, backend=None, k_scale=None):
    """Recompute the bounding box of every page the rows touch, in place; returns ``None``.

    ``k_min[p, h, i]`` / ``k_max[p, h, i]`` = min / max over the valid tokens of physical page ``p`` of
    ``k_cache[p, t, h, i]`` (DESIGN.md §1; padding slots of a partial last page are excluded). Pages no row
    touches are left as they are. A page shared by several rows must hold the same valid tokens in each.

    Args:
        k_cache: ``[num_pages, page_size, Hkv, D]`` fp16 / bf16 / fp32 (keys after RoPE).
        block_table, seq_lens: as in :func:`paged_attention`.
        k_min, k_max: ``[num_pages, Hkv, D]``, dtype of ``k_cache``, fp32, or bf16 / fp16 (then rounded outward,
            ``k_min`` down and ``k_max`` up, so the Quest bound stays an upper bound;
            :mod:`tinyattn.ops.kv_cache.torch_impl`); written in place.
        k_scale: ``[num_pages, Hkv]`` fp32 scales of an int8 / float8_e4m3fn ``k_cache`` (then ``k_min``/``k_max``
            are fp32 boxes of the dequantized keys ``code.float() * scale``, the values attention reads);
            ``None`` for a float pool.
        backend: ``None`` (by device), ``"torch"`` or ``"triton"``.

    Raises:
        TypeError / ValueError naming the argument (as :func:`paged_attention`), a quantized pool without
        ``k_scale`` or with scales of the wrong shape, ``kv_cache_dtype`` the backend cannot run.

    Source: Quest (Tang et al., ICML 2024, §3.2): the per-channel min and max of a page's keys.
    """
    _, page_size, _, _ = checks.check_metadata_inputs(k_cache, block_table, seq_lens, k_min, k_max, k_scale)
    backend = resolve_backend(backend, k_cache.device)
    if backend == "triton":
        checks.check_kernel_page_size(page_size)
        checks.check_kv_backend(k_cache, backend)
    with span("metadata", k_cache=k_cache, block_table=block_table, seq_lens=seq_lens, k_min=k_min):
        if backend == "torch" or k_cache.dtype == torch.float64:
            kv_cache.update_page_metadata(k_cache, block_table, seq_lens, k_min, k_max, k_scale)
            return
        keys = torch.float32 if k_scale is not None else k_cache.dtype
        if k_min.dtype in (keys, torch.float32):     # boxes that hold every key exactly: the kernel stores them
            _kv_kernels().update_page_metadata(k_cache, _int32(block_table), _int32(seq_lens), k_min, k_max,
                                               k_scale=k_scale)
            return
        lo, hi = k_min.float(), k_max.float()        # narrower boxes: the kernel's fp32 min / max, rounded outward
        _kv_kernels().update_page_metadata(k_cache, _int32(block_table), _int32(seq_lens), lo, hi, k_scale=k_scale)
        k_min.copy_(kv_cache.round_down(lo, k_min.dtype))
        k_max.copy_(kv_cache.round_up(hi, k_max.dtype))


def resolve_write_backend(backend, device: torch.device) -> str:
    """``None``: ``"triton"`` for CUDA pools, ``"torch"`` otherwise (also under ``TRITON_INTERPRET=1``: the CPU's
    write path stays the torch one). ``"triton"`` on a CPU needs ``TRITON_INTERPRET=1`` (tests).

    Raises:
        ValueError: an unknown backend, or ``"triton"`` for CPU pools without the interpreter.
    """
    if backend is None:
        return "triton" if device.type == "cuda" else "torch"
    if backend not in WRITE_BACKENDS:
        raise ValueError(f"backend: expected one of {WRITE_BACKENDS} or None, got {backend!r}")
    if backend == "triton" and device.type != "cuda":
        from ..kernels import is_interpreting
        if not is_interpreting():
            raise ValueError(f"backend: 'triton' needs CUDA pools or TRITON_INTERPRET=1 set before triton is "
                             f"imported, got pools on {device}")
    return backend


def write_kv(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
             k_min: torch.Tensor | None = None, k_max: torch.Tensor | None = None,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
             fill: torch.Tensor | None = None, pages: torch.Tensor | None = None, backend: str | None = None,
             trusted: bool = False) -> None:
    """Store ``k``, ``v`` at ``slots`` of a paged pool and grow the touched pages' boxes and scales, in place (vLLM's
    ``reshape_and_cache`` plus the box upkeep of Quest; the policy: :mod:`tinyattn.ops.kv_cache.torch_impl`).

    Args:
        k, v: ``[N, Hkv, D]`` float (any float dtype; cast to the pool's).
        slots: ``[N]`` int32 / int64 physical slots ``page * page_size + offset``, in ``[0, num_pages * page_size)``
            (not checked here: no host sync; :meth:`PagedKVCache.write` checks), distinct.
        k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` fp32 / fp16 / bf16 / int8 / float8_e4m3fn (fp64: torch
            backend only).
        k_min, k_max: ``[num_pages, Hkv, D]`` boxes (fp32 / fp16 / bf16), or None (no boxes).
        k_scale, v_scale: int8 / fp8 pools: ``[num_pages, Hkv]`` fp32 scales (``value = code * scale``).
        fill: int8 / fp8 pools: ``[num_pages]`` int64 valid slots per page (shared by all layers; idempotent).
        pages: optional ``slots // page_size`` (int64) when the caller has it (torch backend).
        backend: None (Triton for CUDA pools, torch otherwise), ``"torch"`` or ``"triton"``.
        trusted: the caller made and checked every tensor (:meth:`tinyattn.PagedKVCache.write`, once per layer per
            step): the argument checks are skipped.

    Raises:
        TypeError / ValueError naming the argument for wrong types, shapes, dtypes or devices, before anything
        is written (:func:`resolve_write_backend` for ``backend``).
    """
    if not trusted:
        checks.check_write_inputs(k, v, slots, k_cache, v_cache, k_min, k_max, k_scale, v_scale, fill)
    backend = resolve_write_backend(backend, k_cache.device)
    if backend == "triton" and k_cache.dtype != torch.float64:
        with span("metadata", k_new=k, pages=k.shape[0]):
            _kv_kernels().write_kv(k, v, slots, k_cache, v_cache, k_min, k_max, k_scale, v_scale, fill)
        return
    kv_cache.write_kv(k, v, slots, k_cache, v_cache, k_min, k_max, k_scale, v_scale, fill, pages)
