"""The one PyTorch core of paged attention: which pool rows a row's keys live in, and a NaN-safe softmax.

Every torch-side attention of the package is built from these few functions: the torch backend's per-step plan
(:mod:`tinyattn.ops.plan_torch`, whose row and mask tables are :func:`page_rows` of every page), the autograd formula (:mod:`tinyattn.ops.autograd`) and the selection metrics
(:func:`tinyattn.selection.page_attention_mass`).
``tinyattn.reference`` stays an independent loop twin that the tests compare them against.

Layout (docs/layout.md): the pool ``k_cache`` ``[num_pages, page_size, Hkv, D]`` is read as a flat
``[num_pages * page_size * Hkv, D]`` matrix whose row ``(page * page_size + slot) * Hkv + head`` holds one
key. A gather of such rows is one ``index_select``.

**Filler rows.** A slot that must not count (past ``seq_lens``, a ``-1`` page, padding of a batch) is
pointed at a *valid* key of the same (row, KV head) - its first token - and hidden by the mask. The
unused slots of the pool may hold anything (NaN, inf, garbage): they are never read, so no zeroing pass is
needed and a ``0 * NaN`` can never reach the output. A row with no valid token borrows the first key of the
first non-empty row and is fully masked (its output is 0 and its lse ``-inf``, see :func:`softmax_parts`).
"""

from __future__ import annotations

import torch

from .quant import QUANTIZED_DTYPES

NEG_INF = float("-inf")

__all__ = ["math_dtype", "float_order_key", "num_valid_pages", "cdiv_pages", "dense_page_indices", "canonical_page_indices", "page_rows", "first_window_key",
           "mask_pages_before_window", "group_queries", "ungroup", "softmax_parts",
           "attend_rows", "finish_output", "empty_attention", "NEG_INF"]


