"""The torch form of scoring and selection (DESIGN.md §1, §3; docs/layout.md): the Quest bound, the pages a window
hides, the page selection, and the canonical form of a page list.

Each rule lives here once, used both by the stand-alone ops (``page_scores``, ``select_pages``) and by the
per-step plan (:mod:`tinyattn.ops.plan_torch`). The other copies are the loops of :mod:`.reference` (the tests'
oracle) and the Triton kernels (:mod:`.triton_impl`); docs/layout.md lists where each rule lives.

No Python loop over rows, heads or pages. Inputs are already validated and canonical.

- **Bound** (:func:`page_bounds`, Quest §3.2 / TinyServe eq. 2): two matmuls per KV head,
  ``q⁺·k_max + q⁻·k_min`` with ``q⁺ = max(q, 0)`` and ``q⁻ = min(q, 0)``, which equals
  ``Σ_i max(q_i·k_min_i, q_i·k_max_i)`` term by term, maximised over the group's query heads and the row's
  queries; with ``gamma < 1`` the same two matmuls take the box estimate's operands ``(q ± gamma|q|)/2``
  (:func:`box_operands`). When the rows use most of the page pool (always the case for one sequence) the matmuls run over the
  pool's boxes in place (strided views, no copy) and the step's pages are picked afterwards, so the boxes are read
  exactly once; otherwise the rows' boxes are gathered first.
- **Selection** (:func:`selection_keys` once per step, :func:`top_pages` per layer): forced pages (the recent /
  query pages, then the sinks) are keyed above every score, then the bounds in descending order, NaN as ``-inf``,
  ties to the lower page index, invalid pages last. Short rows sort float keys (stable, fewest calls); long rows
  take ``torch.topk`` of unique int64 keys (an order-preserving integer image of the bound, then
  ``max_pages - 1 - j``),
  much cheaper than sorting thousands of pages. Both encode the one order above.
- **Re-rank** (:func:`rerank_scores`, issue 35's second stage): the candidates' 4-bit codes gathered and decoded
  in their page's box, one batched matmul of the group's queries against them, a masked ``logsumexp`` per query
  and a sum per page: the log of each candidate's estimated attention mass, scattered to ``[B, Hkv, max_pages]``.
- **Top-p** (:func:`top_p_keep`, Twilight's adaptive budget): over the capacity's pages in rank order, the masses
  ``softmax(scale · score)`` gathered, an exclusive ``cumsum`` of the scored pages' after the forced pages' mass, and
  a mask: fixed shapes ``[B, Hkv, page_budget]``, no host sync.
"""

from __future__ import annotations

import torch

from ..attention.torch_impl import first_window_key
from ..layout import NEG_INF, group_queries, math_dtype, num_valid_pages

__all__ = ["float_order_key", "canonical_page_indices", "physical_pages", "box_operands", "page_bounds", "page_scores",
           "mask_pages_before_window", "selection_keys", "top_pages", "top_p_keep", "select_pages",
           "decode_key_codes", "rerank_scores"]

# pool-wide matmuls are used while their [Hkv, rows * Tq * G, pool] intermediate stays under this size
_POOL_LOGITS_BYTES = 64 * 2**20
_SORT_MAX_PAGES = 64        # rows of more pages select with topk over packed int64 keys (cheaper than a sort)
_FLT_MAX = torch.finfo(torch.float32).max
_SCORE_CAP = 3.0e38         # a real +inf bound is capped below the sink key FLT_MAX (float form)
_INVALID_KEY = torch.iinfo(torch.int64).min
_FORCED_KEY = 0x7F800001 << 32                       # above the key of any score (+inf included)


