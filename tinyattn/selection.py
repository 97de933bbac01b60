"""Page-selection policies for sparse decode: Quest and the baselines it is compared with.

A :class:`SelectionPolicy` picks, at each decode step and for each sparse layer, the logical pages every
(row, KV head) attends to. The model runtime (:class:`tinyattn.models.LlamaRuntime`, option ``policy=``)
builds a :class:`SelectionContext` per layer, calls :meth:`SelectionPolicy.select`, and passes the result to
:func:`tinyattn.sparse_paged_attention` as ``page_indices``. Stateful policies (H2O) also get
:meth:`SelectionPolicy.observe` with the attention mass each attended page received.

Policies (names for :func:`get_policy`, ``LlamaRuntime(policy=...)`` and ``--policy`` / ``--policies``):

=============  ===================================================================================================
``quest``      query-aware bounding box (Quest §3.2, TinyServe eq. 2): ``page_scores`` + ``select_pages``; the
               default, and exactly the fused ``sparse_paged_attention(k_min=, k_max=, page_budget=)`` path
``questmass``  an extension of quest (same ``k_min``/``k_max`` boxes): each query head's page estimates
               ``q·c + gamma·|q|·r`` (box centre ``c``, half-width ``r``; ``gamma = 1`` is Quest's bound) turned
               into that head's softmax over the pages and summed over the GQA group: an estimate of the
               attention mass the oracle ranks by (:func:`box_page_log_mass`); ``gamma = 0.75`` by default
``meanstd``    the bounding box rebuilt from a per-page mean ``mu`` and spread ``sigma`` of the keys instead of
               min/max: ``score = max over the group of  q·mu + alpha · |q|·sigma``  (a box of centre ``mu``
               and half-width ``alpha·sigma``; ``alpha = 1`` by default), less sensitive to one outlier key
``oracle``     the pages holding the most true attention mass (dense softmax of the layer, summed over the
               group's query heads): an upper bound of what any selection can do; costs a dense pass
``streaming``  StreamingLLM: the first page (attention sink) and the most recent pages
``h2o``        H2O heavy hitters: pages with the largest attention accumulated over the steps they were
               attended (a running score), kept with the recent pages; a page dropped once is evicted for good
``random``     the forced pages, then pages drawn uniformly at random (seeded)
=============  ===================================================================================================

Every policy keeps the same forced pages as :func:`tinyattn.select_pages` (the last
``max(num_recent_pages, 1)`` pages, then the first ``num_sink_pages``), returns ``[B, Hkv, page_budget]``
int32 logical pages, ascending, ``-1`` padded, without duplicates, never past a row's end, and every
valid page when the row has at most ``page_budget`` pages.

:class:`SelectionMetrics` measures a selection against the oracle: **hit rate** (the share of the oracle's
pages the policy also picked) and **captured mass** (the share of the true attention mass that falls on
the selected pages), averaged over the (row, KV head) pairs of every sparse layer and step where the row
held more pages than the budget (before that every policy reads every page and both are 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import metrics as _metrics
from .metrics import selection_overlap
from .ops import api as _api
from .ops.attention import torch_impl as core
from .ops import validation as _validation
from .ops.layout import math_dtype, num_valid_pages

__all__ = [
    "SelectionContext",
    "SelectionPolicy",
    "QuestPolicy",
    "QuestMassPolicy",
    "MeanStdPolicy",
    "OraclePolicy",
    "StreamingPolicy",
    "H2OPolicy",
    "RandomPolicy",
    "SelectionMetrics",
    "POLICIES",
    "get_policy",
    "page_attention_mass",
    "page_mean_std",
    "box_logit_estimates",
    "box_page_log_mass",
    "attend",
    "observe_prefill",
]

NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------- helpers
def _as_q4(q: torch.Tensor) -> torch.Tensor:
    return q.unsqueeze(1) if q.dim() == 3 else q


def page_attention_mass(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        *, page_indices: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Attention probability mass each page receives, summed over the GQA group and the ``Tq`` queries.

    The softmax runs over the keys of ``page_indices`` (the attention a sparse step really computed) or,
    when ``page_indices`` is ``None``, over every valid key of the row (the true attention). Causal with
    bottom-right alignment for ``Tq > 1``, as the ops.

    Args:
        q: ``[B, Hq, D]`` or ``[B, Tq, Hq, D]``. k_cache: ``[num_pages, page_size, Hkv, D]``.
        block_table, seq_lens: as :func:`tinyattn.paged_attention`.
        page_indices: ``[B, Hkv, K]`` logical pages (``-1`` / past-the-end entries get mass 0), or ``None``.
        scale: softmax scale (default ``D ** -0.5``).

    Returns:
        fp32 (fp64 for fp64 inputs) ``[B, Hkv, K]`` aligned with ``page_indices``, or ``[B, Hkv, max_pages]``
        over the logical pages when ``page_indices`` is ``None``. Each (row, KV head) sums to the number of
        queries ``Tq * G`` that see at least one key.
    """
    q4 = _as_q4(q)
    B, Tq, Hq, D = q4.shape
    page_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    dt = math_dtype(q4)
    device = q4.device
    lens = seq_lens.to(device=device, dtype=torch.int64)
    if page_indices is None:
        max_pages = block_table.shape[1]
        sel = torch.arange(max_pages, device=device).expand(B, Hkv, max_pages)
    else:
        sel = page_indices.to(device=device, dtype=torch.int64)
    K = sel.shape[2]
    # the one torch core: pool rows (hidden slots hold a valid key of the row) and the causal mask
    rows, _, visible = core.page_rows(block_table.to(device), lens, sel, page_size=page_size, num_kv_heads=Hkv,
                                      num_query_tokens=Tq)                        # [B, Hkv, K, S], [.., Tq, K, S]
    keys = k_cache.reshape(-1, D)[rows].to(dt)                                       # [B, Hkv, K, S, D]
    qg = q4.to(dt).view(B, Tq, Hkv, G, D).permute(0, 2, 1, 3, 4)                      # [B, Hkv, Tq, G, D]
    logits = torch.einsum("bhtgd,bhksd->bhtgks", qg, keys) * scale
    # [B, Hkv, Tq, G, K * page_size]
    logits = logits.masked_fill(~visible[:, :, :, None], NEG_INF).flatten(-2)
    p, _, denom = core.softmax_parts(logits)
    p = p / denom.clamp(min=torch.finfo(dt).tiny)
    return p.view(B, Hkv, Tq, G, K, page_size).sum((-1, 2, 3))                       # [B, Hkv, K]


