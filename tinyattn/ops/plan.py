"""Plan once per step, run per layer: the decode path of tinyattn (FlashInfer's plan/run pattern).

A decode step runs the same attention geometry in every layer: the same ``block_table``, ``seq_lens``,
head counts and selection rules, only ``q`` and the layer's pool change. :class:`PagedAttentionPlan` is the
thin public front; everything that depends on the step alone happens once, in :meth:`~PagedAttentionPlan.plan`:

- validates the tables and options (at most one host sync, none with ``trusted=True``);
- picks the backend once (Triton for CUDA tensors or under ``TRITON_INTERPRET=1``, torch otherwise) and hands the
  step to that backend's implementation, which **copies** the tables into storage of its own (FlashInfer's plan
  copies its index arrays into its workspace) and builds what its layers reuse:
  :class:`tinyattn.ops.plan_torch.TorchPlan` (index tables, selection keys) or
  :class:`tinyattn.ops.plan_triton.TritonPlan` (int32 tables, scores, selection workspaces, split-K partials,
  lse; allocated once at capacity with ``max_batch`` / ``max_pages_per_seq``, so a CUDA graph can capture
  :meth:`~PagedAttentionPlan.run`).

:meth:`~PagedAttentionPlan.run` checks shapes (host integers only) and makes **one call** into the chosen
implementation's ``run``, which attends with autograd when a gradient is needed (the torch forms are
differentiable; the Triton backend selects without gradient, then calls the ``tinyattn::paged_attention_fwd``
custom op with its backward) and through the custom ops while ``torch.compile`` traces
(:mod:`tinyattn.ops.custom_ops`). A per-layer ``scale`` is an argument passed down, never stored in the plan.

The contract with the tables: what :meth:`~PagedAttentionPlan.plan` saw is what every :meth:`~PagedAttentionPlan.run`
of the step computes with, on every backend, even if the caller changes ``block_table`` / ``seq_lens`` in place
afterwards (they are copied). A new step (new lengths, new pages) needs a new :meth:`~PagedAttentionPlan.plan`.

Example (one decode step of a model with ``L`` layers)::

    plan = tinyattn.PagedAttentionPlan()                      # keep it: buffers are reused across steps
    plan.plan(block_table, seq_lens, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
              page_budget=128)                                # once per step
    for layer in range(L):
        out = plan.run(q[layer], k_cache[layer], v_cache[layer],
                       k_min=k_min[layer], k_max=k_max[layer])  # Quest selection, then sparse attention
        dense = plan.run(q[layer], k_cache[layer], v_cache[layer])  # no boxes: dense over every valid page
        local = plan.run(q[layer], k_cache[layer], v_cache[layer], window_left=4095)  # sliding window of 4096

Method: Quest (Tang et al., ICML 2024, §3.2-3.3), TinyServe (Liu & Yu, arXiv 2509.12211, eq. 2).
Pattern: FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper.plan`` / ``run``.
"""

from __future__ import annotations

import torch

from . import validation as V
from .validation import BACKENDS, resolve_backend
from .layout import cdiv_pages
from .step import Step

__all__ = ["PagedAttentionPlan", "resolve_backend", "BACKENDS"]

def _implementation(backend: str):
    """The class that runs a step on ``backend`` (imported lazily: a CPU-only user never imports triton)."""
    if backend == "triton":
        from .plan_triton import TritonPlan
        return TritonPlan
    from .plan_torch import TorchPlan
    return TorchPlan


