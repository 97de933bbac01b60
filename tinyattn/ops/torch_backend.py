"""Vectorised PyTorch implementation of the ops: the CPU fallback (DESIGN.md §4).

No Python loop over rows, heads or pages: the page bound is two small matmuls on the page centres
and radii, selection is one sort, attention gathers only the selected pages and runs one batched
softmax. Inputs are already validated and canonical (see ``tinyattn.ops.api``).
"""

from __future__ import annotations

import torch
from einops import rearrange

NEG_INF = float("-inf")


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def num_valid_pages(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """[B] int64: pages that hold at least one valid token."""
    return (seq_lens.to(torch.int64) + page_size - 1) // page_size


def _physical_pages(block_table: torch.Tensor, logical: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Physical ids of ``logical`` [B, ...] pages; 0 where not ``valid`` (a safe dummy, masked later)."""
    B = block_table.shape[0]
    flat = logical.clamp(min=0).reshape(B, -1)
    phys = torch.gather(block_table.to(torch.int64), 1, flat.clamp(max=block_table.shape[1] - 1))
    return torch.where(valid, phys.reshape(logical.shape), 0)


def page_scores(q4, k_min, k_max, block_table, seq_lens, *, page_size):
    """ub = q·c + |q|·r with c = (max+min)/2, r = (max-min)/2: equal to Σ max(q·min, q·max). [B, Hkv, P] fp32."""
    B, Tq, Hq, D = q4.shape
    Hkv = k_min.shape[1]
    P = block_table.shape[1]
    dt = _math_dtype(q4)
    cols = torch.arange(P, device=q4.device)
    valid = cols[None, :] < num_valid_pages(seq_lens, page_size)[:, None]               # [B, P]
    phys = _physical_pages(block_table, cols.expand(B, P), valid)                       # [B, P]
    lo, hi = k_min[phys].to(dt), k_max[phys].to(dt)                                     # [B, P, Hkv, D]
    centre, radius = (hi + lo) * 0.5, (hi - lo) * 0.5
    qg = rearrange(q4.to(dt), "b t (h g) d -> b h (t g) d", h=Hkv)                      # [B, Hkv, Tq*G, D]
    centre = rearrange(centre, "b p h d -> b h d p")
    radius = rearrange(radius, "b p h d -> b h d p")
    ub = qg @ centre + qg.abs() @ radius                                                # [B, Hkv, Tq*G, P]
    scores = ub.amax(dim=2).float()                                                     # [B, Hkv, P]
    return scores.masked_fill(~valid[:, None, :], NEG_INF)


def select_pages(scores, seq_lens, *, page_size, page_budget, num_sink_pages, num_recent_pages, num_query_tokens):
    """One sort over a priority that orders recent pages, then sinks, then scores, then invalid pages."""
    B, Hkv, P = scores.shape
    device = scores.device
    lens = seq_lens.to(torch.int64)
    n = num_valid_pages(lens, page_size)[:, None, None]                                 # [B, 1, 1]
    j = torch.arange(P, device=device)[None, None, :]                                   # [1, 1, P]
    first_query_page = (lens - num_query_tokens).clamp(min=0)[:, None, None] // page_size
    recent = torch.clamp(n - first_query_page, min=max(num_recent_pages, 1))
    is_valid = j < n
    is_recent = is_valid & (j >= n - recent)
    is_sink = is_valid & ~is_recent & (j < num_sink_pages)
    # rank of each page by score, descending, ties to the lower index (stable sort of -score)
    key = torch.nan_to_num(scores.float(), nan=NEG_INF).masked_fill(~is_valid, NEG_INF)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    score_rank = torch.empty_like(order).scatter_(-1, order, torch.arange(P, device=device).expand_as(order))
    priority = torch.where(is_recent, n - 1 - j,                                        # newest first
               torch.where(is_sink, P + j,
               torch.where(is_valid, 2 * P + score_rank, 4 * P + j)))
    k = min(page_budget, P)
    chosen_priority, chosen = torch.topk(priority, k, dim=-1, largest=False, sorted=True)
    chosen = torch.where(chosen_priority < 4 * P, chosen, P)                            # P = "none", sorts last
    chosen = torch.sort(chosen, dim=-1).values
    out = torch.full((B, Hkv, page_budget), -1, dtype=torch.int32, device=device)
    out[..., :k] = torch.where(chosen < P, chosen, -1).to(torch.int32)
    return out


def canonical_page_indices(page_indices, seq_lens, page_size):
    """Ascending, de-duplicated, -1 for padding and for pages past the row's end (so both paths ignore them)."""
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


def dense_page_indices(seq_lens, num_kv_heads, max_pages, page_size):
    """Every valid page of each row, as [B, Hkv, max_pages] with -1 past the end."""
    j = torch.arange(max_pages, device=seq_lens.device)
    idx = torch.where(j[None, :] < num_valid_pages(seq_lens, page_size)[:, None], j, -1)
    return idx[:, None, :].expand(-1, num_kv_heads, -1).to(torch.int32)


def attention(q4, k_cache, v_cache, block_table, seq_lens, page_indices, *, scale):
    """Attention of q [B, Tq, Hq, D] over canonical ``page_indices`` [B, Hkv, K]; returns (out, lse)."""
    B, Tq, Hq, D = q4.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    dt = _math_dtype(q4)
    sel = page_indices.to(torch.int64)                                                  # [B, Hkv, K]
    phys = _physical_pages(block_table, sel, sel >= 0)                                  # [B, Hkv, K]
    heads = torch.arange(Hkv, device=q4.device)[None, :, None]
    # advanced indices split by a slice: the result is [B, Hkv, K, S, D]
    k = rearrange(k_cache[phys, :, heads], "b h k s d -> b h (k s) d").to(dt)
    v = rearrange(v_cache[phys, :, heads], "b h k s d -> b h (k s) d").to(dt)
    pos = rearrange(sel[..., None] * S + torch.arange(S, device=q4.device), "b h k s -> b h (k s)")
    lens = seq_lens.to(torch.int64)[:, None, None]
    key_ok = (sel[..., None] >= 0).expand(-1, -1, -1, S).reshape(pos.shape) & (pos < lens)   # [B, Hkv, K*S]
    v = torch.where(key_ok[..., None], v, 0.0)                                          # 0 * NaN padding = NaN
    q_pos = lens[..., None] - Tq + torch.arange(Tq, device=q4.device)[None, None, :, None]   # [B, 1, Tq, 1]
    visible = key_ok[:, :, None, :] & (pos[:, :, None, :] <= q_pos)                     # [B, Hkv, Tq, K*S]
    qg = rearrange(q4.to(dt), "b t (h g) d -> b h t g d", h=Hkv)
    logits = scale * torch.einsum("bhtgd,bhnd->bhtgn", qg, k)
    logits = logits.masked_fill(~visible[:, :, :, None, :], NEG_INF)
    m = logits.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)                                          # empty rows: no NaN
    p = torch.exp(logits - m)
    denom = p.sum(-1, keepdim=True)
    out = torch.einsum("bhtgn,bhnd->bhtgd", p, v) / torch.where(denom > 0, denom, 1.0)
    lse = (m + torch.log(denom)).squeeze(-1)                                            # log(0) = -inf
    out = rearrange(out, "b h t g d -> b t (h g) d")
    lse = rearrange(lse, "b h t g -> b t (h g)")
    return out.to(q4.dtype), lse.float()


def update_page_metadata(k_cache, block_table, seq_lens, k_min, k_max):
    """Min/max over valid slots of every valid page, written at the physical page ids."""
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
    n_tok = (seq_lens.to(torch.int64)[rows] - logical * S).clamp(max=S)                 # [N]
    slot_ok = (torch.arange(S, device=k_cache.device)[None, :] < n_tok[:, None])[:, :, None, None]
    inf = torch.tensor(float("inf"), dtype=keys.dtype, device=keys.device)
    k_min[phys] = torch.where(slot_ok, keys, inf).amin(1).to(k_min.dtype)
    k_max[phys] = torch.where(slot_ok, keys, -inf).amax(1).to(k_max.dtype)