def page_mean_std(k_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-page mean and standard deviation (population, over the valid tokens) of the keys.

    Returns two ``[B, max_pages, Hkv, D]`` tensors (fp32, fp64 for fp64 caches) over the logical pages of
    each row; pages past the row's end hold zeros. A serving system would keep these as running sums
    next to ``k_min``/``k_max``; here they are recomputed from the cache (an evaluation-only cost).
    """
    B, max_pages = block_table.shape
    page_size = k_cache.shape[1]
    dt = math_dtype(k_cache)
    device = k_cache.device
    lens = seq_lens.to(device=device, dtype=torch.int64)
    j = torch.arange(max_pages, device=device)
    page_ok = j[None, :] < num_valid_pages(lens, page_size)[:, None]                 # [B, max_pages]
    phys = torch.where(page_ok, block_table.to(device=device, dtype=torch.int64), 0).clamp(min=0)
    keys = k_cache[phys].to(dt)                                                     # [B, max_pages, page_size, Hkv, D]
    count = (lens[:, None] - j[None, :] * page_size).clamp(min=0, max=page_size)     # [B, max_pages]
    slot_ok = (torch.arange(page_size, device=device)[None, None, :] < count[..., None])[..., None, None]
    keys = torch.where(slot_ok, keys, 0.0)
    denom = count.clamp(min=1).to(dt)[:, :, None, None]
    mean = keys.sum(2) / denom
    var = (torch.where(slot_ok, keys - mean[:, :, None], 0.0) ** 2).sum(2) / denom
    return mean, var.sqrt()


def _check_gamma(gamma) -> float:
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 <= gamma <= 1:
        raise ValueError(f"gamma: expected a number in [0, 1], got {gamma!r}")
    return float(gamma)


def box_logit_estimates(q: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, *, page_size: int, gamma: float = 1.0,
                        backend: str | None = None) -> torch.Tensor:
    """Per query head, an estimate of ``q·k`` on each page from its key bounding box (unscaled)::

        est(q, j) = q·c_j + gamma · Σ_i |q_i|·r_ji        c = (k_min + k_max) / 2,  r = (k_max - k_min) / 2

    ``gamma = 1`` is Quest's bound ``Σ_i max(q_i·k_min_i, q_i·k_max_i)`` (Quest §3.2, TinyServe eq. 2) of one
    query head, an **upper bound** of ``q·k`` for every key of the page; ``gamma = 0`` the logit of the box
    centre; in between a heuristic (not a bound) that lies between the smallest and largest ``q·k`` the box
    allows, ``est = (1+gamma)/2 · ub(q) - (1-gamma)/2 · ub(-q)``. That identity is how it is computed: one
    :func:`tinyattn.page_scores` call (either backend) over ``2·B·Tq·G`` rows holding one query head per KV head.

    Args:
        q: ``[B, Hq, D]`` or ``[B, Tq, Hq, D]``; query ``t`` sees the first ``seq_len - Tq + 1 + t`` tokens
            (bottom-right causal), and pages past those score ``-inf``. k_min, k_max: ``[num_pages, Hkv, D]``.
        block_table, seq_lens, page_size: as :func:`tinyattn.page_scores`.
        gamma: share of the box half-width added to the centre's logit, a number in ``[0, 1]``.
        backend: ``None``, ``"torch"`` or ``"triton"``.

    Returns:
        fp32 ``[B, Tq, Hq, max_pages]`` (query head ``h·G + g`` reads KV head ``h``).

    Raises:
        ValueError: ``gamma`` outside ``[0, 1]``, or the inputs :func:`tinyattn.page_scores` rejects.
    """
    gamma = _check_gamma(gamma)
    q4, page_size = _validation.check_scoring_inputs(q, k_min, k_max, block_table, seq_lens, page_size)
    B, Tq, Hq, D = q4.shape
    Hkv, max_pages = k_min.shape[1], block_table.shape[1]
    G = Hq // Hkv
    num_rows = B * Tq * G
    # one row per (b, t, g) holding a group of one query head per KV head, so page_scores bounds each head
    # alone; the rows of -q give ub(-q) = -(min of q·k over the box)
    q_rows = q4.reshape(B, Tq, Hkv, G, D).permute(0, 1, 3, 2, 4).reshape(num_rows, 1, Hkv, D)
    lens = seq_lens.to(device=q4.device, dtype=torch.int64)
    ahead = Tq - 1 - torch.arange(Tq, device=q4.device)                                  # later tokens of the step
    row_lens = (lens[:, None] - ahead[None, :]).clamp(min=0)[:, :, None].expand(B, Tq, G).reshape(num_rows)
    tables = block_table.repeat_interleave(Tq * G, dim=0)
    ub = _api.page_scores(torch.cat([q_rows, -q_rows]), k_min, k_max, tables.repeat(2, 1),
                          row_lens.repeat(2).to(torch.int32), page_size=page_size, backend=backend)
    hi, neg_lo = ub[:num_rows], ub[num_rows:]                                  # [num_rows, Hkv, max_pages] each
    # 0 * -inf is NaN: mask the pages past the row's end explicitly (gamma = 1 gives hi exactly)
    est = torch.where(hi > NEG_INF, 0.5 * (1 + gamma) * hi - 0.5 * (1 - gamma) * neg_lo, NEG_INF)
    return est.view(B, Tq, G, Hkv, max_pages).transpose(2, 3).reshape(B, Tq, Hq, max_pages)


def box_page_log_mass(q: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, *, page_size: int, gamma: float = 0.75, scale: float | None = None,
                      backend: str | None = None) -> torch.Tensor:
    """Log of each page's share of the group's attention, estimated from Quest's per-page key boxes.

    A heuristic (the ``questmass`` policy): each query (token ``t``, query head ``g`` of KV head ``h``'s group)
    turns its :func:`box_logit_estimates` into a distribution over the pages it sees, as its attention would::

        p(q, j)  = softmax over the query's pages of  scale · est(q, ·)
        score(j) = log Σ_{t, g} p(q_tg, j)

    Quest's score instead takes the max of the bounds over the group, so a head whose logits are large
    everywhere decides for all; the sum of per-head distributions weighs every head alike, as the oracle's true
    attention mass (:meth:`SelectionContext.true_page_mass`) does. The last page may be partial; its token
    count is left out (the recent-page rule keeps it anyway). The log (a ``logsumexp`` of log-softmaxes) keeps
    the ranking of pages whose estimated mass underflows fp32.

    Args:
        q, k_min, k_max, block_table, seq_lens, page_size, gamma, backend: as :func:`box_logit_estimates`.
        scale: softmax scale (default ``D ** -0.5``).

    Returns:
        fp32 ``[B, Hkv, max_pages]``: ``log`` of the estimated mass (``exp`` of a (row, KV head) sums to the
        ``Tq * G`` queries that see a key), ``-inf`` past a row's end and for rows without tokens.

    Raises:
        ValueError: as :func:`box_logit_estimates`.
    """
    est = box_logit_estimates(q, k_min, k_max, block_table, seq_lens, page_size=page_size, gamma=gamma,
                              backend=backend)                                    # [B, Tq, Hq, max_pages]
    B, Tq, Hq, max_pages = est.shape
    Hkv = k_min.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    log_p = torch.log_softmax(est * scale, dim=-1)                                        # NaN for a query with no key
    log_mass = log_p.view(B, Tq, Hkv, Hq // Hkv, max_pages).logsumexp((1, 3))      # [B, Hkv, max_pages]
    return log_mass.masked_fill(log_mass.isnan(), NEG_INF)


# ---------------------------------------------------------------------------------------------- context
@dataclass
class SelectionContext:
    """What a policy sees at one sparse layer of one step (tensors as the ops take them).

    Attributes:
        layer: the layer index. q: ``[B, Hq, D]`` (decode) or ``[B, Tq, Hq, D]``.
        k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` of this layer. k_min, k_max: ``[num_pages, Hkv, D]``.
        block_table: ``[B, max_pages]``. seq_lens: ``[B]`` including the query tokens.
        page_budget, num_sink_pages, num_recent_pages: the forced-page rules of :func:`tinyattn.select_pages`.
        seq_ids: the rows' sequence ids in the cache (state key of stateful policies); ``None`` = ``0..B-1``.
        scale: softmax scale (``None`` = ``D ** -0.5``). backend: as the ops.
    """

    layer: int
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor | None
    k_min: torch.Tensor | None
    k_max: torch.Tensor | None
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    page_budget: int
    num_sink_pages: int = 0
    num_recent_pages: int = 1
    seq_ids: list[int] | None = None
    scale: float | None = None
    backend: str | None = None
    _mass: torch.Tensor | None = field(default=None, repr=False)

    @property
    def q4(self) -> torch.Tensor:
        return _as_q4(self.q)

    @property
    def page_size(self) -> int:
        return self.k_cache.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_cache.shape[2]

    @property
    def num_query_tokens(self) -> int:
        return self.q4.shape[1]

    @property
    def max_pages(self) -> int:
        return self.block_table.shape[1]

    def valid_pages(self) -> torch.Tensor:
        """``[B]`` int64: pages holding at least one valid token."""
        return num_valid_pages(self.seq_lens, self.page_size)

    def rows(self) -> torch.Tensor:
        """``[B]`` int64 state keys: ``seq_ids`` or ``0..B-1``."""
        ids = self.seq_ids if self.seq_ids is not None else range(self.block_table.shape[0])
        return torch.as_tensor(list(ids), dtype=torch.int64, device=self.q.device)

    def true_page_mass(self) -> torch.Tensor:
        """``[B, Hkv, max_pages]`` share of the dense attention on each page, averaged over the group's
        query heads and the queries (each (row, KV head) sums to 1, or 0 for an empty row). Cached."""
        if self._mass is None:
            q4 = self.q4
            mass = page_attention_mass(q4, self.k_cache, self.block_table, self.seq_lens, scale=self.scale)
            self._mass = (mass / (q4.shape[1] * (q4.shape[2] // self.num_kv_heads))).float()
        return self._mass

    def select_top(self, scores: torch.Tensor, *, num_sink_pages: int | None = None,
                   num_recent_pages: int | None = None) -> torch.Tensor:
        """:func:`tinyattn.select_pages` of ``scores`` ``[B, Hkv, max_pages]`` under this step's rules (or
        the given numbers of sink / recent pages)."""
        return _api.select_pages(scores.float().contiguous(), self.seq_lens, page_size=self.page_size,
                                 page_budget=self.page_budget,
                                 num_sink_pages=self.num_sink_pages if num_sink_pages is None else num_sink_pages,
                                 num_recent_pages=self.num_recent_pages if num_recent_pages is None
                                 else num_recent_pages,
                                 num_query_tokens=self.num_query_tokens, backend=self.backend)


# ---------------------------------------------------------------------------------------------- policies
class SelectionPolicy:
    """Base class of page-selection policies.

    Subclasses implement :meth:`select`. Stateful ones set ``stateful = True`` and implement
    :meth:`observe` (called after the attention of every sparse layer, and after the dense prefill, with the
    mass each attended page received) and :meth:`reset`. State is keyed by ``(layer, seq_id)`` of the cache;
    call :meth:`reset` when starting over with a new cache (``LlamaRuntime.generate`` does).
    """

    name: str = "policy"
    stateful: bool = False
    fused: bool = False  # True only for quest: the runtime may use the op's own k_min/k_max selection

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        """``[B, Hkv, page_budget]`` int32 logical pages, ascending, ``-1`` padded."""
        raise NotImplementedError

    def observe(self, ctx: SelectionContext, page_indices: torch.Tensor, page_mass: torch.Tensor) -> None:
        """``page_mass`` ``[B, Hkv, K]``: attention mass on each of ``page_indices``' pages, summed over the
        group's query heads and the queries (:func:`page_attention_mass`). No-op by default."""

    def reset(self, seq_ids: list[int] | None = None) -> None:
        """Forget the state of ``seq_ids`` (all sequences when ``None``). No-op by default."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class QuestPolicy(SelectionPolicy):
    """Quest / TinyServe: upper bound of ``q·k`` over each page's min/max box, then top-k."""

    name = "quest"
    fused = True

    def select(self, ctx):
        scores = _api.page_scores(ctx.q, ctx.k_min, ctx.k_max, ctx.block_table, ctx.seq_lens,
                                  page_size=ctx.page_size, backend=ctx.backend)
        return ctx.select_top(scores)


class QuestMassPolicy(SelectionPolicy):
    """Quest's page boxes with a GQA-aware mass estimate: top-k of :func:`box_page_log_mass`.

    An extension of Quest (not in the paper; the default ``quest`` stays Quest's). It reads the same ``k_min`` /
    ``k_max`` as ``quest`` and runs on both backends (one :func:`tinyattn.page_scores` call per step over
    ``2·Tq·G`` rows of one query head each, so it reads the boxes ``2·Tq·G`` times where ``quest`` reads them
    once; a fused kernel would read them once).
    ``gamma = 1`` differs from ``quest`` only in the GQA aggregation (sum of per-head softmaxes instead of the
    max of the bounds); with one query head per KV head and ``Tq = 1`` it selects exactly ``quest``'s pages.

    Args:
        gamma: share of the box half-width added to the centre's logit, in ``[0, 1]``. 0.75 was picked among
            0, 0.25, 0.5, 0.75 and 1 on the evaluation text of docs/accuracy.md (stories260K, a quarter of the
            context, page sizes 8 and 16; checked on held-out stories): treat its figures there as tuned.
    """

    name = "questmass"

    def __init__(self, gamma: float = 0.75):
        self.gamma = _check_gamma(gamma)

    def __repr__(self) -> str:
        return f"QuestMassPolicy(gamma={self.gamma})"

    def scores(self, ctx: SelectionContext) -> torch.Tensor:
        """fp32 ``[B, Hkv, max_pages]``: :func:`box_page_log_mass` of the step, ``-inf`` past each row's end."""
        if ctx.k_min is None or ctx.k_max is None:
            raise ValueError("questmass: the SelectionContext has no k_min/k_max page boxes")
        return box_page_log_mass(ctx.q, ctx.k_min, ctx.k_max, ctx.block_table, ctx.seq_lens,
                                 page_size=ctx.page_size, gamma=self.gamma, scale=ctx.scale, backend=ctx.backend)

    def select(self, ctx):
        return ctx.select_top(self.scores(ctx))


class MeanStdPolicy(SelectionPolicy):
    """Box of centre ``mu`` and half-width ``alpha * sigma`` per channel (per-page key mean / spread).

    ``score(q, j) = max over the group's queries of  Σ_i q_i·mu_ji + alpha·|q_i|·sigma_ji``: the Quest bound
    with the box ``[mu - alpha·sigma, mu + alpha·sigma]`` in place of ``[k_min, k_max]``. An estimate of the
    page's largest logit (not a bound), that one outlier key cannot blow up.
    """

    name = "meanstd"

    def __init__(self, alpha: float = 1.0):
        if not alpha >= 0:
            raise ValueError(f"alpha must be >= 0, got {alpha!r}")
        self.alpha = float(alpha)

    def __repr__(self) -> str:
        return f"MeanStdPolicy(alpha={self.alpha})"

    def select(self, ctx):
        return ctx.select_top(self.scores(ctx))

    def scores(self, ctx: SelectionContext) -> torch.Tensor:
        """fp32 ``[B, Hkv, max_pages]`` page scores, ``-inf`` past each row's end."""
        mean, std = page_mean_std(ctx.k_cache, ctx.block_table, ctx.seq_lens)      # [B, max_pages, Hkv, D]
        q4 = ctx.q4
        B, Tq, Hq, D = q4.shape
        Hkv = ctx.num_kv_heads
        qg = q4.to(mean.dtype).view(B, Tq, Hkv, Hq // Hkv, D)
        score = (torch.einsum("bthgd,bphd->bhtgp", qg, mean)
                 + self.alpha * torch.einsum("bthgd,bphd->bhtgp", qg.abs(), std)).amax((2, 3))  # [B, Hkv, max_pages]
        j = torch.arange(ctx.max_pages, device=score.device)
        valid = j[None, :] < ctx.valid_pages()[:, None]
        return score.float().masked_fill(~valid[:, None, :], NEG_INF)


class OraclePolicy(SelectionPolicy):
    """The pages holding the most true attention mass (a dense pass per step): the best any selection can do
    for the attention output's mass, under the same forced pages."""

    name = "oracle"

    def select(self, ctx):
        return ctx.select_top(ctx.true_page_mass())


class StreamingPolicy(SelectionPolicy):
    """StreamingLLM (Xiao et al., ICLR 2024): attention-sink pages + a window of the most recent pages.

    Args:
        num_sink_pages: leading pages kept (StreamingLLM keeps 4 sink tokens: one page); the runtime's
            ``num_sink_pages`` wins when larger.
    """

    name = "streaming"

    def __init__(self, num_sink_pages: int = 1):
        if not isinstance(num_sink_pages, int) or num_sink_pages < 0:
            raise ValueError(f"num_sink_pages must be an int >= 0, got {num_sink_pages!r}")
        self.num_sink_pages = num_sink_pages

    def __repr__(self) -> str:
        return f"StreamingPolicy(num_sink_pages={self.num_sink_pages})"

    def select(self, ctx):
        B, Hkv, max_pages = ctx.block_table.shape[0], ctx.num_kv_heads, ctx.max_pages
        recency = torch.arange(max_pages, device=ctx.q.device, dtype=torch.float32).expand(B, Hkv, max_pages)
        sinks = max(ctx.num_sink_pages, self.num_sink_pages)
        if ctx.num_recent_pages + sinks > ctx.page_budget:  # the budget cannot hold a sink: keep the newest
            sinks = max(ctx.page_budget - max(ctx.num_recent_pages, 1), 0)
        return ctx.select_top(recency, num_sink_pages=sinks)


class H2OPolicy(SelectionPolicy):
    """H2O (Zhang et al., NeurIPS 2023) on pages: heavy hitters by accumulated attention, plus recent pages.

    Each (layer, sequence, KV head, page) keeps a running score: the attention mass the page received at
    every step it was attended (prefill included), summed over the group's query heads. A step keeps the
    recent pages, the sinks, and then the pages of highest score among those not yet evicted; a valid page
    left out of a step's selection is evicted for good, as when H2O drops it from its KV cache.

    Args:
        recent_ratio: share of the budget given to the recent window (H2O splits its cache evenly between
            recent tokens and heavy hitters: 0.5); at least the runtime's ``num_recent_pages``. With a
            one-page window an accumulated score always favours old pages (they have been attended for
            more steps), so a page leaving the window would be evicted at once.
    """

    name = "h2o"
    stateful = True

    def __init__(self, recent_ratio: float = 0.5):
        if not 0 <= recent_ratio <= 1:
            raise ValueError(f"recent_ratio must be in [0, 1], got {recent_ratio!r}")
        self.recent_ratio = float(recent_ratio)
        self._score: dict[int, torch.Tensor] = {}    # layer -> [num_seq_slots, Hkv, pages] fp32
        self._evicted: dict[int, torch.Tensor] = {}  # layer -> [num_seq_slots, Hkv, pages] bool

    def __repr__(self) -> str:
        return f"H2OPolicy(recent_ratio={self.recent_ratio})"

    def reset(self, seq_ids=None):
        if seq_ids is None:
            self._score.clear()
            self._evicted.clear()
            return
        for layer in self._score:
            ids = [i for i in seq_ids if i < self._score[layer].shape[0]]
            self._score[layer][ids] = 0.0
            self._evicted[layer][ids] = False

    def _state(self, ctx) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = ctx.rows()
        need_rows = int(rows.max()) + 1 if rows.numel() else 1
        need_pages = ctx.max_pages
        score = self._score.get(ctx.layer)
        if score is None or score.shape[0] < need_rows or score.shape[2] < need_pages or score.device != rows.device:
            n_rows, n_pages = need_rows, need_pages
            if score is not None:
                n_rows, n_pages = max(n_rows, score.shape[0]), max(n_pages, score.shape[2])
            new_s = torch.zeros(n_rows, ctx.num_kv_heads, n_pages, device=rows.device)
            new_e = torch.zeros(n_rows, ctx.num_kv_heads, n_pages, dtype=torch.bool, device=rows.device)
            if score is not None:
                r, _, p = score.shape
                new_s[:r, :, :p] = score.to(rows.device)
                new_e[:r, :, :p] = self._evicted[ctx.layer].to(rows.device)
            self._score[ctx.layer], self._evicted[ctx.layer] = new_s, new_e
        return rows, self._score[ctx.layer], self._evicted[ctx.layer]

    def select(self, ctx):
        rows, score, evicted = self._state(ctx)
        max_pages = ctx.max_pages
        s = score[rows, :, :max_pages]
        s = s.masked_fill(evicted[rows, :, :max_pages], NEG_INF)
        recent = max(ctx.num_recent_pages, int(ctx.page_budget * self.recent_ratio))
        recent = min(recent, max(ctx.page_budget - ctx.num_sink_pages, 1))
        idx = ctx.select_top(s, num_recent_pages=recent)
        # every valid page that did not make it is evicted (rows with <= budget pages keep them all)
        kept = torch.zeros(*idx.shape[:2], max_pages + 1, dtype=torch.bool, device=idx.device)
        kept.scatter_(2, torch.where(idx >= 0, idx.long(), max_pages), True)
        valid = torch.arange(max_pages, device=idx.device)[None, :] < ctx.valid_pages()[:, None]
        evicted[rows, :, :max_pages] |= valid[:, None, :] & ~kept[..., :max_pages]
        return idx

    def observe(self, ctx, page_indices, page_mass):
        rows, score, _ = self._state(ctx)
        max_pages = score.shape[2]
        idx = page_indices.long()
        ok = idx >= 0
        add = torch.zeros(idx.shape[0], idx.shape[1], max_pages + 1, device=score.device)
        add.scatter_add_(2, torch.where(ok, idx, max_pages), torch.where(ok, page_mass.float(), 0.0))
        score[rows] += add[..., :max_pages]


class RandomPolicy(SelectionPolicy):
    """The forced pages, then pages drawn uniformly at random per (row, KV head) (``torch.Generator``, seeded)."""

    name = "random"

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._gen: torch.Generator | None = None

    def __repr__(self) -> str:
        return f"RandomPolicy(seed={self.seed})"

    def reset(self, seq_ids=None):
        if seq_ids is None:
            self._gen = None

    def select(self, ctx):
        device = ctx.q.device
        if self._gen is None or self._gen.device != device:
            self._gen = torch.Generator(device=device)
            self._gen.manual_seed(self.seed)
        B, Hkv, max_pages = ctx.block_table.shape[0], ctx.num_kv_heads, ctx.max_pages
        return ctx.select_top(torch.rand(B, Hkv, max_pages, generator=self._gen, device=device))


POLICIES: dict[str, type[SelectionPolicy]] = {
    "quest": QuestPolicy,
    "questmass": QuestMassPolicy,
    "meanstd": MeanStdPolicy,
    "oracle": OraclePolicy,
    "streaming": StreamingPolicy,
    "h2o": H2OPolicy,
    "random": RandomPolicy,
}


def get_policy(policy: str | SelectionPolicy = "quest") -> SelectionPolicy:
    """A policy instance from a name of :data:`POLICIES` (a fresh instance each call) or an instance."""
    if isinstance(policy, SelectionPolicy):
        return policy
    if isinstance(policy, str) and policy.strip().lower() in POLICIES:
        return POLICIES[policy.strip().lower()]()
    raise ValueError(f"policy: expected one of {', '.join(POLICIES)} or a SelectionPolicy instance, got {policy!r}")


# ---------------------------------------------------------------------------------------------- metrics
@dataclass
class SelectionMetrics:
    """Hit rate and captured mass of a policy's selections against the oracle (see the module docstring).

    Per sparse layer: ``hits`` (pages picked by both), ``oracle_pages`` (pages the oracle picked),
    ``mass`` (summed captured mass) over ``count`` (row, KV head) samples. The oracle keeps the same number
    of pages under the same forced-page rules, ranked by the true attention mass (:class:`OraclePolicy`).
    """

    hits: dict[int, float] = field(default_factory=dict)
    oracle_pages: dict[int, float] = field(default_factory=dict)
    mass: dict[int, float] = field(default_factory=dict)
    count: dict[int, int] = field(default_factory=dict)

    def record(self, ctx: SelectionContext, page_indices: torch.Tensor) -> None:
        """Add the (row, KV head) pairs of this step whose rows hold more pages than the budget."""
        active = ctx.valid_pages() > ctx.page_budget                                      # [B]
        if not bool(active.any()):
            return
        mass = ctx.true_page_mass()                                                      # [B, Hkv, max_pages]
        oracle = ctx.select_top(mass)
        hit, n_oracle, captured = selection_overlap(page_indices, oracle, mass)        # [B, Hkv] each
        a = active[:, None].expand_as(hit)
        layer = ctx.layer
        self.hits[layer] = self.hits.get(layer, 0.0) + float(hit[a].sum())
        self.oracle_pages[layer] = self.oracle_pages.get(layer, 0.0) + float(n_oracle[a].sum())
        self.mass[layer] = self.mass.get(layer, 0.0) + float(captured[a].sum())
        self.count[layer] = self.count.get(layer, 0) + int(a.sum())

    @property
    def samples(self) -> int:
        return sum(self.count.values())

    @property
    def hit_rate(self) -> float:
        """Pages of the oracle's selections that the policy also picked, over all oracle pages (NaN if none)."""
        return _metrics.hit_rate(sum(self.hits.values()), sum(self.oracle_pages.values()))

    @property
    def captured_mass(self) -> float:
        """Mean share of the true attention mass on the selected pages (NaN if no sample)."""
        return _metrics.captured_mass(sum(self.mass.values()), self.samples)

    def format(self) -> str:
        return f"hit rate {self.hit_rate:.1%} vs oracle, captured mass {self.captured_mass:.1%}"


# ---------------------------------------------------------------------------------------------- runtime glue
def attend(policy: SelectionPolicy, ctx: SelectionContext, metrics: SelectionMetrics | None = None) -> torch.Tensor:
    """One sparse layer: select with ``policy``, attend to the pages, feed ``observe`` and ``metrics``."""
    idx = policy.select(ctx)
    out = _api.sparse_paged_attention(ctx.q, ctx.k_cache, ctx.v_cache, ctx.block_table, ctx.seq_lens,
                                      page_indices=idx, num_sink_pages=ctx.num_sink_pages,
                                      num_recent_pages=ctx.num_recent_pages, scale=ctx.scale, backend=ctx.backend)
    if policy.stateful:
        policy.observe(ctx, idx, page_attention_mass(ctx.q, ctx.k_cache, ctx.block_table, ctx.seq_lens,
                                                     page_indices=idx, scale=ctx.scale))
    if metrics is not None:
        metrics.record(ctx, idx)
    return out


def observe_prefill(policy: SelectionPolicy, ctx: SelectionContext) -> None:
    """After a dense (prefill) attention: give a stateful policy the mass of every page."""
    if policy.stateful:
        max_pages = ctx.max_pages
        n = ctx.valid_pages()[:, None, None]
        j = torch.arange(max_pages, device=ctx.q.device)[None, None, :]
        idx = torch.where(j < n, j, -1).expand(-1, ctx.num_kv_heads, -1)
        policy.observe(ctx, idx, page_attention_mass(ctx.q, ctx.k_cache, ctx.block_table, ctx.seq_lens,
                                                     page_indices=idx, scale=ctx.scale))
