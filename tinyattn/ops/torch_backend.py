"""Vectorised PyTorch implementation of the ops: the CPU fallback (DESIGN.md §4).

No Python loop over rows, heads or pages. Inputs are already validated and canonical (see
``tinyattn.ops.api``). Speed notes (``bench/decode_attention.py`` measures them against SDPA):

- **Scoring** is two matmuls per KV head, ``q⁺·k_max + q⁻·k_min`` with ``q⁺ = max(q, 0)`` and
  ``q⁻ = min(q, 0)``, which equals ``Σ_i max(q_i·k_min_i, q_i·k_max_i)`` term by term. When the rows
  use most of the page pool (always the case for one sequence) the matmuls run over the pool's boxes
  in place (strided views, no copy) and the scores are then gathered through the block table, so the
  boxes are read exactly once; otherwise the rows' boxes are gathered first.
- **Selection** is one ``torch.topk`` over an int64 key that packs the forced pages (recent, sinks),
  an order-preserving integer image of the score and the page index (ties to the lower index).
- **Attention** gathers only the selected ``(page, head)`` rows of K and V (``index_select`` on the
  flattened pool, one 2-D copy) and runs one batched softmax. When every row reads most of the pool
  (dense decode of one sequence) it instead multiplies over the pool in place and reads K and V once.
"""

from __future__ import annotations

import threading

import torch

NEG_INF = float("-inf")
# pool-wide matmuls are used while their [Hkv, rows * Tq * G, pool] intermediate stays under this size
_POOL_LOGITS_BYTES = 64 * 2**20


_workspace = threading.local()
_WORKSPACE_MAX_BYTES = 256 * 2**20


def _buffer(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """A per-thread scratch tensor reused across calls (``None`` when too large to keep).

    Large temporaries freshly allocated at every decode step cost page faults (the allocator hands big
    blocks back to the OS); the gathered K/V of the sparse path are reused from here instead. The buffer
    only lives inside one call, so reuse is safe within a thread.
    """
    numel = 1
    for n in shape:
        numel *= n
    if numel * torch.empty((), dtype=dtype).element_size() > _WORKSPACE_MAX_BYTES or device.type != "cpu":
        return None
    store = _workspace.__dict__.setdefault("buffers", {})
    buf = store.get(name)
    if buf is None or buf.dtype != dtype or buf.numel() < numel:
        buf = store[name] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)


def _index_rows(src: torch.Tensor, rows: torch.Tensor, name: str) -> torch.Tensor:
    """``src[rows]`` for a 2-D ``src``, written into a reused buffer when possible."""
    if src.requires_grad and torch.is_grad_enabled():
        return src.index_select(0, rows)                                                # out= has no autograd
    out = _buffer(name, (rows.numel(), src.shape[1]), src.dtype, src.device)
    if out is None:
        return src.index_select(0, rows)
    return torch.index_select(src, 0, rows, out=out)


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


def _group_queries(q4: torch.Tensor, Hkv: int, dt: torch.dtype) -> torch.Tensor:
    """[B, Tq, Hq, D] -> [B, Hkv, Tq*G, D] in the math dtype (the queries that share one KV head)."""
    B, Tq, Hq, D = q4.shape
    return q4.to(dt).view(B, Tq, Hkv, Hq // Hkv, D).transpose(1, 2).reshape(B, Hkv, Tq * (Hq // Hkv), D)


def page_scores(q4, k_min, k_max, block_table, seq_lens, *, page_size):
    """ub = q⁺·k_max + q⁻·k_min, max over the group and the queries of each row. [B, Hkv, P] fp32."""
    B, Tq, Hq, D = q4.shape
    N, Hkv = k_min.shape[0], k_min.shape[1]
    P = block_table.shape[1]
    dt = _math_dtype(q4)
    if B * Tq * P * N == 0:                                                             # nothing to score
        return torch.full((B, Hkv, P), NEG_INF, dtype=torch.float32, device=q4.device)
    cols = torch.arange(P, device=q4.device)
    n_valid = num_valid_pages(seq_lens, page_size)
    valid = cols[None, :] < n_valid[:, None]                                            # [B, P]
    phys = _physical_pages(block_table, cols.expand(B, P), valid)                       # [B, P]
    qg = _group_queries(q4, Hkv, dt)                                                    # [B, Hkv, M, D]
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
    # NaN counts as -inf (nan_to_num would also turn -inf into -finfo.max, ranking NaN below it); -0.0 == 0.0
    s = torch.where(torch.isnan(scores), NEG_INF, scores.float()) + 0.0
    bits = s.view(torch.int32)
    key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64) << 32                    # float order as int
    key = torch.where(is_valid & ~(is_recent | is_sink), key + (P - 1 - j), fallback)
    k = min(page_budget, P)
    top = torch.topk(key, k, dim=-1, largest=True, sorted=False)                       # [B, Hkv, k]
    chosen = torch.where(top.values > _INVALID_KEY, top.indices, P)                     # P = "none", sorts last
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


def _softmax_parts(logits: torch.Tensor):
    """Masked logits (-inf = hidden) -> (unnormalised p, max m, denominator); empty rows give p = 0, no NaN."""
    m = logits.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    p = torch.exp(logits - m)
    return p, m, p.sum(-1, keepdim=True)


