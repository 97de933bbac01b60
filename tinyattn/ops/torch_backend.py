"""Vectorised PyTorch twins of the scoring, selection and metadata ops: the CPU path of the stand-alone
``page_scores`` / ``select_pages`` / ``update_page_metadata`` (DESIGN.md §4).

No Python loop over rows, heads or pages. Inputs are already validated and canonical (see
``tinyattn.ops.api``). Attention itself lives in the per-step plan (:mod:`tinyattn.ops.plan`, which also has
its own fused scoring and selection for the decode path) and its one torch core (:mod:`tinyattn.ops.core`).

- **Scoring** is two matmuls per KV head, ``q⁺·k_max + q⁻·k_min`` with ``q⁺ = max(q, 0)`` and
  ``q⁻ = min(q, 0)``, which equals ``Σ_i max(q_i·k_min_i, q_i·k_max_i)`` term by term. When the rows
  use most of the page pool (always the case for one sequence) the matmuls run over the pool's boxes
  in place (strided views, no copy) and the scores are then gathered through the block table, so the
  boxes are read exactly once; otherwise the rows' boxes are gathered first.
- **Selection** is one ``torch.topk`` over an int64 key that packs the forced pages (recent, sinks),
  an order-preserving integer image of the score and the page index (ties to the lower index).
"""

from __future__ import annotations

import torch

from .boxes import store_box
from .core import (canonical_page_indices, dense_page_indices, float_order_key, group_queries,  # noqa: F401
                   math_dtype, num_valid_pages)

NEG_INF = float("-inf")
# pool-wide matmuls are used while their [Hkv, rows * Tq * G, pool] intermediate stays under this size
_POOL_LOGITS_BYTES = 64 * 2**20