class PagedAttentionPlan:
    """Per-step plan of paged (dense or query-aware sparse) attention; reusable across steps.

    Args:
        backend: ``None`` (by device: Triton for CUDA tensors or under ``TRITON_INTERPRET=1``, torch
            otherwise), ``"torch"`` or ``"triton"``.

    Call :meth:`plan` once per step, then :meth:`run` once per layer. A plan is not thread-safe. The tables are
    copied by :meth:`plan`: changing them afterwards does not change the planned step (plan again for a new one).
    """

    def __init__(self, *, backend: str | None = None):
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS} or None, got {backend!r}")
        self._backend_arg = backend
        self._impls: dict = {}        # backend -> its implementation (workspaces reused across steps)
        self._impl = None
        self.step: Step | None = None
        self._max_page_id = None      # the largest page id the tables use, when checked (run compares)

    def __repr__(self) -> str:
        if self.step is None:
            return "PagedAttentionPlan(not planned)"
        s = self.step
        return (f"PagedAttentionPlan(backend={s.backend!r}, batch={s.batch}, num_query_tokens={s.num_query_tokens}, "
                f"heads={s.num_q_heads}/{s.num_kv_heads}, head_dim={s.head_dim}, page_size={s.page_size}, "
                f"page_budget={s.page_budget}, gamma={s.gamma}, top_p={s.top_p}, rerank={s.rerank!r})")

    # the planned step's values, read by the attention layer and the selection policies
    @property
    def _planned(self) -> bool:
        return self.step is not None

    @property
    def backend(self) -> str:
        return self.step.backend

    @property
    def scale(self) -> float:
        """The step's softmax scale (``head_dim ** -0.5`` unless :meth:`plan` was given one)."""
        return self.step.scale

    @property
    def block_table(self) -> torch.Tensor:
        """The planned block table (the plan's own copy)."""
        return self._impl.block_table

    @property
    def seq_lens(self) -> torch.Tensor:
        """The planned ``seq_lens`` (the plan's own copy)."""
        return self._impl.seq_lens

    @property
    def last_selection(self) -> torch.Tensor | None:
        """Logical pages ``[B, Hkv, page_budget]`` the last :meth:`run` with boxes attended (``-1``, or a page past
        the row's end, = not attended: with ``top_p`` the pages it dropped), or ``None`` when no run of this step
        selected yet (a dense step). A device tensor the next run may overwrite: read it at once; no host sync, no
        copy (the attended-pages counts of :class:`tinyattn.metrics.PagesAttended` read it)."""
        return None if self.step is None else self._impl.last_selection()

    @property
    def selects(self) -> bool:
        """True when :meth:`run` with boxes really selects: some row holds more pages than ``page_budget``.

        ``False`` when every row fits its budget (the sparse step is then the dense one, and :meth:`run`
        skips scoring and top-k), or with no budget.
        """
        return self.step is not None and self.step.selects

    # ------------------------------------------------------------------------------------------- plan
    def plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor, *, num_q_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, num_query_tokens: int = 1, page_budget: int | None = None,
             num_sink_pages: int = 0, num_recent_pages: int = 1, scale: float | None = None,
             num_pages: int | None = None, trusted: bool = False, max_batch: int | None = None,
             max_pages_per_seq: int | None = None, gamma: float = 1.0,
             top_p: float | None = None, rerank: str | None = None,
             candidates: float = 1.0) -> "PagedAttentionPlan":
        """Validate the step's tables and settings, copy them into the plan, build what the layers reuse; returns
        ``self``.

        Args:
            block_table: ``[B, max_pages_per_seq]`` int32 (int64 accepted): physical page of each logical page.
            seq_lens: ``[B]`` int32 (int64 accepted): valid tokens per row including the ``Tq`` queries.
            num_q_heads, num_kv_heads, head_dim: ``Hq`` (a multiple of ``Hkv``), ``Hkv``, ``D``.
            page_size: tokens per page (a power of two for the Triton backend).
            num_query_tokens: ``Tq``, queries per row (1 = decode); causal bottom-right.
            page_budget: pages kept per (row, KV head) when :meth:`run` selects (``None``: :meth:`run` with
                boxes is dense). num_sink_pages, num_recent_pages: pages always kept (see
                :func:`tinyattn.select_pages`); ``num_sink_pages + max(num_recent_pages, 1) <= page_budget``.
            scale: softmax scale, default ``head_dim ** -0.5``.
            num_pages: pages in the pool the layers' caches hold; when given, the block-table ids of valid
                pages are checked against it (else only against the id dtype).
            trusted: skip the data-dependent checks (``seq_lens`` within the table, page ids in range),
                e.g. for tables made by :class:`tinyattn.PagedKVCache`: then planning makes no host sync on a GPU.
            max_batch, max_pages_per_seq: capacity (graph mode, Triton backend): every table, workspace and
                partial buffer is allocated once at this size and later plans within it only copy the step's
                values, so :meth:`run` makes no allocation (with ``out=``), no host sync and no data-dependent
                shape, and can be captured in a CUDA graph and replayed after each new :meth:`plan` (vLLM's
                persistent-buffer pattern). ``B <= max_batch`` and ``max_pages_per_seq`` >= the table's width.
            gamma: the page estimate of a selection by boxes, a number in ``[0, 1]``: ``Σ_i a_i·k_max_i +
                b_i·k_min_i`` with ``a = (q + gamma|q|)/2``, ``b = (q - gamma|q|)/2`` (``= q·c + gamma·|q|·r``, box
                centre ``c`` and half-width ``r``); ``1`` (default) is Quest's bound (§3.2), bit for bit.
            top_p: ``None`` (default: keep ``page_budget`` pages) or a number in ``(0, 1]``: after the forced pages,
                keep the fewest best-scoring pages whose estimated attention mass (``softmax(scale · score)`` over
                the row's valid pages), with the forced pages', reaches ``top_p``; ``page_budget`` stays the
                capacity (Twilight, Lin et al., arXiv 2502.02770). The mass uses the softmax scale :meth:`run`
                attends with. ``1.0`` keeps the capacity (the same pages as ``None``).
            rerank: ``None`` (default) or ``"int4"``: the estimate (``gamma``) picks ``ceil(candidates ·
                page_budget)`` candidate pages, and :meth:`run` ranks them again by their attention mass estimated
                from 4-bit keys (:func:`tinyattn.rerank_scores`; :meth:`run` then needs ``k_code``); ``top_p`` then
                prunes by that mass (softmax scale 1 over its log). Twilight's second stage (arXiv 2502.02770).
            candidates: a number ``>= 1``, the candidates as a multiple of ``page_budget`` (``1``: the capacity).

        Raises:
            TypeError / ValueError naming the argument, the expected and the actual value; ``top_p`` or a
            ``gamma`` other than 1 without ``page_budget`` (no selection by boxes for them to shape); ``rerank`` not
            ``None`` / ``"int4"``, ``candidates`` not a finite number ``>= 1``, ``rerank`` without ``page_budget``.
        """
        self.step = None              # until this step's checks pass: a plan that failed must not run the last step
        for name, value, low in (("num_q_heads", num_q_heads, 1), ("num_kv_heads", num_kv_heads, 1),
                                 ("head_dim", head_dim, 1), ("page_size", page_size, 1),
                                 ("num_query_tokens", num_query_tokens, 0)):
            V.expect_int(name, value, low)
        for name, value in (("num_pages", num_pages), ("max_batch", max_batch),
                            ("max_pages_per_seq", max_pages_per_seq)):
            if value is not None:
                V.expect_int(name, value, 0)
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads: expected a multiple of num_kv_heads={num_kv_heads}, got {num_q_heads}")
        V.check_tables(block_table, seq_lens, None, block_table.device if isinstance(block_table, torch.Tensor)
                       else None)
        batch, width = block_table.shape
        if max_batch is not None and batch > max_batch:
            raise ValueError(f"block_table: expected at most max_batch={max_batch} rows, got {batch}")
        if max_pages_per_seq is not None and width > max_pages_per_seq:
            raise ValueError(f"block_table: expected at most max_pages_per_seq={max_pages_per_seq} columns, "
                             f"got {width}")
        if page_budget is not None:
            page_budget, num_sink_pages, num_recent_pages = V.check_selection_options(
                page_budget, num_sink_pages, num_recent_pages)
        gamma, top_p = float(V.check_gamma(gamma)), V.check_top_p(top_p)
        rerank, candidates = V.check_rerank(rerank, candidates)
        if rerank is not None and head_dim % 2:
            raise ValueError(f"rerank: expected an even head_dim (two 4-bit codes per byte), got head_dim={head_dim}")
        if page_budget is None:
            V.check_no_box_rules(gamma, top_p, "without page_budget", "pass page_budget, the capacity", rerank)
        backend = resolve_backend(self._backend_arg, block_table.device)
        if backend == "triton":
            V.check_kernel_page_size(page_size)
        scale = V.check_scale(scale, head_dim)
        if top_p is not None:
            V.check_top_p_scale(scale)
        # the rows' lengths on the host: free on a CPU; on a GPU one sync, skipped for trusted tables (and in graph
        # mode, whose plan() must not read values on the host on any device: then every layer with boxes selects)
        graph = max_pages_per_seq is not None
        lens = None if trusted and (block_table.device.type != "cpu" or graph) else tuple(seq_lens.tolist())
        self._max_page_id = None
        if not trusted:
            self._check_values(block_table, seq_lens, page_size, num_pages, num_query_tokens, page_budget)
        elif page_budget is not None and num_query_tokens > 1 and lens is not None:
            V.check_query_pages_fit_host(list(lens), num_query_tokens, page_size, page_budget)
        # with top_p < 1 a row that fits the budget is pruned too: every step with pages selects
        prunes = top_p is not None and top_p < 1.0
        selects = page_budget is not None and (
            lens is None or max((cdiv_pages(n, page_size) for n in lens), default=0) > (0 if prunes else page_budget))
        nothing = batch == 0 or num_query_tokens == 0 or width == 0 or (lens is not None and not any(lens))
        step = Step(backend, block_table.device, batch, width, num_q_heads, num_kv_heads, head_dim, page_size,
                    num_query_tokens, page_budget, num_sink_pages, num_recent_pages, scale, gamma, top_p, rerank,
                    candidates, lens,
                    selects, nothing)
        impl = self._impls.get(backend)
        if impl is None:
            impl = self._impls[backend] = _implementation(backend)()
        impl.plan(step, block_table, seq_lens, max_batch=max_batch, max_pages_per_seq=max_pages_per_seq)
        self._impl, self.step = impl, step
        return self

    def _check_values(self, block_table, seq_lens, page_size, num_pages, num_query_tokens, page_budget) -> None:
        """Data-dependent checks (one host sync): the ops' own, so that the errors read the same."""
        with V.value_checks(True):
            self._max_page_id = V.check_table_values(block_table, seq_lens, page_size, num_pages)
            if page_budget is not None:
                V.check_query_pages_fit(seq_lens, num_query_tokens, page_size, page_budget)

    # -------------------------------------------------------------------------------------------- run
    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, k_min=None, k_max=None,
            page_indices=None, return_lse: bool = False, out: torch.Tensor | None = None,
            scale: float | None = None, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
            window_left: int = -1, k_code: torch.Tensor | None = None):
        """Attention of one layer under this plan.

        Args:
            q: ``[B, Hq, D]`` (decode) or ``[B, Tq, Hq, D]``, the dtype of the pool.
            k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` this layer's pool.
            k_min, k_max: ``[num_pages, Hkv, D]`` page boxes: select ``page_budget`` pages by the Quest bound
                (the box estimate of the plan's ``gamma``; pruned by its ``top_p``, whose mass uses this run's
                ``scale``) when the plan has a budget and some row exceeds it (any row, with ``top_p < 1``), then
                attend to them.
            page_indices: ``[B, Hkv, K]`` logical pages chosen elsewhere (e.g. a selection policy), ``-1``
                padded; duplicates count once; exclusive with ``k_min``/``k_max``. Neither: dense attention.
            return_lse: also return fp32 lse ``[B, Hq]`` / ``[B, Tq, Hq]`` (natural log, ``-inf`` where a
                query sees no key).
            out: optional output tensor like ``q`` (Triton backend: then ``run`` allocates nothing).
            scale: this layer's softmax scale when it differs from the plan's (e.g. GPT-2's per-layer
                scaling); ``None``: the plan's. Passed down; the plan is not changed.
            k_scale, v_scale: fp32 ``[num_pages, Hkv]`` scales of int8 / float8_e4m3fn pools
                (:class:`tinyattn.PagedKVCache` ``k_scale[layer]`` / ``v_scale[layer]``); the torch backend
                dequantizes the rows it gathers (``row.float() * scale``). ``k_min``/``k_max`` are then fp32.
            window_left: this layer's sliding window, FlashInfer's convention: a query at position ``p`` sees the
                keys at positions ``[p - window_left, p]``; ``-1`` (default) = no window. Dense runs read only
                the pages that overlap a window; a selection by boxes ranks the pages wholly before the earliest
                query's window last (``-inf``) and needs ``num_sink_pages = 0``; listed ``page_indices`` are
                attended within the window.
            k_code: ``[num_pages, page_size, Hkv, D/2]`` uint8 4-bit key codes (:class:`tinyattn.PagedKVCache`
                with ``key_codes=True``: ``k_code[layer]``): required when the plan has ``rerank`` and selects, else
                ``None``.

        Nothing is validated here (see :meth:`plan`) beyond the shapes (``page_indices`` ``[B, Hkv, K]`` included),
        the dtypes (``TypeError`` for an integer ``q``, a float ``k_cache`` of another dtype than ``q``, a ``v_cache``
        of another dtype than ``k_cache``, integer boxes, a ``k_max`` of another dtype than ``k_min``, an ``out`` of
        another dtype than ``q``, ``page_indices`` neither int32 nor int64), ``scale`` (a finite real) and the KV
        format (a quantized pool needs its scales, ``[num_pages, Hkv]``, and the torch backend: else ``ValueError``);
        no host sync. Differentiable in ``q``, ``k_cache``, ``v_cache`` (float pools).
        """
        step = self.step
        if step is None:
            raise RuntimeError("PagedAttentionPlan.run: call plan(block_table, seq_lens, ...) first (once per step)")
        self._check_run(step, q, k_cache, v_cache, k_min, k_max, page_indices, out)
        if type(window_left) is not int or window_left != -1:
            window_left = V.check_window_left(window_left)
            if window_left >= 0 and k_min is not None and step.page_budget is not None:
                V.check_window_selection(window_left, step.num_sink_pages)
        scale = step.scale if scale is None else V.check_scale(scale, step.head_dim)
        if step.top_p is not None and scale <= 0:
            V.check_top_p_scale(scale)
        if k_code is not None or (step.rerank is not None and k_min is not None):
            V.check_key_codes(k_code, step.rerank, k_cache, q)
        if step.rerank is not None and k_min is not None and torch.compiler.is_compiling():
            raise NotImplementedError("rerank: the re-ranked selection runs eagerly only (not while torch.compile "
                                      "traces); compile the model with rerank=None")
        scales = None
        if k_scale is not None or v_scale is not None or k_cache.dtype in V.QUANTIZED_DTYPES:
            self._check_kv_format(q, k_cache, v_cache, k_scale, v_scale)
            scales = (k_scale, v_scale)
        return self._impl.run(q, k_cache, v_cache, k_min, k_max, page_indices, return_lse, out, scale, scales,
                              window_left, k_code)

    def _check_kv_format(self, q, k_cache, v_cache, k_scale, v_scale) -> None:
        """A quantized pool: same format for K and V, scales ``[num_pages, Hkv]`` fp32, a backend that reads it."""
        if v_cache.dtype != k_cache.dtype or v_cache.shape != k_cache.shape:
            raise ValueError(f"v_cache: expected dtype {k_cache.dtype} and shape {tuple(k_cache.shape)} (those of "
                             f"k_cache), got {v_cache.dtype} and {tuple(v_cache.shape)}")
        V.check_kv_format(q, k_cache, v_cache, k_scale, v_scale)
        V.check_kv_backend(k_cache, self.step.backend)

    def _check_run(self, step: Step, q, k_cache, v_cache, k_min, k_max, page_indices, out) -> None:
        """The shape checks of :meth:`run` (host ints only, no sync): a pool or box of another shape would be read
        out of bounds by a kernel."""
        if k_cache.dim() != 4 or k_cache.shape[1] != step.page_size or k_cache.shape[2] != step.num_kv_heads \
                or k_cache.shape[3] != step.head_dim:
            raise ValueError(f"k_cache: expected [num_pages, page_size={step.page_size}, Hkv={step.num_kv_heads}, "
                             f"D={step.head_dim}] (the plan's), got {tuple(k_cache.shape)}")
        if q.shape[0] != step.batch or q.shape[-2] != step.num_q_heads or q.shape[-1] != step.head_dim or (
                q.dim() == 4 and q.shape[1] != step.num_query_tokens) or (q.dim() == 3 and step.num_query_tokens != 1) \
                or q.dim() not in (3, 4):
            raise ValueError(f"q: expected shape [B={step.batch}, Hq={step.num_q_heads}, D={step.head_dim}] or "
                             f"[B, Tq={step.num_query_tokens}, Hq, D] (the plan's), got {tuple(q.shape)}")
        if not q.is_floating_point():
            raise TypeError(f"q: expected a floating dtype (fp32 / bf16 / fp16 / fp64), got {q.dtype}")
        if v_cache.shape != k_cache.shape:
            raise ValueError(f"v_cache: expected shape {tuple(k_cache.shape)} (that of k_cache), got "
                             f"{tuple(v_cache.shape)}")
        if v_cache.dtype != k_cache.dtype:
            raise TypeError(f"v_cache: expected dtype {k_cache.dtype} (that of k_cache), got {v_cache.dtype}")
        if k_cache.dtype != q.dtype and k_cache.dtype not in V.QUANTIZED_DTYPES:    # the public ops' rule
            raise TypeError(f"k_cache: expected dtype {V._dtype_name(q.dtype)} (that of q), or int8 / "
                            f"float8_e4m3fn with k_scale / v_scale, got {V._dtype_name(k_cache.dtype)}")
        if self._max_page_id is not None and self._max_page_id >= k_cache.shape[0]:
            raise ValueError(f"block_table: expected physical page ids in [0, {k_cache.shape[0]}) (the pages of "
                             f"k_cache), got {self._max_page_id}")
        if (k_min is None) != (k_max is None):
            raise ValueError(f"k_min, k_max: expected both or neither, got "
                             f"k_min={'None' if k_min is None else 'a tensor'}"
                             f" and k_max={'None' if k_max is None else 'a tensor'}")
        if k_min is not None:
            if not k_min.is_floating_point():
                raise TypeError(f"k_min: expected a floating dtype (the pool's or float32), got "
                                f"{V._dtype_name(k_min.dtype)}")
            if k_max.dtype != k_min.dtype:
                raise TypeError(f"k_max: expected dtype {k_min.dtype} (that of k_min), got {k_max.dtype}")
            if page_indices is not None:
                raise ValueError("page_indices: expected either page_indices or k_min/k_max (exclusive), got both")
            box = (k_cache.shape[0], step.num_kv_heads, step.head_dim)
            for name, x in (("k_min", k_min), ("k_max", k_max)):
                if tuple(x.shape) != box:
                    raise ValueError(f"{name}: expected shape {box} [num_pages, Hkv, D], got {tuple(x.shape)}")
        if out is not None and out.shape != q.shape:
            raise ValueError(f"out: expected shape {tuple(q.shape)} (that of q), got {tuple(out.shape)}")
        if out is not None and out.dtype != q.dtype:
            raise TypeError(f"out: expected dtype {V._dtype_name(q.dtype)} (that of q), got {V._dtype_name(out.dtype)}")
        if page_indices is not None:       # the public ops' checks that need no host sync (a kernel reads the shape)
            if page_indices.dtype not in V.INDEX_DTYPES:
                raise TypeError(f"page_indices: expected dtype int32 or int64, got {V._dtype_name(page_indices.dtype)}")
            if page_indices.dim() != 3 or tuple(page_indices.shape[:2]) != (step.batch, step.num_kv_heads):
                raise ValueError(f"page_indices: expected shape [B={step.batch}, Hkv={step.num_kv_heads}, K] (the "
                                 f"plan's), got {tuple(page_indices.shape)}")
