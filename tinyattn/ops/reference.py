"""Pure-PyTorch twins of the public ops: simple loops, fp32 math, written for clarity, not speed.

Every kernel and the vectorised torch backend are tested against these functions. They follow
DESIGN.md §1-3 literally (per row, per KV head), so they share no code with the fast paths beyond
argument validation. Same signatures as the public functions; ``q`` of dtype float64 is computed in
float64 (for gradcheck), everything else in float32.

Method: Quest (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference", ICML 2024, §3.2) and TinyServe (Liu & Yu, arXiv 2509.12211, eq. 2).
"""

from __future__ import annotations

import math

import torch

from . import quant
from . import validation as V

__all__ = ["paged_attention", "update_page_metadata", "page_scores", "select_pages", "sparse_paged_attention",
           "write_kv"]


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
                visible = pos <= q_pos
                if window_left >= 0:                           # sliding window (FlashInfer's window_left)
                    visible = visible & (pos >= q_pos - window_left)
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


def update_page_metadata(k_cache, block_table, seq_lens, k_min, k_max, *, backend=None, k_scale=None):
    """Recompute per-page, per-KV-head min/max of the keys over valid slots only (in place); an int8 / fp8 pool
    with ``k_scale`` is dequantized first."""
    _, page_size, _, _ = V.check_metadata_inputs(k_cache, block_table, seq_lens, k_min, k_max, k_scale)
    if k_scale is not None:
        k_cache = quant.dequantize(k_cache, k_scale)
    for b in range(block_table.shape[0]):
        n_tokens = int(seq_lens[b])
        for j in range(_cdiv(n_tokens, page_size)):
            phys = int(block_table[b, j])
            keys = k_cache[phys, : min(page_size, n_tokens - j * page_size)]     # [valid, Hkv, D]
            k_min[phys] = _outward(keys.amin(0), k_min.dtype, -1)
            k_max[phys] = _outward(keys.amax(0), k_max.dtype, +1)


def _outward(x, dtype, direction: int):
    """``x`` in ``dtype`` rounded toward ``direction * inf``, one value at a time (the loop twin of
    :mod:`tinyattn.ops.boxes`): the representable neighbour on the right side when rounding moved it across."""
    out = x.to(dtype).clone()
    flat, src = out.view(-1), x.reshape(-1).double()
    toward = torch.tensor(direction * float("inf"), dtype=dtype)
    for i in range(flat.numel()):
        if (flat[i].double() - src[i]) * direction < 0:                # rounded to the wrong side
            flat[i] = torch.nextafter(flat[i], toward)
    return out


def page_scores(q, k_min, k_max, block_table, seq_lens, *, page_size, backend=None):
    """Upper bound ub(q, j) = sum_i max(q_i k_min_i, q_i k_max_i), max over the GQA group and Tq queries.

    Returns fp32 ``[B, Hkv, max_pages_per_seq]``, ``-inf`` for pages past each row's end.
    """
    q4, page_size = V.check_scoring_inputs(q, k_min, k_max, block_table, seq_lens, page_size)
    B, Tq, Hq, D = q4.shape
    Hkv = k_min.shape[1]
    G = Hq // Hkv
    dt = _math_dtype(q)
    scores = torch.full((B, Hkv, block_table.shape[1]), float("-inf"), dtype=torch.float32)
    for b in range(B):
        for j in range(_cdiv(int(seq_lens[b]), page_size)):
            phys = int(block_table[b, j])
            for h in range(Hkv):
                qg = q4[b, :, h * G:(h + 1) * G].to(dt).cpu().reshape(-1, D)            # [Tq*G, D]
                lo, hi = k_min[phys, h].to(dt).cpu(), k_max[phys, h].to(dt).cpu()      # [D]
                ub = torch.maximum(qg * lo, qg * hi).sum(-1)                          # [Tq*G]
                scores[b, h, j] = ub.max().float()
    return scores.to(q.device)


def _forced_pages(n: int, first_query_page: int, num_sink_pages: int, num_recent_pages: int) -> list[int]:
    """Pages kept before any score is read, in priority order: recent (newest first), then sinks."""
    recent = max(num_recent_pages, 1, n - first_query_page)
    order = list(range(n - 1, max(n - recent, 0) - 1, -1))
    order += [j for j in range(min(num_sink_pages, n)) if j not in order]
    return order


def select_pages(scores, seq_lens, *, page_size, page_budget, num_sink_pages=0, num_recent_pages=1,
                 num_query_tokens=1, backend=None):
    """Top-``page_budget`` logical pages per (row, KV head): forced recent and sink pages, then best scores.

    Returns int32 ``[B, Hkv, page_budget]``, ascending, ``-1`` padded. NaN scores count as ``-inf``; ties
    (``-inf`` vs ``-inf`` and NaN vs ``-inf`` included) go to the lower page index.
    """
    opts = V.check_select_inputs(scores, seq_lens, page_size, page_budget, num_sink_pages, num_recent_pages,
                                 num_query_tokens)
    page_size, page_budget, num_query_tokens = opts["page_size"], opts["page_budget"], opts["num_query_tokens"]
    num_sink_pages, num_recent_pages = opts["num_sink_pages"], opts["num_recent_pages"]
    B, Hkv, _ = scores.shape
    out = torch.full((B, Hkv, page_budget), -1, dtype=torch.int32)
    for b in range(B):
        n_tokens = int(seq_lens[b])
        n = _cdiv(n_tokens, page_size)
        first_query_page = max(n_tokens - num_query_tokens, 0) // page_size
        for h in range(Hkv):
            if n <= page_budget:
                keep = list(range(n))
            else:
                keep = _forced_pages(n, first_query_page, num_sink_pages, num_recent_pages)[:page_budget]
                row = scores[b, h, :n].float().cpu()
                row = torch.where(torch.isnan(row), float("-inf"), row)    # NaN counts as -inf (a tie with it)
                ranked = sorted(range(n), key=lambda j: (-row[j].item(), j))
                keep += [j for j in ranked if j not in keep][: page_budget - len(keep)]
            keep = sorted(keep)
            out[b, h, : len(keep)] = torch.tensor(keep, dtype=torch.int32)
    return out.to(scores.device)


