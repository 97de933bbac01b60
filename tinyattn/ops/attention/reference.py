"""Loop references of paged attention: masking (ragged tails, bottom-right causal, sliding window), softmax with
its lse, dense and over selected pages.

Simple loops per (row, KV head, query), written for clarity, not speed: the oracle of
:mod:`tinyattn.ops.attention.torch_impl` and of the Triton kernels (``kernels/attention.py``,
``kernels/attention_bwd.py``). They follow DESIGN.md §1-3 literally and share no code with the fast paths beyond
argument validation and the KV format's code / scale product. Same signatures as the public functions; ``q`` of
dtype float64 is computed in float64 (for gradcheck), everything else in float32.
"""

from __future__ import annotations

import torch

from .. import quant
from .. import validation as V
from ..selection import reference as selection

__all__ = ["paged_attention", "sparse_paged_attention", "window_start"]


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def window_start(q_pos: int, window_left: int) -> int:
    """The first key position a query at ``q_pos`` sees: ``q_pos - window_left`` with a sliding window
    (FlashInfer's ``window_left``: keys ``[p - window_left, p]``), ``0`` without one (``window_left = -1``)."""
    return q_pos - window_left if window_left >= 0 else 0


def _row_keys(cache, block_table, b: int, pages: list[int], page_size: int, h: int, n_tokens: int):
    """Keys (or values) of logical ``pages`` of row ``b``, KV head ``h``, and their token positions."""
    chunks, positions = [], []
    for j in pages:
        valid = min(page_size, n_tokens - j * page_size)
        phys = int(block_table[b, j])
        chunks.append(cache[phys, :valid, h])
        positions.append(torch.arange(j * page_size, j * page_size + valid))
    if not chunks:
        return cache.new_zeros(0, cache.shape[-1]), torch.zeros(0, dtype=torch.long)
    return torch.cat(chunks), torch.cat(positions)


def _attend(q, k_cache, v_cache, block_table, seq_lens, pages_of, scale, return_lse, window_left=-1):
    """Attention of q [B, Tq, Hq, D] over the pages ``pages_of(b, h)`` of each row and KV head; with
    ``window_left >= 0`` a query at position p sees only keys at positions in ``[p - window_left, p]``."""
    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    B, Tq, Hq, D = q4.shape
    page_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    dt = _math_dtype(q)
    out = torch.zeros(B, Tq, Hq, D, dtype=dt)
    lse = torch.full((B, Tq, Hq), float("-inf"), dtype=dt)
    for b in range(B):
        n_tokens = int(seq_lens[b])
        for h in range(Hkv):
            k, pos = _row_keys(k_cache, block_table, b, pages_of(b, h), page_size, h, n_tokens)
            v, _ = _row_keys(v_cache, block_table, b, pages_of(b, h), page_size, h, n_tokens)
            k, v = k.to(dt).cpu(), v.to(dt).cpu()
            for t in range(Tq):
                q_pos = n_tokens - Tq + t                      # bottom-right causal alignment
                visible = (pos <= q_pos) & (pos >= window_start(q_pos, window_left))
                if not bool(visible.any()):
                    continue                                    # no key: zeros and lse = -inf
                for g in range(G):
                    hq = h * G + g
                    logits = scale * (k[visible] @ q4[b, t, hq].to(dt).cpu())
                    lse[b, t, hq] = torch.logsumexp(logits, 0)
                    out[b, t, hq] = torch.softmax(logits, 0) @ v[visible]
    out = out.to(q.dtype).to(q.device)
    out = out.squeeze(1) if q.dim() == 3 else out
    if not return_lse:
        return out
    lse = lse.float().to(q.device)
    return out, (lse.squeeze(1) if q.dim() == 3 else lse)


def _dequantized(q, k_cache, v_cache, k_scale, v_scale):
    """int8 / fp8 pools -> their values ``q_value * scale`` in the math dtype (others unchanged)."""
    if k_scale is None:
        return k_cache, v_cache
    dt = _math_dtype(q)
    return quant.dequantize(k_cache, k_scale, dt), quant.dequantize(v_cache, v_scale, dt)


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, *, scale=None, return_lse=False, backend=None,
                    k_scale=None, v_scale=None, window_left=-1):
    """Dense paged attention over every valid page (within the window). See :func:`tinyattn.paged_attention`.

    Quantized pools (with ``k_scale`` / ``v_scale``) are dequantized first, then attended as float pools."""
    q4, shapes = V.check_paged_inputs(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale)
    scale = V.check_scale(scale, shapes.head_dim)
    window_left = V.check_window_left(window_left)
    k_cache, v_cache = _dequantized(q, k_cache, v_cache, k_scale, v_scale)

    def all_pages(b, h):
        return list(range(_cdiv(int(seq_lens[b]), shapes.page_size)))

    return _attend(q, k_cache, v_cache, block_table, seq_lens, all_pages, scale, return_lse, window_left)


def sparse_paged_attention(q, k_cache, v_cache, block_table, seq_lens, *, page_indices=None, k_min=None,
                           k_max=None, page_budget=None, num_sink_pages=0, num_recent_pages=1, scale=None,
                           return_lse=False, backend=None, k_scale=None, v_scale=None, window_left=-1, gamma=1.0,
                           top_p=None):
    """Attention over the selected logical pages only. See :func:`tinyattn.sparse_paged_attention`.

    Duplicated page ids in ``page_indices`` raise ``ValueError`` here (the fast paths ignore them). Quantized
    pools (with ``k_scale`` / ``v_scale``) are dequantized first. With ``window_left >= 0`` the attention is
    masked to the window, and a selection by boxes scores every page wholly before the earliest query's window
    ``-inf`` (no sink pages allowed).
    """
    q4, shapes = V.check_paged_inputs(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale)
    scale = V.check_scale(scale, shapes.head_dim)
    V.check_sparse_selection(shapes, q, k_cache, seq_lens, page_indices, k_min, k_max, page_budget, num_sink_pages,
                             num_recent_pages)
    window_left = V.check_window_left(window_left)
    V.check_gamma(gamma)
    top_p = V.check_top_p(top_p)
    k_cache, v_cache = _dequantized(q, k_cache, v_cache, k_scale, v_scale)
    if page_indices is None:
        V.check_window_selection(window_left, num_sink_pages)
        if shapes.num_query_tokens == 0:                          # no query attends: nothing to select (as the ops)
            page_indices = torch.empty((block_table.shape[0], k_cache.shape[2], 0), dtype=torch.int32)
        else:
            scores = selection.page_scores(q, k_min, k_max, block_table, seq_lens, page_size=shapes.page_size,
                                           gamma=gamma)
            selection.mask_pages_before_window(scores, seq_lens, page_size=shapes.page_size,
                                               num_query_tokens=shapes.num_query_tokens, window_left=window_left)
            page_indices = selection.select_pages(
                scores, seq_lens, page_size=shapes.page_size, page_budget=page_budget, num_sink_pages=num_sink_pages,
                num_recent_pages=num_recent_pages, num_query_tokens=shapes.num_query_tokens, top_p=top_p,
                scale=scale if top_p is not None else None)

    def selected(b, h):
        n = _cdiv(int(seq_lens[b]), shapes.page_size)
        ids = [int(j) for j in page_indices[b, h] if 0 <= int(j) < n]
        if len(set(ids)) != len(ids):
            raise ValueError(f"page_indices: expected distinct page ids per (row, kv head), got duplicates at "
                             f"[{b}, {h}]")
        return sorted(ids)

    return _attend(q, k_cache, v_cache, block_table, seq_lens, selected, scale, return_lse, window_left)
