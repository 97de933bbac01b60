"""Attention over a large gather in cache-sized chunks of keys: split-K decoding on the CPU.

The torch backend gathers the keys a step reads (every valid key, or the selected pages) into a workspace and
runs attention over it. For a large step that workspace is bigger than the last-level cache: it is written to
memory and read back, three passes over the bytes where attention needs one. Gathered in chunks of about
2 MiB of keys, every chunk's K and V are still in cache when they are used; each chunk yields its partial
output and log-sum-exp, and the chunks are merged exactly (the merge of FlashDecoding, Dao et al. 2023, and of
tinyattn's split-K Triton kernel):

    m = max_c m_c,   denom = Σ_c denom_c · exp(m_c - m),   out = Σ_c out_c · exp(m_c - m) / denom,
    lse = m + log(denom)

where ``out_c`` is the unnormalised ``Σ exp(logit - m_c) v`` of chunk ``c``. Measured on the 2-core VM, 1
thread, B=8, 4096 keys, 8 KV heads of 128: 119 ms in one piece, 50-55 ms in chunks, against 39-44 ms for SDPA
on a contiguous cache (docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from . import core

__all__ = ["chunk_keys", "chunk_pages", "attend_chunked", "attend_pages", "CHUNK_BYTES", "PAGE_CHUNK_BYTES",
           "MIN_BYTES"]

CHUNK_BYTES = 2 * 2**20     # bytes of K per chunk, all (row, KV head) pairs together (V: as many again)
PAGE_CHUNK_BYTES = 512 * 2**10   # bytes of K per chunk of whole pages (attend_pages; best of 256 K - 2 MiB)
MIN_BYTES = 16 * 2**20      # a gather of K below this runs in one piece: it fits the cache well enough


def chunk_keys(n_keys: int, n_pairs: int, head_dim: int, itemsize: int = 4) -> int | None:
    """Keys per chunk for a gather of ``n_keys`` keys for each of ``n_pairs`` (row, KV head) pairs, or ``None``
    when the whole gather is small enough to run in one piece. A multiple of 16 (whole pages of 16)."""
    per_key = n_pairs * head_dim * itemsize
    if n_keys * per_key < MIN_BYTES:
        return None
    return max(16, CHUNK_BYTES // per_key // 16 * 16)


def chunk_pages(batch: int, page_bytes: int) -> int:
    """Pages per row in each chunk of :func:`attend_pages`: about ``PAGE_CHUNK_BYTES`` of K for the ``batch`` rows
    together (``page_bytes`` = one page of K, all KV heads), at least one page."""
    return max(1, PAGE_CHUNK_BYTES // max(batch * page_bytes, 1))


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
    out, lse = _merge(maxes, denoms, outs)
    return out.view(B, Hkv, M, D), lse.view(B, Hkv, M)


def attend_pages(qg: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
                 bias: torch.Tensor | None, hidden: torch.Tensor | None, hidden_pages, scale: float, chunk: int,
                 workspace) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense masked attention of ``qg`` over whole pages of the pool, ``chunk`` pages of every row at a time.

    The pool ``[num_pages, S, Hkv, D]`` keeps one page of all KV heads contiguous (``S * Hkv * D`` elements):
    gathering whole pages is a stream of large contiguous copies, where gathering each head's keys reads one
    ``D``-row per ``Hkv * D`` (``tinyattn.ops.core``'s rows: measured 1.4x slower over a whole 32K step). Each
    chunk (about ``PAGE_CHUNK_BYTES``, cache-resident) is then read per KV head through strided views; chunks
    are merged as in :func:`attend_chunked`.

    Args:
        qg: ``[B, Hkv, M, D]`` grouped queries, the dtype of the pool (fp32 / fp64).
        k_cache, v_cache: ``[num_pages, S, Hkv, D]`` the pool.
        pages: ``[B, P]`` int64 physical page of each logical page (an in-range id for pages past the row's end:
            their slots are ``hidden``).
        bias: additive mask broadcasting to ``[B, Hkv, M, P * S]`` (``0`` visible, ``-inf`` hidden) or ``None``.
        hidden: ``[B, P * S]`` bool, slots past each row's length (their pool content may be NaN: zeroed in
            the workspace, so a hidden slot's 0 weight never meets a NaN), or ``None`` when every slot is valid.
        hidden_pages: ``[P]`` host bools, the page columns where some row hides a slot (only those chunks pay
            the zeroing pass).
        scale: softmax scale. chunk: pages per row per chunk (:func:`chunk_pages`).
        workspace: ``workspace(name, shape) -> tensor`` of the pool's dtype, reused across chunks and calls.

    Returns:
        ``out [B, Hkv, M, D]`` (zeros for a query that sees no key) and ``lse [B, Hkv, M]`` (``-inf`` there).
    """
    B, Hkv, M, D = qg.shape
    P, S = pages.shape[1], k_cache.shape[1]
    n = -(-P // chunk)
    qs = qg * scale                                                                   # [B, Hkv, M, D]
    maxes, denoms, outs = qg.new_empty(n, B, Hkv, M, 1), qg.new_empty(n, B, Hkv, M, 1), qg.new_empty(n, B, Hkv, M, D)
    k_flat, v_flat = k_cache.view(k_cache.shape[0], -1), v_cache.view(v_cache.shape[0], -1)
    for i in range(n):
        j0, j1 = i * chunk, min((i + 1) * chunk, P)
        c = (j1 - j0) * S
        idx = pages[:, j0:j1].reshape(-1)
        k = torch.index_select(k_flat, 0, idx, out=workspace("pages_k", (idx.shape[0], k_flat.shape[1])))
        v = torch.index_select(v_flat, 0, idx, out=workspace("pages_v", (idx.shape[0], v_flat.shape[1])))
        k, v = k.view(B, c, Hkv, D), v.view(B, c, Hkv, D)
        if hidden is not None and hidden_pages[j0:j1].any():                          # NaN-safe: 0 in hidden slots
            mask = hidden[:, j0 * S:j1 * S, None, None]                               # [B, c, 1, 1]
            k.masked_fill_(mask, 0)
            v.masked_fill_(mask, 0)
        logits = qg.new_empty(B, Hkv, M, c)
        for b in range(B):                    # per row: a [Hkv, c, D] strided view is one bmm, no copy
            torch.bmm(qs[b], k[b].permute(1, 2, 0), out=logits[b])
        if bias is not None:
            logits.add_(bias[..., j0 * S:j1 * S])
        m = torch.amax(logits, -1, keepdim=True, out=maxes[i])                        # -inf: nothing visible
        p = logits.sub_(torch.where(torch.isfinite(m), m, 0.0)).exp_()
        torch.sum(p, -1, keepdim=True, out=denoms[i])
        for b in range(B):
            torch.bmm(p[b], v[b].transpose(0, 1), out=outs[i, b])
    return _merge(maxes, denoms, outs)


def _merge(maxes: torch.Tensor, denoms: torch.Tensor, outs: torch.Tensor):
    """The exact merge of chunk partials ``[n, ..., 1]``, ``[n, ..., 1]``, ``[n, ..., D]`` (module docstring):
    ``(out [..., D], lse [...])``; a query no chunk shows a key to gets 0 and ``-inf``."""
    m = maxes.amax(0)
    m = torch.where(torch.isfinite(m), m, 0.0)                                        # [R, M, 1]
    w = torch.exp(maxes - m)                                                          # a hidden chunk: 0
    denom = (denoms * w).sum(0)
    out = (outs * w).sum(0) / torch.where(denom > 0, denom, 1.0)
    lse = m + torch.log(denom)                                                        # log(0) = -inf
    return out, lse.squeeze(-1)
