"""The torch form of attention (DESIGN.md §1-2; docs/layout.md): which pool rows a row's keys live in and which
queries see them (ragged tails, bottom-right causal, sliding windows), NaN-safe masked softmax with its lse, SDPA
where no lse is needed, and split-K over cache-sized chunks merged by lse.

Every torch-side attention of the package is built from these functions: the torch backend's per-step plan
(:mod:`tinyattn.ops.plan_torch`, whose row and mask tables are :func:`page_rows` of every page), its autograd
route and the selection metrics (:func:`tinyattn.selection.page_attention_mass`). The other copies are the loops of
:mod:`.reference` (the tests' oracle) and the Triton kernels (:mod:`.triton_impl`).

Layout (docs/layout.md): the pool ``k_cache`` ``[num_pages, page_size, Hkv, D]`` is read as a flat
``[num_pages * page_size * Hkv, D]`` matrix whose row ``(page * page_size + slot) * Hkv + head`` holds one
key. A gather of such rows is one ``index_select``.

**Filler rows.** A slot that must not count (past ``seq_lens``, a ``-1`` page, padding of a batch) is
pointed at a *valid* key of the same (row, KV head) - its first token - and hidden by the mask. The
unused slots of the pool may hold anything (NaN, inf, garbage): they are never read, so no zeroing pass is
needed and a ``0 * NaN`` can never reach the output. A row with no valid token borrows the first key of the
first non-empty row and is fully masked (its output is 0 and its lse ``-inf``, see :func:`softmax_parts`).

**Split-K on the CPU** (:func:`attend_chunked`). A gather larger than the last-level cache is written to memory
and read back: three passes over the bytes where attention needs one. Gathered in chunks of about 2 MiB of keys,
every chunk's K and V are still in cache when they are used; each chunk yields its partial output and lse, merged
exactly (FlashDecoding, Dao et al. 2023; the merge of the Triton kernel)::

    m = max_c m_c,   denom = Σ_c denom_c · exp(m_c - m),   out = Σ_c out_c · exp(m_c - m) / denom,
    lse = m + log(denom)

where ``out_c`` is the unnormalised ``Σ exp(logit - m_c) v`` of chunk ``c`` (measurements: docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from ..layout import NEG_INF, num_valid_pages
from ..quant import QUANTIZED_DTYPES

__all__ = ["dense_page_indices", "page_rows", "window_start", "first_window_key", "softmax_parts", "attend_rows",
           "attend_rows_backward", "finish_output", "empty_attention", "chunk_keys", "attend_chunked", "CHUNK_BYTES",
           "MIN_BYTES", "MAX_THREADS"]

def dense_page_indices(seq_lens: torch.Tensor, num_kv_heads: int, max_pages: int, page_size: int) -> torch.Tensor:
    """Every valid page of each row, as int32 ``[B, Hkv, max_pages]`` with ``-1`` past the end."""
    j = torch.arange(max_pages, device=seq_lens.device)
    idx = torch.where(j[None, :] < num_valid_pages(seq_lens, page_size)[:, None], j, -1)
    return idx[:, None, :].expand(-1, num_kv_heads, -1).to(torch.int32)


def page_rows(block_table: torch.Tensor, seq_lens: torch.Tensor, pages: torch.Tensor | None, *, page_size: int,
              num_kv_heads: int, num_query_tokens: int = 1, window_left: int = -1,
              num_pages: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat pool rows, key positions and visibility of the slots of logical ``pages``.

    Args:
        block_table: ``[B, max_pages_per_seq]`` int. seq_lens: ``[B]`` int (including the ``Tq`` queries).
        pages: ``[B, Hkv, K]`` logical page ids; ``-1`` and ids past the row's end are hidden. ``None``: the pages
            ``0 .. num_pages - 1`` of every row and head (``num_pages <= max_pages_per_seq``), the table a per-step
            plan keeps; the same values as the explicit ``arange``, in about half the ops (the results' KV-head
            dimension is then an expanded view).
        page_size, num_kv_heads: tokens per page and ``Hkv``. num_query_tokens: ``Tq``, for the causal mask.
        window_left: keys a query sees before its own position (FlashInfer's convention), ``-1`` = no limit.

    Returns:
        ``rows`` int64 ``[B, Hkv, K, page_size]`` into the flat pool (a filler row where hidden, see the module
        docstring), ``pos`` int64 ``[B, Hkv, K, page_size]`` the key positions, and ``visible`` bool
        ``[B, Hkv, Tq, K, page_size]``: query ``t`` (at position ``p = seq_len - Tq + t``) sees the key (bottom-right
        causal, DESIGN.md §2), and with a window only keys at positions ``>= p - window_left``.
    """
    if pages is None:
        if num_pages and block_table.shape[1] >= num_pages:
            return _every_page_rows(block_table, seq_lens, num_pages, page_size, num_kv_heads, num_query_tokens,
                                    window_left)
        pages = torch.arange(num_pages, device=block_table.device).expand(block_table.shape[0], num_kv_heads,
                                                                          num_pages)
    B, Hkv, K = pages.shape
    device = pages.device
    lens = seq_lens.to(device=device, dtype=torch.int64)
    table = block_table.to(device=device, dtype=torch.int64)
    sel = pages.to(torch.int64)
    ok = (sel >= 0) & (sel < num_valid_pages(lens, page_size)[:, None, None])                  # [B, Hkv, K]
    width = max(table.shape[1], 1)
    phys = torch.gather(table, 1, sel.clamp(0, width - 1).reshape(B, -1)).reshape(B, Hkv, K) if table.numel() \
        else torch.zeros_like(sel)
    slots = torch.arange(page_size, device=device)
    pos = sel[..., None] * page_size + slots                                           # [B, Hkv, K, page_size]
    key_ok = ok[..., None] & (pos < lens[:, None, None, None])
    heads = torch.arange(Hkv, device=device)[None, :, None, None]
    rows = (phys[..., None] * page_size + slots) * Hkv + heads                        # [B, Hkv, K, page_size]
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
    first = torch.where(has, lead_phys, 0) * (page_size * Hkv) + heads[:, :, 0, 0]              # [B, Hkv]
    # the donor by index_select, not a 0-dim index (which Python would read on the host)
    donor = first.flatten().index_select(0, has.flatten().to(torch.int8).argmax().view(1)) if first.numel() \
        else first.new_zeros(1)
    filler = torch.where(has, first, donor)[:, :, None, None]                          # [B, Hkv, 1, 1]
    rows = torch.where(key_ok, rows, filler)
    q_pos = lens[:, None] - num_query_tokens + torch.arange(num_query_tokens, device=device)  # [B, Tq]
    visible = key_ok[:, :, None] & (pos[:, :, None] <= q_pos[:, None, :, None, None])   # [B, Hkv, Tq, K, page_size]
    if window_left >= 0:
        visible &= pos[:, :, None] >= window_start(q_pos, window_left)[:, None, :, None, None]
    return rows, pos, visible