def _finish(out, m, denom, q4, Hkv):
    """[B, Hkv, Tq*G, D] unnormalised out -> (out [B, Tq, Hq, D] in q's dtype, lse [B, Tq, Hq] fp32)."""
    Tq = q4.shape[1]
    out = out / torch.where(denom > 0, denom, 1.0)
    lse = (m + torch.log(denom)).squeeze(-1)                                            # log(0) = -inf
    B, _, M, D = out.shape
    G = M // Tq
    out = out.reshape(B, Hkv, Tq, G, D).transpose(1, 2).reshape(B, Tq, Hkv * G, D)
    lse = lse.reshape(B, Hkv, Tq, G).transpose(1, 2).reshape(B, Tq, Hkv * G)
    return out.to(q4.dtype), lse.float()


def attention(q4, k_cache, v_cache, block_table, seq_lens, page_indices, *, scale):
    """Attention of q [B, Tq, Hq, D] over canonical ``page_indices`` [B, Hkv, K]; returns (out, lse)."""
    B, Tq, Hq, D = q4.shape
    N, S, Hkv = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    K = page_indices.shape[2]
    G = Hq // Hkv
    dt = _math_dtype(q4)
    device = q4.device
    sel = page_indices.to(torch.int64)                                                  # [B, Hkv, K]
    phys = _physical_pages(block_table, sel, sel >= 0)                                  # [B, Hkv, K]
    offs = torch.arange(S, device=device)
    pos = (sel[..., None] * S + offs).reshape(B, Hkv, K * S)                            # [B, Hkv, K*S] positions
    lens = seq_lens.to(torch.int64)[:, None, None]
    key_ok = (sel >= 0).repeat_interleave(S, dim=2) & (pos < lens)                      # [B, Hkv, K*S]
    if Tq == 1:
        visible = key_ok[:, :, None, None, :]                                           # the query is the last token
    else:
        q_pos = lens[..., None] - Tq + torch.arange(Tq, device=device)[:, None]         # [B, 1, Tq, 1]
        visible = (key_ok[:, :, None, :] & (pos[:, :, None, :] <= q_pos))[:, :, :, None, :]
    # visible: [B, Hkv, Tq or 1, 1, K*S], broadcast over the G query heads of each KV head
    qg = _group_queries(q4, Hkv, dt)                                                    # [B, Hkv, Tq*G, D]
    slot = (phys[..., None] * S + offs).reshape(B, Hkv, K * S)                          # token slot in the pool
    pool_tokens = N * S
    if (dt == k_cache.dtype and 2 * K * S >= pool_tokens and Hkv * B * Tq * G * pool_tokens * 4 <= _POOL_LOGITS_BYTES
            and 2 * int(key_ok.sum()) >= B * Hkv * pool_tokens):
        out = _attention_pool(qg, k_cache, v_cache, slot, visible, scale, Tq)
        if out is not None:
            return _finish(*out, q4, Hkv)
    rows = (slot * Hkv + torch.arange(Hkv, device=device)[None, :, None]).reshape(-1)   # rows of [N*S*Hkv, D]
    k = _index_rows(k_cache.reshape(-1, D), rows, "k").view(B, Hkv, K * S, D).to(dt)
    v = _index_rows(v_cache.reshape(-1, D), rows, "v").view(B, Hkv, K * S, D).to(dt)
    hidden = (~key_ok).reshape(-1).nonzero().squeeze(1)                                 # few: padding slots
    if hidden.numel():
        v.view(-1, D).index_fill_(0, hidden, 0.0)                                       # 0 * NaN padding = NaN
    logits = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale)                          # [B, Hkv, Tq*G, K*S]
    logits.view(B, Hkv, Tq, G, K * S).masked_fill_(~visible, NEG_INF)
    p, m, denom = _softmax_parts(logits)
    return _finish(torch.matmul(p, v), m, denom, q4, Hkv)


def _attention_pool(qg, k_cache, v_cache, slot, visible, scale, Tq):
    """Logits and P·V as matmuls over the whole pool, reading K and V in place once (no gather).

    Used when the rows read most of the pool. Returns ``None`` when the result is not finite (garbage in
    unused pool slots, ``0 * NaN``), so that the caller's gather path decides.
    """
    B, Hkv, M, D = qg.shape
    KS = slot.shape[-1]
    NS = k_cache.shape[0] * k_cache.shape[1]
    kp = k_cache.reshape(NS, Hkv, D).permute(1, 2, 0)                                   # [Hkv, D, NS] (view)
    vp = v_cache.reshape(NS, Hkv, D).permute(1, 0, 2)                                   # [Hkv, NS, D] (view)
    q = qg.transpose(0, 1).reshape(Hkv, B * M, D)                                       # [Hkv, B*M, D]
    logits = torch.bmm(q, kp).view(Hkv, B, M, NS)                                       # [Hkv, B, M, NS]
    idx = slot.permute(1, 0, 2)[:, :, None, :].expand(Hkv, B, M, KS)                    # [Hkv, B, M, KS]
    sel_logits = torch.gather(logits, 3, idx).permute(1, 0, 2, 3).mul_(scale)           # [B, Hkv, M, KS]
    sel_logits.view(B, Hkv, Tq, M // Tq, KS).masked_fill_(~visible, NEG_INF)
    p, m, denom = _softmax_parts(sel_logits)
    p_pool = torch.zeros_like(logits).scatter_add_(3, idx, p.permute(1, 0, 2, 3))       # hidden keys add p = 0
    out = torch.bmm(p_pool.view(Hkv, B * M, NS), vp).view(Hkv, B, M, D).permute(1, 0, 2, 3)
    if not bool(torch.isfinite(out).all()):
        return None
    return out, m, denom


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