def physical_pages(block_table: torch.Tensor, seq_lens: torch.Tensor,
                   page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(phys [B, max_pages] int64, valid [B, max_pages] bool)``: the physical page of each logical page, 0 past the
    row's end (a safe dummy, masked by ``valid``)."""
    B, max_pages = block_table.shape
    cols = torch.arange(max_pages, device=block_table.device)
    valid = cols[None, :] < num_valid_pages(seq_lens.to(block_table.device), page_size)[:, None]
    return torch.where(valid, block_table.to(torch.int64), 0), valid


def box_operands(q: torch.Tensor, gamma: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The two query operands of the box estimate: ``(a, b)`` with ``a = (q + gamma|q|)/2`` (read against
    ``k_max``) and ``b = (q - gamma|q|)/2`` (against ``k_min``), so ``a·k_max + b·k_min = q·c + gamma·|q|·r``.

    ``gamma = 1``: ``(q⁺, q⁻)`` as ``clamp`` computes them (Quest's bound, bit for bit; the formula gives the same
    values in floating point: ``(q + |q|)/2`` is ``q`` or ``0`` exactly while ``2|q|`` does not overflow)."""
    if gamma == 1.0:
        return q.clamp(min=0), q.clamp(max=0)
    g = q.abs().mul_(gamma)
    return (q + g).mul_(0.5), (q - g).mul_(0.5)


def page_bounds(qg: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor, phys: torch.Tensor,
                valid: torch.Tensor | None, gamma: float = 1.0) -> torch.Tensor:
    """Quest bound ``Σ_i max(q_i·k_min_i, q_i·k_max_i)`` of logical pages (``gamma = 1``), or the box estimate
    ``Σ_i a_i·k_max_i + b_i·k_min_i`` (:func:`box_operands`): fp32 ``[B, Hkv, max_pages]``, ``-inf`` where not
    ``valid``.

    Args:
        qg: ``[B, Hkv, M, D]`` grouped queries (:func:`group_queries`, ``M = Tq * G``), fp32 or fp64.
        k_min, k_max: ``[num_pages, Hkv, D]`` boxes (any float dtype; computed in ``qg``'s dtype).
        phys, valid: ``[B, max_pages]`` from :func:`physical_pages`; ``valid=None`` when every page is valid (a plan
            knows).
        gamma: the share of the half-width, in ``[0, 1]`` (``1``: Quest's bound).
    """
    B, Hkv, M, D = qg.shape
    max_pages, N = phys.shape[1], k_min.shape[0]
    dt = qg.dtype
    if B * M * max_pages * N == 0:
        return torch.full((B, Hkv, max_pages), NEG_INF, dtype=torch.float32, device=qg.device)
    if N <= 2 * B * max_pages and Hkv * B * M * N * 4 <= _POOL_LOGITS_BYTES:
        # every row against the whole pool, boxes read once in place: [Hkv, B*M, N]
        qp = qg.transpose(0, 1).reshape(Hkv, B * M, D)                                  # [Hkv, B*M, D]
        lo, hi = k_min.permute(1, 2, 0), k_max.permute(1, 2, 0)                         # [Hkv, D, N] views
        if lo.dtype != dt:
            lo, hi = lo.to(dt), hi.to(dt)
        # two bmm + add_: baddbmm over these strided views ran 1.4x slower (docs/benchmarks.md)
        pos, neg = box_operands(qp, gamma)
        ub = torch.bmm(neg, lo).add_(torch.bmm(pos, hi))                                # [Hkv, B*M, N]
        ub = (ub if M == 1 else ub.view(Hkv, B, M, N).amax(2)).view(Hkv, B, N)         # [Hkv, B, N]
        scores = torch.gather(ub, 2, phys[None].expand(Hkv, B, max_pages)).transpose(0, 1)      # [B, Hkv, max_pages]
    else:
        qt = qg.reshape(B * Hkv, M, D).transpose(1, 2)                                   # [B*Hkv, D, M]
        rows = (phys[:, None, :] * Hkv + torch.arange(Hkv, device=qg.device)[None, :, None]).reshape(-1)
        lo = k_min.reshape(-1, D).index_select(0, rows).view(B * Hkv, max_pages, D)
        hi = k_max.reshape(-1, D).index_select(0, rows).view(B * Hkv, max_pages, D)
        if lo.dtype != dt:
            lo, hi = lo.to(dt), hi.to(dt)
        pos, neg = box_operands(qt, gamma)
        scores = torch.bmm(lo, neg).add_(torch.bmm(hi, pos)).amax(-1).view(B, Hkv, max_pages)
    scores = scores if scores.dtype == torch.float32 else scores.float()
    return scores if valid is None else scores.masked_fill(~valid[:, None, :], NEG_INF)


def page_scores(q4, k_min, k_max, block_table, seq_lens, *, page_size, gamma=1.0):
    """The public ``page_scores`` on validated inputs: fp32 ``[B, Hkv, max_pages]`` (:func:`page_bounds`)."""
    phys, valid = physical_pages(block_table, seq_lens, page_size)
    qg = group_queries(q4, k_min.shape[1], math_dtype(q4))
    return page_bounds(qg, k_min, k_max, phys, valid, gamma).contiguous()


def selection_keys(seq_lens: torch.Tensor, num_pages: int, *, page_size: int, page_budget: int,
                   num_sink_pages: int, num_recent_pages: int, num_query_tokens: int) -> dict:
    """What a selection over the first ``num_pages`` logical pages needs besides the scores (once per step).

    The rule (DESIGN.md §3): per row, the last ``max(num_recent_pages, 1)`` valid pages (every page holding one of
    the ``Tq`` queries) are kept first, newest first, then the first ``num_sink_pages`` pages, then the best
    bounds; invalid pages (past the row's end) rank last.

    Returns a dict: ``K = min(page_budget, num_pages)``; ``valid`` ``[B, 1, num_pages]`` bool; and the keys of one
    of two forms: ``forced`` ``[B, 1, num_pages]`` bool + ``forced_key`` ``[B, 1, num_pages]`` fp32 (recent ``+inf``,
    sink ``FLT_MAX``, invalid ``-inf``) for a stable sort (``num_pages <= 64``), or ``packed`` ``[B, 1, num_pages]``
    int64 + ``rank`` ``[num_pages]`` for ``topk``.
    """
    device = seq_lens.device
    lens = seq_lens.to(torch.int64)
    n = num_valid_pages(lens, page_size)[:, None, None]                                 # [B, 1, 1]
    j = torch.arange(num_pages, device=device)                                                  # [num_pages]
    first_query_page = (lens - num_query_tokens).clamp(min=0)[:, None, None] // page_size
    recent = torch.clamp(n - first_query_page, min=max(num_recent_pages, 1))
    is_valid = j < n                                                                    # [B, 1, num_pages]
    is_recent = is_valid & (j >= n - recent)
    is_sink = is_valid & ~is_recent & (j < num_sink_pages)
    keys = dict(K=min(page_budget, num_pages), valid=is_valid, forced=is_recent | is_sink | ~is_valid)
    if num_pages <= _SORT_MAX_PAGES:
        keys["forced_key"] = torch.where(is_recent, float("inf"), torch.where(is_sink, _FLT_MAX, NEG_INF))
        return keys
    rank = num_pages - 1 - j                                                                    # ties: lower page first
    keys["packed"] = torch.where(is_recent, _FORCED_KEY + num_pages + rank,
                                 torch.where(is_sink, _FORCED_KEY + rank, _INVALID_KEY + rank))
    keys["rank"] = rank
    return keys


def top_pages(scores: torch.Tensor, keys: dict) -> torch.Tensor:
    """The ``K`` pages of each (row, KV head) the selection keeps, in rank order: int64 ``[B, Hkv, K]``.

    Rank order puts the recent pages first (oldest first), then the sinks, then the scored pages (best first),
    then invalid pages: so which *kind* of page sits at each position depends on the step only, not on the
    scores, and a plan computes the mask of any selection once per step (:class:`tinyattn.ops.plan_torch.TorchPlan`).

    A row with fewer than ``K`` valid pages also lists invalid pages (ids past its end) after its valid ones;
    :func:`select_pages` turns those into ``-1``, the plan's tables mask them.
    """
    if "packed" not in keys:
        # NaN counts as -inf (neginf= keeps a real -inf as -inf: it ties with NaN, lower page first); stable:
        # equal keys keep page order, so ties go to the lower page index (and valid pages before invalid ones)
        key = torch.where(keys["forced"], keys["forced_key"],
                          scores.nan_to_num(nan=NEG_INF, posinf=_SCORE_CAP, neginf=NEG_INF))
        return torch.sort(key, dim=-1, descending=True, stable=True).indices[..., : keys["K"]]
    key = torch.where(keys["forced"], keys["packed"], float_order_key(scores) + keys["rank"])
    # sorted: every position of the result holds a page of a known kind (forced first), as in the sort form
    return torch.topk(key, keys["K"], dim=-1, largest=True, sorted=True).indices


def top_p_keep(scores: torch.Tensor, ranked: torch.Tensor, keys: dict, top_p: float, scale: float) -> torch.Tensor:
    """Which of the capacity's pages ``ranked`` ``[B, Hkv, K]`` (rank order, :func:`top_pages`) the top-p rule keeps:
    bool ``[B, Hkv, K]`` (Twilight, Lin et al., arXiv 2502.02770: top-p over the estimated attention mass).

    A page's estimated mass is ``softmax(scale · score)`` over the row's valid pages (NaN as ``-inf``, ``+inf`` as
    ``FLT_MAX``; computed as ``exp(scale · (s - s_max)) / Σ``; a row whose scores are all ``-inf`` weighs 0
    everywhere). The forced pages of the capacity are kept and their mass ``F`` counted first; a scored page at rank
    ``i`` is kept while ``F`` plus the mass of the scored pages ranked before it is below ``top_p``: the fewest best
    pages whose mass, with the forced pages', reaches ``top_p``. ``top_p >= 1`` keeps the capacity. Fixed shapes,
    no host sync."""
    if top_p >= 1.0:
        return torch.ones(ranked.shape, dtype=torch.bool, device=ranked.device)
    valid, forced = keys["valid"], keys["forced"] & keys["valid"]                      # [B, 1, P]
    x = scores.float().nan_to_num(nan=NEG_INF, posinf=_FLT_MAX, neginf=NEG_INF).masked_fill(~valid, NEG_INF)
    top = x.amax(-1, keepdim=True)                                                     # [B, Hkv, 1]
    e = torch.where(x == NEG_INF, 0.0, ((x - top) * scale).exp())                     # [B, Hkv, P]
    total = e.sum(-1, keepdim=True)
    mass = torch.where(total > 0, e / total, 0.0).gather(-1, ranked)                   # [B, Hkv, K] in rank order
    is_forced = forced.expand(*scores.shape[:2], -1).gather(-1, ranked)
    scored = torch.where(is_forced, 0.0, mass)
    before = scored.cumsum(-1)
    before = torch.cat([torch.zeros_like(before[..., :1]), before[..., :-1]], -1)       # exclusive: ranked above
    reached = torch.where(is_forced, mass, 0.0).sum(-1, keepdim=True) + before
    return is_forced | (reached < top_p)


def select_pages(scores, seq_lens, *, page_size, page_budget, num_sink_pages, num_recent_pages, num_query_tokens,
                 top_p=None, scale=1.0):
    """The public ``select_pages`` on validated inputs: int32 ``[B, Hkv, page_budget]``, ascending, ``-1``
    padded (:func:`selection_keys` + :func:`top_pages`, then :func:`top_p_keep` with ``top_p``)."""
    B, Hkv, max_pages = scores.shape
    if B * Hkv * max_pages == 0:                                                                # no page to keep
        return torch.full((B, Hkv, page_budget), -1, dtype=torch.int32, device=scores.device)
    keys = selection_keys(seq_lens.to(scores.device), max_pages, page_size=page_size, page_budget=page_budget,
                          num_sink_pages=num_sink_pages, num_recent_pages=num_recent_pages,
                          num_query_tokens=num_query_tokens)
    chosen = top_pages(scores, keys)
    n = num_valid_pages(seq_lens.to(scores.device), page_size)[:, None, None]
    keep = chosen < n
    if top_p is not None:
        keep &= top_p_keep(scores, chosen, keys, top_p, scale)
    # max_pages stands for "none": it sorts last
    chosen = torch.sort(torch.where(keep, chosen, max_pages), dim=-1).values
    out = torch.full((B, Hkv, page_budget), -1, dtype=torch.int32, device=scores.device)
    out[..., : keys["K"]] = torch.where(chosen < max_pages, chosen, -1).to(torch.int32)
    return out


def float_order_key(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered like the fp32 ``scores``, in the high 32 bits (the low ones are free for a tie-break).

    NaN counts as ``-inf`` and ``-0.0`` as ``0.0``: the one ordering rule of every selection (DESIGN.md §3).
    """
    # nan_to_num, not where(isnan, -inf, x): the same values, ~3x faster on the CPU (a Python-scalar where
    # is slow there); +0.0 turns -0.0 into 0.0
    s = scores.float().nan_to_num(nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF).add_(0.0)
    bits = s.view(torch.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64) << 32


def canonical_page_indices(page_indices: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """Ascending, de-duplicated, ``-1`` for padding and for pages past the row's end (int32, same shape)."""
    n = num_valid_pages(seq_lens, page_size)[:, None, None]
    idx = page_indices.to(torch.int64)
    big = torch.iinfo(torch.int64).max
    idx = torch.where((idx >= 0) & (idx < n), idx, big)
    idx = torch.sort(idx, dim=-1).values
    dup = torch.zeros_like(idx, dtype=torch.bool)
    dup[..., 1:] = idx[..., 1:] == idx[..., :-1]
    idx = torch.where(dup, big, idx)
    idx = torch.sort(idx, dim=-1).values
    return torch.where(idx == big, -1, idx).to(torch.int32)


def mask_pages_before_window(scores: torch.Tensor, seq_lens: torch.Tensor, page_size: int, num_query_tokens: int,
                             window_left: int) -> torch.Tensor:
    """``scores`` ``[B, Hkv, max_pages]`` with ``-inf`` for every page wholly before the window of the row's earliest
    query (its last key ``(j + 1) * page_size - 1`` precedes ``seq_len - Tq - window_left``), in place.

    Such a page cannot contribute to any query of the row: a windowed selection ranks it below every page that
    overlaps the window (docs/api.md, ``window_left``). No-op for ``window_left = -1``."""
    if window_left < 0:
        return scores
    j = torch.arange(scores.shape[-1], device=scores.device)
    first = first_window_key(seq_lens.to(scores.device), num_query_tokens, window_left)
    before = (j[None, :] + 1) * page_size <= first[:, None]                             # [B, max_pages]
    return scores.masked_fill_(before[:, None, :], NEG_INF)


_LOW_NIBBLES = 0x0F0F0F0F0F0F0F0F      # the low nibble of each byte of an int64 word


def decode_key_codes(k_code: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor, phys: torch.Tensor,
                     heads: torch.Tensor) -> torch.Tensor:
    """fp32 keys ``[..., S, D]`` that the 4-bit codes of physical pages ``phys`` (KV heads ``heads``, broadcast
    together) stand for: ``k_min + code · (k_max - k_min) / 15`` per channel (low nibble of byte ``i``: channel
    ``i``; high: ``i + D/2``; a channel of zero width decodes to ``k_min``).

    The codes are gathered and split as int64 words (8 bytes at a time: a uint8 gather or mask per byte costs 8x
    on the CPU), then converted once into the output, scaled and shifted in place. A contiguous pool is gathered by
    ``index_select`` over its (page, slot, head) rows (one copy per row; ``pool[phys, :, heads]``, an advanced
    index, cost ~20% more of the whole re-rank on the CPU)."""
    half = k_code.shape[-1]
    if half % 8 == 0 and k_code.is_contiguous():
        num_pages, page_size, num_kv_heads = k_code.shape[:3]
        slot = torch.arange(page_size, device=k_code.device)
        rows = (phys[..., None] * page_size + slot) * num_kv_heads + heads[..., None]   # [..., S]
        words = k_code.view(torch.int64).view(-1, half // 8).index_select(0, rows.flatten())
        words = words.view(*rows.shape, half // 8)                                     # [..., S, D/16] int64
        low, high = (words & _LOW_NIBBLES).view(torch.uint8), ((words >> 4) & _LOW_NIBBLES).view(torch.uint8)
    elif half % 8 == 0 and k_code.stride(-1) == 1 and k_code.stride(-2) == half:
        words = k_code.view(torch.int64)[phys, :, heads]                          # [..., S, D/16] int64
        low, high = (words & _LOW_NIBBLES).view(torch.uint8), ((words >> 4) & _LOW_NIBBLES).view(torch.uint8)
    else:
        codes = k_code[phys, :, heads]                                              # [..., S, D/2] uint8
        low, high = codes & 15, codes >> 4
    keys = torch.empty(*low.shape[:-1], 2 * half, dtype=torch.float32, device=k_code.device)
    keys[..., :half] = low
    keys[..., half:] = high
    lo = _box_rows(k_min, phys, heads).float()
    step = (_box_rows(k_max, phys, heads).float() - lo) / 15.0
    return keys.mul_(torch.where(step > 0, step, 0.0).unsqueeze(-2)).add_(lo.unsqueeze(-2))


def _box_rows(box: torch.Tensor, phys: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """``box[phys, heads]`` (``[..., D]``; ``phys`` and ``heads`` broadcast together), by ``index_select`` over the
    (page, head) rows when ``box`` is contiguous (faster on the CPU than the advanced index)."""
    if not box.is_contiguous():
        return box[phys, heads]
    rows = (phys * box.shape[1] + heads)
    return box.view(-1, box.shape[-1]).index_select(0, rows.flatten()).view(*rows.shape, box.shape[-1])


def rerank_scores(q4, k_code, k_cache, k_min, k_max, candidates, block_table, seq_lens, *, page_size, scale,
                  window_left=-1, k_scale=None):
    """The log of each candidate page's estimated attention mass from 4-bit keys (the rule: the reference's
    :func:`tinyattn.ops.selection.reference.rerank_scores`): fp32 ``[B, Hkv, max_pages]``, ``-inf`` off the
    candidates. ``candidates`` ``[B, Hkv, C]`` logical pages (``-1`` padded, distinct); the row's last page is read
    from ``k_cache`` (``k_scale`` for an int8 / fp8 pool), every other one from ``k_code``.

    The candidates' keys are decoded once (:func:`decode_key_codes`), one matmul per (row, KV head) scores them
    all, and the last page's exact logits replace its coded ones afterwards (``[M, S]``, not ``[S, D]``)."""
    from ..attention.torch_impl import window_start

    B, Tq, Hq, D = q4.shape
    Hkv, max_pages = k_min.shape[1], block_table.shape[1]
    out = torch.full((B, Hkv, max_pages + 1), NEG_INF, dtype=torch.float32, device=q4.device)
    if B * Hkv * candidates.shape[-1] == 0 or max_pages == 0:
        return out[..., :max_pages]
    lens = seq_lens.to(torch.int64)
    n = num_valid_pages(lens, page_size)[:, None, None]                               # [B, 1, 1]
    cand = candidates.to(torch.int64)
    ok = (cand >= 0) & (cand < n)                                                     # [B, Hkv, C]
    j = torch.where(ok, cand, 0)
    phys = block_table.to(torch.int64).gather(1, j.flatten(1)).view_as(j)            # [B, Hkv, C]
    phys = torch.where(ok, phys, 0)          # padding / an empty row's entry may hold anything (-1): read page 0
    heads = torch.arange(Hkv, device=q4.device)[None, :, None]
    qg = group_queries(q4, Hkv, torch.float32)                                       # [B, Hkv, M, D]
    keys = decode_key_codes(k_code, k_min, k_max, phys, heads)                       # [B, Hkv, C, S, D]
    C = keys.shape[2]
    # one matmul per (row, KV head) over every candidate token: [M, D] x [D, C·S]
    logits = torch.matmul(qg, keys.view(B, Hkv, C * page_size, D).transpose(-1, -2))
    logits = logits.view(B, Hkv, -1, C, page_size).transpose(2, 3)                   # [B, Hkv, C, M, S]
    # the row's last page, exactly (it is always attended; its codes exist only once it is full)
    last_phys = block_table.to(torch.int64).gather(1, (n[:, 0] - 1).clamp(min=0)).squeeze(1)  # [B]
    last_phys = torch.where(n[:, 0, 0] > 0, last_phys, 0)                           # an empty row: masked below
    exact = k_cache.index_select(0, last_phys)                                       # [B, S, Hkv, D]
    if k_scale is not None:
        exact = exact.float() * k_scale.index_select(0, last_phys)[:, None, :, None]
    exact_logits = torch.einsum("bhmd,bshd->bhms", qg, exact.float())                # [B, Hkv, M, S]
    logits = torch.where((j == n - 1)[..., None, None], exact_logits[:, :, None], logits) * scale
    key_pos = (j[..., None] * page_size + torch.arange(page_size, device=q4.device))[:, :, :, None]  # [B,Hkv,C,1,S]
    M = qg.shape[2]
    q_pos = lens[:, None] - Tq + torch.arange(M, device=q4.device)[None, :] // (Hq // Hkv)    # [B, M], rows (t, g)
    q_pos = q_pos[:, None, None, :, None]                                            # [B, 1, 1, M, 1]
    seen = ok[..., None, None] & (key_pos < lens[:, None, None, None, None])
    seen = seen & (key_pos <= q_pos) & (key_pos >= window_start(q_pos, window_left))  # [B, Hkv, C, M, S]
    logits = logits.masked_fill(~seen, NEG_INF)
    z = logits.logsumexp(dim=(2, 4))                                                 # [B, Hkv, M]
    z = torch.where(z == NEG_INF, 0.0, z)       # a query that sees no candidate: its exps are all 0 anyway
    mass = (logits - z[:, :, None, :, None]).exp().sum(dim=(3, 4))                  # [B, Hkv, C]
    mu = torch.where(ok & (mass > 0), mass.log(), NEG_INF)      # no mass, or an undefined one (NaN): none
    out.scatter_(2, torch.where(ok, cand, max_pages), mu)
    return out[..., :max_pages]