def math_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype attention math runs in for inputs like ``x``: fp64 for fp64, fp32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def float_order_key(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered like the fp32 ``scores``, in the high 32 bits (the low ones are free for a tie-break).

    NaN counts as ``-inf`` and ``-0.0`` as ``0.0``: the one ordering rule of every selection (DESIGN.md §3).
    """
    # nan_to_num, not where(isnan, -inf, x): the same values, ~3x faster on the CPU (a Python-scalar where
    # is slow there); +0.0 turns -0.0 into 0.0
    s = scores.float().nan_to_num(nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF).add_(0.0)
    bits = s.view(torch.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64) << 32


def num_valid_pages(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[B]`` int64: pages that hold at least one valid token, ``ceil(seq_lens / page_size)``."""
    return (seq_lens.to(torch.int64) + page_size - 1) // page_size


def cdiv_pages(num_tokens: int, page_size: int) -> int:
    """Pages that ``num_tokens`` tokens occupy (a Python int)."""
    return -(-int(num_tokens) // page_size)


def dense_page_indices(seq_lens: torch.Tensor, num_kv_heads: int, max_pages: int, page_size: int) -> torch.Tensor:
    """Every valid page of each row, as int32 ``[B, Hkv, max_pages]`` with ``-1`` past the end."""
    j = torch.arange(max_pages, device=seq_lens.device)
    idx = torch.where(j[None, :] < num_valid_pages(seq_lens, page_size)[:, None], j, -1)
    return idx[:, None, :].expand(-1, num_kv_heads, -1).to(torch.int32)


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


def page_rows(block_table: torch.Tensor, seq_lens: torch.Tensor, pages: torch.Tensor, *, page_size: int,
              num_kv_heads: int, num_query_tokens: int = 1,
              window_left: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat pool rows, key positions and visibility of the slots of logical ``pages``.

    Args:
        block_table: ``[B, max_pages_per_seq]`` int. seq_lens: ``[B]`` int (including the ``Tq`` queries).
        pages: ``[B, Hkv, K]`` logical page ids; ``-1`` and ids past the row's end are hidden.
        page_size, num_kv_heads: ``S`` and ``Hkv``. num_query_tokens: ``Tq``, for the causal mask.
        window_left: keys a query sees before its own position (FlashInfer's convention), ``-1`` = no limit.

    Returns:
        ``rows`` int64 ``[B, Hkv, K, S]`` into the flat pool (a filler row where hidden, see the module
        docstring), ``pos`` int64 ``[B, Hkv, K, S]`` the key positions, and ``visible`` bool
        ``[B, Hkv, Tq, K, S]``: query ``t`` (at position ``p = seq_len - Tq + t``) sees the key (bottom-right
        causal, DESIGN.md §2), and with a window only keys at positions ``>= p - window_left``.
    """
    B, Hkv, K = pages.shape
    S = page_size
    device = pages.device
    lens = seq_lens.to(device=device, dtype=torch.int64)
    table = block_table.to(device=device, dtype=torch.int64)
    sel = pages.to(torch.int64)
    ok = (sel >= 0) & (sel < num_valid_pages(lens, S)[:, None, None])                  # [B, Hkv, K]
    width = max(table.shape[1], 1)
    phys = torch.gather(table, 1, sel.clamp(0, width - 1).reshape(B, -1)).reshape(B, Hkv, K) if table.numel() \
        else torch.zeros_like(sel)
    pos = sel[..., None] * S + torch.arange(S, device=device)                          # [B, Hkv, K, S]
    key_ok = ok[..., None] & (pos < lens[:, None, None, None])
    heads = torch.arange(Hkv, device=device)[None, :, None, None]
    rows = (phys[..., None] * S + torch.arange(S, device=device)) * Hkv + heads         # [B, Hkv, K, S]
    # a hidden slot reads the first key of the first valid page listed for its (row, head): a key the row reads
    # anyway (a valid key is finite; an unused slot, or a page before a window, may hold NaN, and a hidden key's
    # weight 0 times NaN is still NaN). A (row, head) with no valid page borrows another's.
    big = torch.iinfo(torch.int64).max
    lead = torch.where(ok, sel, big).amin(-1) if K else torch.full((B, Hkv), big, device=device)      # [B, Hkv]
    has = lead < big
    lead_phys = torch.gather(table, 1, lead.clamp(0, width - 1)) if table.numel() else torch.zeros_like(lead)
    # none listed: the row's own first page (a valid key when the row is not empty)
    row_first = table[:, :1] if table.numel() else torch.zeros(B, 1, dtype=torch.int64, device=device)
    lead_phys = torch.where(has, lead_phys, row_first)
    has = has | (lens > 0)[:, None]
    # neither (an empty row): another (row, head)'s filler; none anywhere: pool row 0 (never a table entry past a
    # row's end, which may hold any id)
    first = torch.where(has, lead_phys, 0) * (S * Hkv) + heads[:, :, 0, 0]              # [B, Hkv]
    # the donor by index_select, not a 0-dim index (which Python would read on the host)
    donor = first.flatten().index_select(0, has.flatten().to(torch.int8).argmax().view(1)) if first.numel() \
        else first.new_zeros(1)
    filler = torch.where(has, first, donor)[:, :, None, None]                          # [B, Hkv, 1, 1]
    rows = torch.where(key_ok, rows, filler)
    q_pos = lens[:, None] - num_query_tokens + torch.arange(num_query_tokens, device=device)  # [B, Tq]
    visible = key_ok[:, :, None] & (pos[:, :, None] <= q_pos[:, None, :, None, None])   # [B, Hkv, Tq, K, S]
    if window_left >= 0:
        visible &= pos[:, :, None] >= (q_pos - window_left)[:, None, :, None, None]
    return rows, pos, visible


def first_window_key(seq_lens: torch.Tensor, num_query_tokens: int, window_left: int) -> torch.Tensor:
    """``[B]`` int64: the first key position any query of the row sees, ``seq_len - Tq - window_left``
    (the earliest query's window; may be negative), or ``0`` without a window (``window_left = -1``)."""
    lens = seq_lens.to(torch.int64)
    if window_left < 0:
        return torch.zeros_like(lens)
    return lens - num_query_tokens - window_left


def mask_pages_before_window(scores: torch.Tensor, seq_lens: torch.Tensor, page_size: int, num_query_tokens: int,
                             window_left: int) -> torch.Tensor:
    """``scores`` ``[B, Hkv, P]`` with ``-inf`` for every page wholly before the window of the row's earliest
    query (its last key ``(j + 1) * page_size - 1`` precedes ``seq_len - Tq - window_left``), in place.

    Such a page cannot contribute to any query of the row: a windowed selection ranks it below every page that
    overlaps the window (docs/api.md, ``window_left``). No-op for ``window_left = -1``."""
    if window_left < 0:
        return scores
    j = torch.arange(scores.shape[-1], device=scores.device)
    first = first_window_key(seq_lens.to(scores.device), num_query_tokens, window_left)
    before = (j[None, :] + 1) * page_size <= first[:, None]                             # [B, P]
    return scores.masked_fill_(before[:, None, :], NEG_INF)


def group_queries(q4: torch.Tensor, num_kv_heads: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[B, Tq, Hq, D]`` -> ``[B, Hkv, Tq * G, D]``: the queries that share one KV head, rows ordered ``(t, g)``.

    A free view for decode (``Tq == 1``, contiguous heads); a copy otherwise.
    """
    B, Tq, Hq, D = q4.shape
    x = q4 if dtype is None else q4.to(dtype)
    if Tq == 1:
        return x.reshape(B, num_kv_heads, Hq // num_kv_heads, D)
    return x.reshape(B, Tq, num_kv_heads, Hq // num_kv_heads, D).transpose(1, 2).reshape(B, num_kv_heads, -1, D)


def ungroup(x: torch.Tensor, num_query_tokens: int) -> torch.Tensor:
    """Inverse of :func:`group_queries` on ``[B, Hkv, Tq * G, ...]`` -> ``[B, Tq, Hq, ...]``."""
    B, Hkv, M = x.shape[:3]
    rest = x.shape[3:]
    Tq = num_query_tokens
    if Tq == 1:
        return x.reshape(B, 1, Hkv * M, *rest)
    return x.reshape(B, Hkv, Tq, M // Tq, *rest).transpose(1, 2).reshape(B, Tq, Hkv * (M // Tq), *rest)


def softmax_parts(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masked logits (``-inf`` = hidden) -> ``(p, m, denom)`` with ``p = exp(logits - m)`` unnormalised.

    A row with no visible key gets ``p = 0``, ``m = 0``, ``denom = 0`` (never NaN): callers divide by
    ``where(denom > 0, denom, 1)`` and take ``lse = m + log(denom) = -inf``. Very negative real logits are
    not confused with hidden ones: the mask is a true ``-inf``, never a finite stand-in.
    """
    m = logits.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    p = torch.exp(logits - m)
    return p, m, p.sum(-1, keepdim=True)


def attend_rows(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, scale: float):
    """NaN-safe masked attention with its lse: ``qg [B, Hkv, M, D]`` (``M = Tq * G``), ``k, v [B, Hkv, keys, D]``.

    ``visible`` broadcasts to ``[B, Hkv, M, keys]`` (``None`` = all visible). Returns ``out [B, Hkv, M, D]``
    (zeros for a row that sees nothing) and ``lse [B, Hkv, M]`` (natural log, ``-inf`` there).
    """
    logits = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale)                           # [B, Hkv, M, keys]
    if visible is not None:
        logits = logits.masked_fill_(~visible, NEG_INF)
    p, m, denom = softmax_parts(logits)
    out = torch.matmul(p, v) / torch.where(denom > 0, denom, 1.0)
    lse = (m + torch.log(denom)).squeeze(-1)                                             # log(0) = -inf
    return out, lse


def finish_output(q, out4, lse, return_lse, out):
    """``[B, Tq, Hq, D]`` results back to ``q``'s form (``[B, Hq, D]`` for 3-D ``q``), into ``out`` if given."""
    o = out4.squeeze(1) if q.dim() == 3 else out4
    if out is not None:                   # the caller's tensor itself (written in place by the kernel)
        if o.data_ptr() != out.data_ptr():
            out.copy_(o)
        o = out
    if not return_lse:
        return o
    lse = lse.float()
    return o, (lse.squeeze(1) if q.dim() == 3 else lse)


def empty_attention(q4, k_cache, v_cache):
    """out = 0 and lse = -inf everywhere, still connected to q/k/v so that their gradients are zeros.

    Summing an empty slice of each input adds an exact 0 with a gradient path (a ``0 * x`` term would
    turn NaN padding into NaN).
    """
    link = q4.flatten()[:0].sum()
    for x in (k_cache, v_cache):
        if x.is_floating_point() and x.dtype not in QUANTIZED_DTYPES:     # int8 / fp8 pools have no gradient
            link = link + x.flatten()[:0].sum()
    out = torch.zeros_like(q4) + link.to(q4.dtype)
    lse = torch.full(q4.shape[:3], float("-inf"), dtype=torch.float32, device=q4.device)
    return out, lse