def sparse_paged_attention(q, k_cache, v_cache, block_table, seq_lens, *, page_indices=None, k_min=None,
                           k_max=None, page_budget=None, num_sink_pages=0, num_recent_pages=1, scale=None,
                           return_lse=False, backend=None, k_scale=None, v_scale=None, window_left=-1):
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
    k_cache, v_cache = _dequantized(q, k_cache, v_cache, k_scale, v_scale)
    if page_indices is None:
        V.check_window_selection(window_left, num_sink_pages)
        scores = page_scores(q, k_min, k_max, block_table, seq_lens, page_size=shapes.page_size)
        if window_left >= 0:                # pages wholly before the earliest query's window: -inf
            for b in range(scores.shape[0]):
                first_key = int(seq_lens[b]) - shapes.num_query_tokens - window_left
                for j in range(scores.shape[2]):
                    if (j + 1) * shapes.page_size - 1 < first_key:
                        scores[b, :, j] = float("-inf")
        page_indices = select_pages(scores, seq_lens, page_size=shapes.page_size, page_budget=page_budget,
                                    num_sink_pages=num_sink_pages, num_recent_pages=num_recent_pages,
                                    num_query_tokens=shapes.num_query_tokens)

    def selected(b, h):
        n = _cdiv(int(seq_lens[b]), shapes.page_size)
        ids = [int(j) for j in page_indices[b, h] if 0 <= int(j) < n]
        if len(set(ids)) != len(ids):
            raise ValueError(f"page_indices: expected distinct page ids per (row, kv head), got duplicates at [{b}, {h}]")
        return sorted(ids)

    return _attend(q, k_cache, v_cache, block_table, seq_lens, selected, scale, return_lse, window_left)


def write_kv(k, v, slots, k_cache, v_cache, *, k_min=None, k_max=None, k_scale=None, v_scale=None, fill=None,
             pages=None, backend=None):
    """Store ``k``, ``v`` ``[N, Hkv, D]`` at ``slots`` and grow boxes / scales, one (page, KV head) at a time.
    See :func:`tinyattn.ops.kv_write.write_kv` (the policy is spelled out there); CPU tensors, in place."""
    page_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    quantized = quant.is_quantized(k_cache)
    order = []                                                 # touched pages, in order of first appearance
    for t in range(slots.shape[0]):
        if int(slots[t]) // page_size not in order:
            order.append(int(slots[t]) // page_size)
    for p in order:
        tokens = [t for t in range(slots.shape[0]) if int(slots[t]) // page_size == p]
        offsets = [int(slots[t]) % page_size for t in tokens]
        if not quantized:
            for h in range(Hkv):
                for t, s in zip(tokens, offsets):
                    k_cache[p, s, h] = k[t, h].to(k_cache.dtype)
                    v_cache[p, s, h] = v[t, h].to(v_cache.dtype)
                if k_min is not None:
                    keys = torch.stack([k_cache[p, s, h] for s in offsets]).double()     # [n, D] the stored keys
                    lo = torch.minimum(k_min[p, h].double(), _outward(keys.amin(0), k_min.dtype, -1).double())
                    hi = torch.maximum(k_max[p, h].double(), _outward(keys.amax(0), k_max.dtype, +1).double())
                    k_min[p, h], k_max[p, h] = lo.to(k_min.dtype), hi.to(k_max.dtype)
            continue
        m = quant.qmax(k_cache.dtype)
        new_fill = max(int(fill[p]), max(offsets) + 1)
        fill[p] = new_fill
        for h in range(Hkv):
            grew_k = False
            for pool, scales, x, is_k in ((k_cache, k_scale, k, True), (v_cache, v_scale, v, False)):
                rows = [x[t, h].float() for t in tokens]                          # [D] fp32 each
                amax = torch.stack([r.abs().max() for r in rows]).max()
                old = scales[p, h].clone()                                        # fp32 0-d
                new = torch.maximum(old, amax / m)
                if k_cache.dtype == torch.float8_e4m3fn and old > 0 and new > old:
                    mant, exp = math.frexp(float(new / old))                      # exact: ceil(log2(new / old))
                    new = old * 2.0 ** (exp - 1 if mant == 0.5 else exp)
                grew = bool(new > old)
                if grew:
                    for s in range(new_fill):                                     # the valid slots only
                        pool[p, s, h] = quant.quantize(pool[p, s, h].float() * (old / new), 1.0, pool.dtype)
                for r, s in zip(rows, offsets):
                    pool[p, s, h] = quant.quantize(r, new, pool.dtype)
                scales[p, h] = new
                grew_k = grew if is_k else grew_k
            if k_min is None:
                continue
            slots_read = range(new_fill) if grew_k else offsets                   # a grown K scale: refit
            keys = torch.stack([k_cache[p, s, h].float() * k_scale[p, h] for s in slots_read]).double()
            lo, hi = _outward(keys.amin(0), k_min.dtype, -1), _outward(keys.amax(0), k_max.dtype, +1)
            if not grew_k:
                lo = torch.minimum(k_min[p, h].double(), lo.double()).to(k_min.dtype)
                hi = torch.maximum(k_max[p, h].double(), hi.double()).to(k_max.dtype)
            k_min[p, h], k_max[p, h] = lo, hi