def _physical_pages(block_table: torch.Tensor, logical: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Physical ids of ``logical`` [B, ...] pages; 0 where not ``valid`` (a safe dummy, masked later)."""
    B = block_table.shape[0]
    flat = logical.clamp(min=0).reshape(B, -1)
    phys = torch.gather(block_table.to(torch.int64), 1, flat.clamp(max=block_table.shape[1] - 1))
    return torch.where(valid, phys.reshape(logical.shape), 0)


def page_scores(q4, k_min, k_max, block_table, seq_lens, *, page_size):
    """ub = q⁺·k_max + q⁻·k_min, max over the group and the queries of each row. [B, Hkv, P] fp32."""
    B, Tq, Hq, D = q4.shape
    N, Hkv = k_min.shape[0], k_min.shape[1]
    P = block_table.shape[1]
    dt = math_dtype(q4)
    if B * Tq * P * N == 0:                                                             # nothing to score
        return torch.full((B, Hkv, P), NEG_INF, dtype=torch.float32, device=q4.device)
    cols = torch.arange(P, device=q4.device)
    n_valid = num_valid_pages(seq_lens, page_size)
    valid = cols[None, :] < n_valid[:, None]                                            # [B, P]
    phys = _physical_pages(block_table, cols.expand(B, P), valid)                       # [B, P]
    qg = group_queries(q4, Hkv, dt)                                                     # [B, Hkv, M, D]
    q_pos, q_neg = qg.clamp(min=0), qg.clamp(max=0)
    M = qg.shape[2]
    total_valid = int(n_valid.sum()) if B > 1 else P
    if N <= 2 * max(total_valid, 1) and Hkv * B * M * N * 4 <= _POOL_LOGITS_BYTES:
        # every row against the whole pool, boxes read once in place: [Hkv, B*M, N]
        qp = q_pos.transpose(0, 1).reshape(Hkv, B * M, D)                                # [Hkv, B*M, D]
        qn = q_neg.transpose(0, 1).reshape(Hkv, B * M, D)
        lo = k_min.permute(1, 2, 0).to(dt)                                              # [Hkv, D, N] (view)
        hi = k_max.permute(1, 2, 0).to(dt)
        ub = torch.baddbmm(torch.bmm(qn, lo), qp, hi)                                   # [Hkv, B*M, N]
        ub = ub.view(Hkv, B, M, N).amax(2)                                              # [Hkv, B, N]
        scores = torch.gather(ub, 2, phys[None].expand(Hkv, B, P))                      # [Hkv, B, P]
        scores = scores.permute(1, 0, 2).float()
    else:
        lo = k_min[phys].to(dt).permute(0, 2, 3, 1)                                     # [B, Hkv, D, P]
        hi = k_max[phys].to(dt).permute(0, 2, 3, 1)
        scores = (q_pos @ hi + q_neg @ lo).amax(dim=2).float()                          # [B, Hkv, P]
    return scores.masked_fill(~valid[:, None, :], NEG_INF).contiguous()


_INVALID_KEY = torch.iinfo(torch.int64).min
_FORCED_KEY = 0x7F800001 << 32                       # above the key of any score (+inf included)


def select_pages(scores, seq_lens, *, page_size, page_budget, num_sink_pages, num_recent_pages, num_query_tokens):
    """One ``torch.topk`` over an int64 key: recent pages, then sinks, then scores, then invalid pages.

    The key of a scored page packs an order-preserving integer image of the fp32 score (high 32 bits) with
    ``P - 1 - j`` (low bits), so equal scores go to the lower page index exactly as the reference does; NaN
    counts as ``-inf`` (so NaN vs ``-inf`` is a tie, won by the lower page index). Forced pages get keys above every score, invalid pages the minimum.
    """
    B, Hkv, P = scores.shape
    device = scores.device
    if B * Hkv * P == 0:                                                                # no page to keep
        return torch.full((B, Hkv, page_budget), -1, dtype=torch.int32, device=device)
    lens = seq_lens.to(torch.int64)
    n = num_valid_pages(lens, page_size)[:, None, None]                                 # [B, 1, 1]
    j = torch.arange(P, device=device)                                                  # [P]
    first_query_page = (lens - num_query_tokens).clamp(min=0)[:, None, None] // page_size
    recent = torch.clamp(n - first_query_page, min=max(num_recent_pages, 1))
    is_valid = j < n                                                                    # [B, 1, P]
    is_recent = is_valid & (j >= n - recent)
    is_sink = is_valid & ~is_recent & (j < num_sink_pages)
    forced = torch.where(is_recent, _FORCED_KEY + 2 * P + j, _FORCED_KEY + P - j)      # newest, then first pages
    fallback = torch.where(is_recent | is_sink, forced, _INVALID_KEY)                   # [B, 1, P]
    key = float_order_key(scores)                                       # NaN as -inf, -0.0 as 0.0
    key = torch.where(is_valid & ~(is_recent | is_sink), key + (P - 1 - j), fallback)
    k = min(page_budget, P)
    top = torch.topk(key, k, dim=-1, largest=True, sorted=False)                       # [B, Hkv, k]
    chosen = torch.where(top.values > _INVALID_KEY, top.indices, P)                     # P = "none", sorts last
    chosen = torch.sort(chosen, dim=-1).values
    out = torch.full((B, Hkv, page_budget), -1, dtype=torch.int32, device=device)
    out[..., :k] = torch.where(chosen < P, chosen, -1).to(torch.int32)
    return out


def update_page_metadata(k_cache, block_table, seq_lens, k_min, k_max, k_scale=None):
    """Min/max over valid slots of every valid page, written at the physical page ids (of the dequantized keys
    ``code.float() * scale`` with an int8 / fp8 pool and its ``k_scale``)."""
    B, P = block_table.shape
    S = k_cache.shape[1]
    cols = torch.arange(P, device=k_cache.device)
    n = num_valid_pages(seq_lens, S)
    valid = cols[None, :] < n[:, None]                                                  # [B, P]
    rows, logical = valid.nonzero(as_tuple=True)
    if rows.numel() == 0:
        return
    phys = block_table[rows, logical].to(torch.int64)                                   # [N]
    keys = k_cache[phys]                                                                # [N, S, Hkv, D]
    if k_scale is not None:
        keys = keys.float() * k_scale[phys][:, None, :, None]
    n_tok = (seq_lens.to(torch.int64)[rows] - logical * S).clamp(max=S)                 # [N]
    slot_ok = (torch.arange(S, device=k_cache.device)[None, :] < n_tok[:, None])[:, :, None, None]
    inf = torch.tensor(float("inf"), dtype=keys.dtype, device=keys.device)
    # a box narrower than the keys is rounded outward: still a bound (tinyattn.ops.boxes)
    store_box(k_min, k_max, phys, torch.where(slot_ok, keys, inf).amin(1), torch.where(slot_ok, keys, -inf).amax(1))