def _every_page_rows(block_table, seq_lens, num_pages: int, page_size: int, num_kv_heads: int,
                     num_query_tokens: int, window_left: int):
    """:func:`page_rows` of the pages ``0 .. num_pages - 1`` of every row (``1 <= num_pages <= max_pages_per_seq``).

    The same rule with what every page listed makes known: a key is valid when its position is below the row's
    length (its page is then valid too), the first valid page of a row with keys is its page 0, so the filler of a
    (row, head) is that page's first key; an empty row borrows head 0's filler of the first row with keys (pool
    row 0 when no row has one), as :func:`page_rows` does."""
    B, Hkv, Tq = block_table.shape[0], num_kv_heads, num_query_tokens
    device = block_table.device
    lens = seq_lens.to(device=device, dtype=torch.int64)
    table = block_table[:, :num_pages].to(torch.int64)                                    # [B, P]
    slots = torch.arange(page_size, device=device)
    pos = torch.arange(num_pages * page_size, device=device).view(1, 1, num_pages, page_size)
    key_ok = pos < lens[:, None, None, None]                                              # [B, 1, P, page_size]
    heads = torch.arange(Hkv, device=device)[None, :, None, None]
    rows = (table[:, None, :, None] * page_size + slots) * Hkv + heads                    # [B, Hkv, P, page_size]
    has = lens > 0                                                                        # [B]
    first = torch.where(has, table[:, 0], 0) * (page_size * Hkv)                          # [B]
    donor = first.index_select(0, has.to(torch.int8).argmax().view(1))                    # [1]
    filler = torch.where(has[:, None, None, None], first[:, None, None, None] + heads, donor)   # [B, Hkv, 1, 1]
    rows = torch.where(key_ok, rows, filler)
    if Tq == 1 and window_left < 0:                   # decode: every valid key is at or before the query
        visible = key_ok[:, :, None]
    else:
        q_pos = lens[:, None] - Tq + torch.arange(Tq, device=device)                     # [B, Tq]
        visible = key_ok[:, :, None] & (pos[:, :, None] <= q_pos[:, None, :, None, None])  # [B, 1, Tq, P, page_size]
        if window_left >= 0:
            visible &= pos[:, :, None] >= window_start(q_pos, window_left)[:, None, :, None, None]
    return (rows, pos.expand(B, Hkv, num_pages, page_size),
            visible.expand(B, Hkv, Tq, num_pages, page_size))


