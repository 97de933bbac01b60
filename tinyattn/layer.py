"""The one attention layer: what every model path calls for paged, query-aware sparse attention.

:class:`PagedAttention` holds the sparsity settings (:class:`SparsityConfig`) and a per-step
:class:`tinyattn.PagedAttentionPlan`. A forward step calls :meth:`PagedAttention.begin` once with the
step's tables, then the layer object once per model layer; the decision of *how* a layer attends lives
here and nowhere else:

======================================  ==============================================================
step / layer                            attention
======================================  ==============================================================
prefill (``decode=False``)              dense over every valid page (causal, bottom-right); a stateful
                                        policy (H2O) observes the attention mass in its sparse layers
decode, layer ``< dense_layers``        dense
decode, no ``page_budget``              dense
decode, sparse layer, Quest             fused: score the page boxes (``gamma``), top-k (capacity
                                        ``page_budget``, pruned by ``top_p``), attend (one plan run)
decode, sparse layer, other policy      ``policy.select`` -> pages -> attend; ``policy.observe``
sliding layer (``window_left >= 0``)    dense over its window, prefill and decode alike: no selection,
                                        whatever the budget or policy (it already reads at most
                                        ``window_left + 1`` keys per query, plus the partial first page)
explicit ``page_indices``               those pages (training's retained pages), within the window if any
======================================  ==============================================================

Sliding windows follow FlashInfer's ``window_left`` convention (a query at position ``p`` sees the keys at
``[p - window_left, p]``; ``-1`` = full attention): the caller passes each layer's window to
:meth:`PagedAttention.__call__` (:meth:`tinyattn.LlamaConfig.window_left` gives it for hybrid models), and the
layers of one step share one plan whatever their windows.

Sink and recent pages are forced by the plan's selection rules (:func:`tinyattn.select_pages`).
Users: the LLaMA runtime (:mod:`tinyattn.models.llama`), the Hugging Face adapter
(:mod:`tinyattn.integrations.hf`), chunked fine-tuning (:mod:`tinyattn.training.chunked`), and the coming
engine and vLLM backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .ops import quant
from .ops.plan import PagedAttentionPlan
from .ops.validation import check_gamma, check_rerank, check_selection_options, check_top_p, check_window_left

__all__ = ["SparsityConfig", "PagedAttention", "quest_settings", "format_settings", "DEFAULT_NUM_SINK_PAGES", "DEFAULT_SINK_MIN_BUDGET",
           "default_num_sink_pages", "DEFAULT_GAMMA"]

#: sink pages a sparse config keeps when the caller leaves ``num_sink_pages`` unset and the budget is at least
#: :data:`DEFAULT_SINK_MIN_BUDGET` pages (:func:`default_num_sink_pages`). Both were measured on SmolLM2-135M
#: (docs/accuracy.md, "Defaults"): one sink page took quest's NLL on real text at 1/8 of an 8K context (32-64
#: pages) from +7.6% to +4.6% of dense and changed no passkey answer at budgets of 16 pages or more, but at 4-8
#: pages it cost passkey answers (the page is taken from the selection). StreamingLLM (Xiao et al. 2024) shows
#: why pretrained models need the first tokens.
DEFAULT_NUM_SINK_PAGES = 1
DEFAULT_SINK_MIN_BUDGET = 16

#: ``gamma`` (the quest selection's page estimate ``q·c + gamma·|q|·r``) of the recipe: every entry point that builds
#: a :class:`SparsityConfig` for its user (this class, :class:`tinyattn.LlamaRuntime`, :class:`tinyattn.Engine`, the
#: Hugging Face cache, the lm-eval model, the CLI's ``--gamma``, vLLM's ``TINYATTN_GAMMA``, the evaluations) takes its
#: default from here, so the recipe changes in one place. It lives beside the other defaults of the recipe. The ops
#: (:func:`tinyattn.page_scores`, :func:`tinyattn.sparse_paged_attention`, :class:`tinyattn.PagedAttentionPlan`,
#: the custom ops and kernels) keep ``gamma = 1.0``: Quest's upper bound (Quest §3.2), the primitive as published.
#: 0.25: the box estimate, which beat or tied the bound on every SmolLM2-135M measurement of issue 35 at page size 16
#: (docs/accuracy.md, issue 35's section): RULER niah_single_1 98-100% vs 44-60% at 1/8 of 2K / 4K, the held-out
#: niah_single_2 / 3, passkey at 8K (87 vs 80% at 1/32), long-text NLL (+3.2 vs +4.6% at 1/8); level with it at page
#: size 8. ``gamma=1.0`` at any entry point is Quest.
DEFAULT_GAMMA = 0.25


def default_num_sink_pages(page_budget: int | None, num_recent_pages: int) -> int:
    """``num_sink_pages`` when the caller leaves it unset (``None``): :data:`DEFAULT_NUM_SINK_PAGES` when the
    config is dense or ``page_budget >= max(DEFAULT_SINK_MIN_BUDGET, DEFAULT_NUM_SINK_PAGES +
    max(num_recent_pages, 1) + 1)`` (a large budget that still selects a page besides the sink and recent
    pages), else 0: a small ``page_budget`` set alone keeps every page for the selection and stays valid."""
    room = DEFAULT_NUM_SINK_PAGES + max(num_recent_pages, 1) + 1
    if page_budget is None or page_budget >= max(DEFAULT_SINK_MIN_BUDGET, room):
        return DEFAULT_NUM_SINK_PAGES
    return 0


def quest_settings(policy, gamma: float = DEFAULT_GAMMA, top_p: float | None = None, rerank: str | None = None,
                   candidates: float = 1.0) -> dict:
    """``{"gamma": gamma, "top_p": top_p}`` (and ``"rerank"``, ``"candidates"`` when ``rerank`` is set) when
    ``policy`` (a name or instance) runs the fused quest selection, ``{}`` for any other policy: how a command that
    compares policies (``tinyattn eval --gamma / --top-p / --rerank``) applies the quest selection's settings to
    quest's passes and leaves the others as they are."""
    from .selection import get_policy

    if not get_policy(policy).fused:
        return {}
    settings = {"gamma": gamma, "top_p": top_p}
    if rerank is not None:
        settings.update(rerank=rerank, candidates=candidates)
    return settings


