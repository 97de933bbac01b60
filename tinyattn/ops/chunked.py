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
on a contiguous cache (docs/benchmarks.md). Only with torch on ``MAX_THREADS`` intra-op threads or fewer: each
chunk is ~10 ops, each an OpenMP region, and with more threads on a shared machine every region waits for a busy
core (:func:`chunk_keys`).
"""

from __future__ import annotations

import torch

from . import core

__all__ = ["chunk_keys", "attend_chunked", "CHUNK_BYTES", "MIN_BYTES", "MAX_THREADS"]

CHUNK_BYTES = 2 * 2**20     # bytes of K per chunk, all (row, KV head) pairs together (V: as many again)
MIN_BYTES = 16 * 2**20      # a gather of K below this runs in one piece: it fits the cache well enough
# chunks only while torch runs this many intra-op threads or fewer: a chunked step is ~10 ops per chunk, each an
# OpenMP region, and on a shared machine every region waits for a busy core (docs/benchmarks.md, issue 10: 32K
# dense, 2 threads, a loaded 2-core VM: 3.7-7.6 s chunked vs 0.16-0.37 s in one piece; 1 thread: 0.47 vs 0.43 s)
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