def window_start(q_pos, window_left: int):
    """The first key position a query at ``q_pos`` (an int or an int64 tensor) sees: ``q_pos - window_left`` with
    a sliding window (FlashInfer's ``window_left``: keys ``[p - window_left, p]``; may be negative), ``0``
    without one (``window_left = -1``)."""
    return q_pos - window_left if window_left >= 0 else q_pos * 0


def first_window_key(seq_lens: torch.Tensor, num_query_tokens: int, window_left: int) -> torch.Tensor:
    """``[B]`` int64: the first key position any query of the row sees (the earliest query's
    :func:`window_start`; may be negative), ``0`` without a window."""
    return window_start(seq_lens.to(torch.int64) - num_query_tokens, window_left)


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
    (zeros for a row that sees nothing) and ``lse [B, Hkv, M]`` (natural log, ``-inf`` there). Differentiable, with
    zero (never NaN) gradients for a row that sees nothing.
    """
    logits = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale)                           # [B, Hkv, M, keys]
    if visible is not None:
        logits = logits.masked_fill_(~visible, NEG_INF)
    p, m, denom = softmax_parts(logits)
    empty = denom == 0
    safe = torch.where(empty, 1.0, denom)         # log / divide by a safe value: no inf * 0 in the backward
    out = torch.matmul(p, v) / safe
    lse = (m + torch.log(safe)).masked_fill(empty, NEG_INF).squeeze(-1)
    return out, lse


def attend_rows_backward(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
                         scale: float, dout: torch.Tensor, dlse: torch.Tensor | None):
    """Gradients of :func:`attend_rows`: ``(dqg, dk, dv)`` shaped like ``qg``, ``k``, ``v``.

    The probabilities are recomputed (FlashAttention-2's backward, Dao 2023, Alg. 2): ``P = softmax(S)``,
    ``dV = Pᵀ dO``, ``dP = dO Vᵀ``, ``dS = P ⊙ (dP - rowsum(P ⊙ dP) + dlse)``, ``dQ = scale · dS K``,
    ``dK = scale · dSᵀ Q``. Hidden keys and rows that see nothing get exactly 0 (never NaN); ``dlse``
    ``[B, Hkv, M]`` may be ``None``.
    """
    logits = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale)                           # [B, Hkv, M, keys]
    if visible is not None:
        logits = logits.masked_fill_(~visible, NEG_INF)
    p, _, denom = softmax_parts(logits)
    p = p.div_(torch.where(denom == 0, 1.0, denom))                                      # 0 where hidden
    dv = torch.matmul(p.transpose(-1, -2), dout)
    dp = torch.matmul(dout, v.transpose(-1, -2))
    delta = (p * dp).sum(-1, keepdim=True)              # rowsum(dO ⊙ O), without rounding O to its dtype
    if dlse is not None:
        delta = delta - dlse[..., None]
    ds = p.mul_(dp.sub_(delta))
    return scale * torch.matmul(ds, k), scale * torch.matmul(ds.transpose(-1, -2), qg), dv


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


CHUNK_BYTES = 2 * 2**20     # bytes of K per chunk, all (row, KV head) pairs together (V: as many again)
MIN_BYTES = 16 * 2**20      # a gather of K below this runs in one piece: it fits the cache well enough
# chunks only while torch runs this many intra-op threads or fewer: a chunked step is ~10 ops per chunk, each an
# OpenMP region, and on a shared machine every region waits for a busy core (docs/benchmarks.md, "Chunked steps only
# on one thread": 32K dense, 2 threads, a loaded 2-core VM: 3.7-7.6 s chunked vs 0.16-0.37 s in one piece; 1 thread:
# 0.47 vs 0.43 s)
MAX_THREADS = 1


def chunk_keys(n_keys: int, n_pairs: int, head_dim: int, itemsize: int = 4) -> int | None:
    """Keys per chunk for a gather of ``n_keys`` keys for each of ``n_pairs`` (row, KV head) pairs, or ``None``
    when the step runs in one piece: a gather small enough for the cache, or torch running more than
    ``MAX_THREADS`` intra-op threads (the chunks' many small parallel regions then cost more than the cache
    misses they save). A multiple of 16 (whole pages of 16)."""
    per_key = n_pairs * head_dim * itemsize
    if n_keys * per_key < MIN_BYTES or torch.get_num_threads() > MAX_THREADS:
        return None
    return max(16, CHUNK_BYTES // per_key // 16 * 16)


def attend_chunked(qg: torch.Tensor, gather, rows: torch.Tensor, bias: torch.Tensor | None, scale: float,
                   chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention of ``qg`` over the pool rows ``rows``, ``chunk`` keys at a time.

    Args:
        qg: ``[B, Hkv, M, D]`` grouped queries in the math dtype (fp32 / fp64).
        gather: ``gather(flat_rows, n) -> (k, v)``, each ``[B, Hkv, n, D]`` in ``qg``'s dtype: the K and V pool
            rows ``flat_rows`` (``[B * Hkv * n]``, pair-major). It may reuse one workspace from chunk to chunk.
        rows: ``[B, Hkv, L]`` int64 pool rows of every key (hidden slots point at a valid key).
        bias: additive mask broadcasting to ``[B, Hkv, M, L]`` (``0`` visible, ``-inf`` hidden) or ``None``.
        scale: softmax scale. chunk: keys per chunk (:func:`chunk_keys`).

    Returns:
        ``out [B, Hkv, M, D]`` (zeros for a query that sees no key) and ``lse [B, Hkv, M]`` (``-inf`` there).
    """
    B, Hkv, M, D = qg.shape
    R, L = B * Hkv, rows.shape[-1]
    n = -(-L // chunk)
    qs = (qg * scale).reshape(R, M, D)                                                # scaled once
    maxes = qg.new_empty(n, R, M, 1)
    denoms = qg.new_empty(n, R, M, 1)
    outs = qg.new_empty(n, R, M, D)
    for i in range(n):
        c0, c1 = i * chunk, min((i + 1) * chunk, L)
        k, v = gather(rows[..., c0:c1].reshape(-1), c1 - c0)
        logits = torch.bmm(qs, k.view(R, c1 - c0, D).transpose(1, 2))               # [R, M, c], 3-D: no copy
        if bias is not None:                                                          # broadcast, no copy
            logits.view(B, Hkv, M, c1 - c0).add_(bias[..., c0:c1])
        m = torch.amax(logits, -1, keepdim=True, out=maxes[i])                        # -inf: nothing visible
        p = logits.sub_(torch.where(torch.isfinite(m), m, 0.0)).exp_()
        torch.sum(p, -1, keepdim=True, out=denoms[i])
        torch.bmm(p, v.view(R, c1 - c0, D), out=outs[i])
    m = maxes.amax(0)
    m = torch.where(torch.isfinite(m), m, 0.0)                                        # [R, M, 1]
    w = torch.exp(maxes - m)                                                          # a hidden chunk: 0
    denom = (denoms * w).sum(0)
    out = (outs * w).sum(0) / torch.where(denom > 0, denom, 1.0)
    lse = m + torch.log(denom)                                                        # log(0) = -inf
    return out.view(B, Hkv, M, D), lse.view(B, Hkv, M)