def format_settings(settings: dict) -> str:
    """``", gamma=0.25, top_p=0.8, rerank=int4"``: the set values of :func:`quest_settings` for a report line."""
    return "".join(f", {k}={v:g}" if isinstance(v, float) else f", {k}={v}" for k, v in settings.items()
                   if v is not None)


@dataclass(frozen=True)
class SparsityConfig:
    """How decode steps attend.

    Args:
        page_budget: pages kept per (sequence, KV head) at each decode step; ``None`` = dense.
            Token budget = ``page_budget * page_size``.
        num_sink_pages: leading pages always kept (attention sinks, StreamingLLM); ``None`` (default) =
            :func:`default_num_sink_pages`: one sink page when ``page_budget >= 16``, else none.
        num_recent_pages: trailing pages always kept (the page being written is always kept).
        dense_layers: number of leading layers that stay dense (Quest keeps 2).
        policy: how pages are chosen: a name of :data:`tinyattn.selection.POLICIES` (``"quest"``, the
            default, ``"meanstd"``, ``"oracle"``, ``"streaming"``, ``"h2o"``, ``"random"``) or a
            :class:`tinyattn.selection.SelectionPolicy` instance; stored as an instance.
        gamma: the page estimate of the ``quest`` selection, a number in ``[0, 1]``: ``q·c + gamma·|q|·r`` over each
            page's key box (centre ``c``, half-width ``r``); default :data:`DEFAULT_GAMMA`; ``1`` is Quest's bound,
            ``0.25`` the box estimate issue 35 measured on RULER (:func:`tinyattn.page_scores`).
        top_p: ``None`` (default: ``page_budget`` pages) or a number in ``(0, 1]``: the ``quest`` selection keeps,
            after the forced pages, the fewest best pages whose estimated attention mass (``softmax(scale ·
            score)``) reaches ``top_p``, ``page_budget`` being the capacity (Twilight, arXiv 2502.02770;
            :func:`tinyattn.select_pages`).
        rerank: ``None`` (default) or ``"int4"``: the ``quest`` selection's second stage (issue 35; Twilight, arXiv
            2502.02770): the estimate hands ``ceil(candidates · page_budget)`` candidates to a re-rank by their
            attention mass estimated from 4-bit key codes (:func:`tinyattn.rerank_scores`), and ``top_p`` prunes by
            that mass. The cache must keep the codes (:class:`tinyattn.PagedKVCache` ``key_codes=True``; the
            runtime, the engine, the Hugging Face cache and the vLLM backend do so when this is set).
        candidates: a number ``>= 1``: the re-rank's candidates as a multiple of ``page_budget`` (default ``1``).

    ``gamma``, ``top_p`` and ``rerank`` are settings of the ``quest`` selection (the fused plan's), not policies of their own:
    they combine freely with the budget and each other, and run on every path that runs Quest's fused selection.

    Raises:
        ValueError for a bad option, or ``num_sink_pages + max(num_recent_pages, 1) > page_budget`` (the ops'
        rule and message); ``gamma`` / ``top_p`` outside their ranges, or set (``gamma`` other than
        :data:`DEFAULT_GAMMA`, ``top_p`` not ``None``) with a policy other than ``quest`` (``TypeError`` for a
        non-number).
    """

    page_budget: int | None = None
    num_sink_pages: int | None = None
    num_recent_pages: int = 1
    dense_layers: int = 0
    policy: object = "quest"
    gamma: float = DEFAULT_GAMMA
    top_p: float | None = None
    rerank: str | None = None
    candidates: float = 1.0

    def __post_init__(self):
        from .selection import get_policy

        object.__setattr__(self, "policy", get_policy(self.policy))
        object.__setattr__(self, "gamma", float(check_gamma(self.gamma)))
        object.__setattr__(self, "top_p", check_top_p(self.top_p))
        rerank, candidates = check_rerank(self.rerank, self.candidates)
        object.__setattr__(self, "rerank", rerank)
        object.__setattr__(self, "candidates", candidates)
        # "set" = other than the default: a dataclass cannot tell the default from the same value passed
        given = {k: v for k, v in (("gamma", self.gamma), ("top_p", self.top_p), ("rerank", self.rerank))
                 if v is not None and not (k == "gamma" and v == DEFAULT_GAMMA)}   # name only what was set
        if given and not self.policy.fused:
            raise ValueError(f"policy: gamma, top_p and rerank are settings of the 'quest' selection, got policy="
                             f"{self.policy.name!r} with " + ", ".join(f"{k}={v}" for k, v in given.items()))
        for name in ("num_recent_pages", "dense_layers", "num_sink_pages"):
            v = getattr(self, name)
            if name == "num_sink_pages" and v is None:     # unset: the default recipe, from the checked fields
                budget = self.page_budget if isinstance(self.page_budget, int) else None   # checked below
                v = default_num_sink_pages(budget, self.num_recent_pages)
                object.__setattr__(self, name, v)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
        if self.page_budget is not None:
            check_selection_options(self.page_budget, self.num_sink_pages, self.num_recent_pages)
        elif self.top_p is not None or self.rerank is not None:   # as plan(): a dense config would ignore them
            set_ = ", ".join(f"{k}={v!r}" for k, v in (("top_p", self.top_p), ("rerank", self.rerank)) if v is not None)
            raise ValueError(f"page_budget: expected an int (the capacity) with {set_}, got None (without it every "
                             f"step is dense and they would do nothing)")

    @property
    def is_dense(self) -> bool:
        return self.page_budget is None

    def layer_is_sparse(self, layer: int) -> bool:
        return self.page_budget is not None and layer >= self.dense_layers


class PagedAttention:
    """One attention component for every path: plan once per step, decide and run per layer.

    Args:
        sparsity: :class:`SparsityConfig` (default: dense).
        backend: ``None`` (by device), ``"torch"`` or ``"triton"``.

    Attributes:
        metrics: a :class:`tinyattn.selection.SelectionMetrics` that sparse layers record their hit rate and
            captured mass into (a dense pass per sparse layer), or ``None`` (off).
        attended: a :class:`tinyattn.metrics.PagesAttended` that the sparse layers of decode steps add the pages
            they attended to (with ``top_p`` the count varies per (row, KV head); device ops, no host sync), or
            ``None`` (off). ``generate``'s statistics set it for their run.

    Example (one decode step)::

        attn = PagedAttention(SparsityConfig(page_budget=4))
        attn.begin(cache.block_table(ids), cache.seq_lens(ids), num_q_heads=8, num_kv_heads=4, head_dim=8,
                   page_size=16, decode=True)
        for li in range(num_layers):
            out = attn(li, q, cache.k_cache[li], cache.v_cache[li], cache.k_min[li], cache.k_max[li])
    """

    def __init__(self, sparsity: SparsityConfig | None = None, *, backend: str | None = None, metrics=None):
        self.sparsity = sparsity or SparsityConfig()
        self.backend = backend
        self.metrics = metrics
        self.plan = PagedAttentionPlan(backend=backend)
        self.decode = False
        self.seq_ids = None
        self.attended = None                 # a tinyattn.metrics.PagesAttended: counts the sparse layers' pages
        self._fused = False                  # set by begin(): fused Quest with no metrics (the fast path of __call__)

    def __repr__(self) -> str:
        s = self.sparsity
        return (f"PagedAttention(page_budget={s.page_budget}, num_sink_pages={s.num_sink_pages}, "
                f"num_recent_pages={s.num_recent_pages}, dense_layers={s.dense_layers}, "
                f"policy={s.policy.name!r}, gamma={s.gamma}, top_p={s.top_p}, rerank={s.rerank!r}, "
                f"backend={self.backend!r})")

    def begin(self, block_table: torch.Tensor, seq_lens: torch.Tensor, *, num_q_heads: int, num_kv_heads: int,
              head_dim: int, page_size: int, num_query_tokens: int = 1, decode: bool | None = None,
              scale: float | None = None, seq_ids=None, trusted: bool = False, max_batch: int | None = None,
              max_pages_per_seq: int | None = None) -> "PagedAttention":
        """Plan one forward step (all layers share its tables); returns ``self``.

        Args:
            block_table, seq_lens: the step's tables, lengths including the ``num_query_tokens`` new tokens.
            decode: whether sparse layers select (default: ``num_query_tokens == 1``); a prefill is dense.
            scale: softmax scale (default ``head_dim ** -0.5``). seq_ids: the rows' ids in the cache
                (state key of stateful policies). trusted: the tables come from :class:`tinyattn.PagedKVCache` (or
                were checked once): skip the value checks and their host sync (default: check).
            max_batch, max_pages_per_seq: the plan's capacity (graph mode, see
                :meth:`tinyattn.PagedAttentionPlan.plan`): buffers allocated once, later steps only copy values,
                so the layers' calls can be captured in a CUDA graph (:mod:`tinyattn.models.graphs`).
        """
        s = self.sparsity
        self.decode = num_query_tokens == 1 if decode is None else bool(decode)
        budget = s.page_budget if self.decode else None
        self.plan.plan(block_table, seq_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, page_size=page_size, num_query_tokens=num_query_tokens,
                       page_budget=budget, num_sink_pages=s.num_sink_pages if budget else 0,
                       num_recent_pages=s.num_recent_pages if budget else 1, scale=scale, trusted=trusted,
                       max_batch=max_batch, max_pages_per_seq=max_pages_per_seq,
                       gamma=s.gamma if budget else 1.0, top_p=s.top_p if budget else None,
                       rerank=s.rerank if budget else None, candidates=s.candidates if budget else 1.0)
        self.seq_ids = seq_ids
        self._fused = s.policy.fused and self.metrics is None
        return self

    def __call__(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 k_min: torch.Tensor | None = None, k_max: torch.Tensor | None = None, *,
                 page_indices: torch.Tensor | None = None, scale: float | None = None,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 window_left: int = -1, out: torch.Tensor | None = None,
                 k_code: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output (shape and dtype of ``q``) of model layer ``layer`` under the current step.

        ``q``: ``[B, Hq, D]`` or ``[B, Tq, Hq, D]``; the pool and boxes of this layer;
        ``page_indices``: attend to these logical pages (``[B, Hkv, K]``, -1 padded) instead of deciding.
        ``scale``: this layer's softmax scale if it differs from the step's (GPT-2 scales per layer).
        ``k_scale``, ``v_scale``: fp32 ``[num_pages, Hkv]`` scales of an int8 / fp8 pool (the cache's
        ``k_scale[layer]`` / ``v_scale[layer]``). A float pool of another dtype than ``q`` (``kv_cache_dtype``
        ``"fp16"`` / ``"bf16"`` under an fp32 model) gets ``q`` cast to the pool's dtype and the output cast
        back. Quest's fused path reads quantized pools directly; other policies and the selection metrics see
        the pool dequantized to ``q``'s dtype (a whole-pool pass per layer).
        ``window_left``: this layer's sliding window (FlashInfer's convention: keys at ``[p - window_left, p]``
        for a query at position ``p``; ``-1`` = full attention). A sliding layer attends densely over its window
        and never selects (see the module's table); ``TypeError`` / ``ValueError`` unless an int ``>= -1``.
        ``out``: a tensor like ``q`` to write the result into (returned); on the Triton backend's fused Quest,
        dense and windowed paths nothing else is allocated (a CUDA-graph step, :mod:`tinyattn.models.graphs`).
        ``k_code``: this layer's 4-bit key codes (the cache's ``k_code[layer]``), read by sparse layers when the
        config has ``rerank``; ignored otherwise (a dense step or layer reads no code).
        """
        if self.sparsity.rerank is None:
            k_code = None
        if (self._fused and page_indices is None and k_scale is None and v_scale is None and type(window_left) is int
                and window_left == -1 and (scale is None or scale == self.plan.scale) and k_cache.dtype == q.dtype):
            # the common decode / prefill layer under fused Quest: the decision of the table below, in one test
            if self.decode and self.sparsity.layer_is_sparse(layer):
                out = self.plan.run(q, k_cache, v_cache, k_min=k_min, k_max=k_max, out=out, k_code=k_code)
                if self.attended is not None:
                    self._count_attended(None)
                return out
            return self.plan.run(q, k_cache, v_cache, out=out)
        if out is not None:
            return _into(out, self._attend(layer, q, k_cache, v_cache, k_min, k_max, page_indices, scale, k_scale,
                                           v_scale, window_left, out, k_code))
        return self._attend(layer, q, k_cache, v_cache, k_min, k_max, page_indices, scale, k_scale, v_scale,
                            window_left, None, k_code)

    def _attend(self, layer, q, k_cache, v_cache, k_min, k_max, page_indices, scale, k_scale, v_scale, window_left,
                out, k_code=None):
        """:meth:`__call__` past its fast path (``out`` given to the plan where the layer's own dtype is kept)."""
        if not self.plan._planned:
            raise RuntimeError("PagedAttention: call begin(block_table, seq_lens, ...) once per step before the layers")
        if k_scale is None and k_cache.dtype != q.dtype and k_cache.is_floating_point() \
                and k_cache.dtype not in quant.QUANTIZED_DTYPES:
            return self(layer, q.to(k_cache.dtype), k_cache, v_cache, k_min, k_max, page_indices=page_indices,
                        scale=scale, window_left=window_left, k_code=k_code).to(q.dtype)
        # a layer's own scale (GPT-2 scales per layer) is passed down with every call, never stored in the plan
        scales = dict(k_scale=k_scale, v_scale=v_scale, scale=scale, out=out)
        if page_indices is not None:
            return self.plan.run(q, k_cache, v_cache, page_indices=page_indices, window_left=window_left, **scales)
        if check_window_left(window_left) >= 0:        # a sliding layer: dense over its window, never selects
            return self.plan.run(q, k_cache, v_cache, window_left=window_left, **scales)
        sparse = self.decode and self.sparsity.layer_is_sparse(layer)
        if sparse and self._fused:
            out = self.plan.run(q, k_cache, v_cache, k_min=k_min, k_max=k_max, k_code=k_code, **scales)
            if self.attended is not None:
                self._count_attended(None)
            return out
        scales.pop("out")
        stateful = self.sparsity.policy.stateful and self.sparsity.layer_is_sparse(layer)
        if k_scale is not None and (sparse or stateful):      # policies and metrics read float pools
            k_cache, v_cache = quant.dequantize(k_cache, k_scale, q.dtype), quant.dequantize(v_cache, v_scale, q.dtype)
            scales = dict(scale=scale)
        if sparse:        # every step, even one where all pages fit: a stateful policy observes each one
            return self._policy_attend(layer, q, k_cache, v_cache, k_min, k_max, scale, k_code, k_scale)
        out = self.plan.run(q, k_cache, v_cache, **scales)
        if stateful:
            from . import selection

            selection.observe_prefill(self.sparsity.policy,
                                      self._context(layer, q, k_cache, v_cache, k_min, k_max, scale))
        return out

    def _count_attended(self, page_indices) -> None:
        """Add this sparse layer's pages to :attr:`attended` (device ops, no host sync): ``page_indices`` a
        policy's, else the fused plan's last selection (``None`` when the step did not select: every valid page)."""
        p = self.plan
        if page_indices is None and p.selects:
            page_indices = p.last_selection
        self.attended.add(page_indices, p.seq_lens, p.step.page_size, p.step.num_kv_heads, p.block_table.shape[1])

    def _context(self, layer, q, k_cache, v_cache, k_min, k_max, scale=None):
        from .selection import SelectionContext

        s, p = self.sparsity, self.plan
        return SelectionContext(layer=layer, q=q, k_cache=k_cache, v_cache=v_cache, k_min=k_min, k_max=k_max,
                                block_table=p.block_table, seq_lens=p.seq_lens, page_budget=s.page_budget,
                                num_sink_pages=s.num_sink_pages, num_recent_pages=s.num_recent_pages,
                                seq_ids=self.seq_ids, scale=p.scale if scale is None else float(scale),
                                backend=self.backend)

    def _policy_attend(self, layer, q, k_cache, v_cache, k_min, k_max, scale=None, k_code=None, k_scale=None):
        """A policy other than fused Quest (or metrics on): select, attend to the pages, observe, record."""
        from .selection import page_attention_mass

        policy, s = self.sparsity.policy, self.sparsity
        ctx = self._context(layer, q, k_cache, v_cache, k_min, k_max, scale)
        # quest with metrics: the plan's rule, unless it is QuestPolicy.select's (Quest's bound, gamma = 1, no top_p)
        if policy.fused and (s.gamma != 1.0 or s.top_p is not None or s.rerank is not None):
            from .ops import api
            from .ops.layout import num_candidates

            scores = api.page_scores(q, k_min, k_max, ctx.block_table, ctx.seq_lens, page_size=ctx.page_size,
                                     gamma=s.gamma, backend=self.backend)
            rules = dict(num_sink_pages=s.num_sink_pages, num_recent_pages=s.num_recent_pages,
                         num_query_tokens=ctx.num_query_tokens, backend=self.backend)
            mass_scale = ctx.scale
            if s.rerank is not None:    # the plan's second stage, op by op: candidates, their log-mass
                width = ctx.block_table.shape[1]
                cand = api.select_pages(scores, ctx.seq_lens, page_size=ctx.page_size,
                                        page_budget=num_candidates(s.page_budget, s.candidates, width), **rules)
                # the pool as the plan read it (a dequantized pool here: its codes are those of the same keys)
                scores = api.rerank_scores(q, k_code, k_cache, k_min, k_max, cand, ctx.block_table, ctx.seq_lens,
                                           scale=ctx.scale, backend=self.backend)
                mass_scale = 1.0
            idx = api.select_pages(scores, ctx.seq_lens, page_size=ctx.page_size, page_budget=s.page_budget,
                                   top_p=s.top_p, scale=mass_scale, **rules)
        else:
            idx = policy.select(ctx)
        out = self.plan.run(q, k_cache, v_cache, page_indices=idx, scale=ctx.scale)
        if self.attended is not None:
            self._count_attended(idx)
        if policy.stateful:
            policy.observe(ctx, idx, page_attention_mass(q, k_cache, ctx.block_table, ctx.seq_lens,
                                                         page_indices=idx, scale=ctx.scale))
        if self.metrics is not None:
            self.metrics.record(ctx, idx)
        return out


def _into(out: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """``result`` written into ``out`` (no copy when the plan already wrote there); returns ``out``."""
    if result is not out:
        out.copy_(result)
    return out
