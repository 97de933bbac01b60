"""Loop references of scoring and selection: the Quest bound of every page, the pages a query's window hides, and
the page selection (forced recent / sink pages, then the best bounds; NaN as ``-inf``; ties to the lower page).

Simple loops per (row, KV head, page), written for clarity, not speed: the oracle of
:mod:`tinyattn.ops.selection.torch_impl` and of the Triton kernels (``kernels/scoring.py``, ``kernels/topk.py``,
``kernels/chunk_topk.py``). They share no code with those beyond argument validation. ``q`` of dtype float64 is
scored in float64, everything else in float32.

Method: Quest (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024,
§3.2) and TinyServe (Liu & Yu, arXiv 2509.12211, eq. 2): ``ub(q, j) = Σ_i max(q_i·k_min[j,i], q_i·k_max[j,i])``;
with ``gamma < 1`` the box estimate ``q·c + gamma·|q|·r`` (issue 35); ``top_p``: Twilight's adaptive budget over the
estimated attention mass (Lin et al., arXiv 2502.02770), the masses in fp64.
"""

from __future__ import annotations

import math

import torch

from .. import quant
from .. import validation as V

__all__ = ["page_scores", "select_pages", "mask_pages_before_window", "rerank_scores"]


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def page_scores(q, k_min, k_max, block_table, seq_lens, *, page_size, gamma=1.0, backend=None):
    """Upper bound ub(q, j) = sum_i max(q_i k_min_i, q_i k_max_i), max over the GQA group and Tq queries; with
    ``gamma < 1`` the box estimate ``sum_i a_i k_max_i + b_i k_min_i``, ``a = (q + gamma|q|)/2``,
    ``b = (q - gamma|q|)/2`` (``= q·c + gamma·|q|·r``: box centre ``c``, half-width ``r``).

    Returns fp32 ``[B, Hkv, max_pages_per_seq]``, ``-inf`` for pages past each row's end.
    """
    q4, page_size = V.check_scoring_inputs(q, k_min, k_max, block_table, seq_lens, page_size, gamma)
    gamma = float(gamma)
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
                if gamma == 1.0:                                                     # Quest's bound
                    ub = torch.maximum(qg * lo, qg * hi).sum(-1)                      # [Tq*G]
                else:                                                                 # the box estimate
                    pos, neg = (qg + gamma * qg.abs()) / 2, (qg - gamma * qg.abs()) / 2     # a, b
                    ub = (pos * hi + neg * lo).sum(-1)                                # [Tq*G]
                if ub.numel():                       # no query (Tq = 0): the max over none stays -inf
                    scores[b, h, j] = ub.max().float()
    return scores.to(q.device)


def _forced_pages(n: int, first_query_page: int, num_sink_pages: int, num_recent_pages: int) -> list[int]:
    """Pages kept before any score is read, in priority order: recent (newest first), then sinks."""
    recent = max(num_recent_pages, 1, n - first_query_page)
    order = list(range(n - 1, max(n - recent, 0) - 1, -1))
    order += [j for j in range(min(num_sink_pages, n)) if j not in order]
    return order


def _masses(row: torch.Tensor, scale: float) -> list[float]:
    """``softmax(scale · row)`` of one row's valid pages in fp64, NaN as ``-inf`` and ``+inf`` as ``FLT_MAX``
    (computed as ``exp(scale · (s - s_max)) / Σ``); all zeros when every score is ``-inf``."""
    x = [float(v) for v in row.tolist()]
    flt_max = float(torch.finfo(torch.float32).max)
    x = [float("-inf") if v != v else min(v, flt_max) for v in x]
    top = max(x, default=float("-inf"))
    if top == float("-inf"):
        return [0.0] * len(x)
    e = [0.0 if v == float("-inf") else math.exp(scale * (v - top)) for v in x]
    total = sum(e)
    return [v / total for v in e]


def select_pages(scores, seq_lens, *, page_size, page_budget, num_sink_pages=0, num_recent_pages=1,
                 num_query_tokens=1, top_p=None, scale=None, backend=None):
    """Top-``page_budget`` logical pages per (row, KV head): forced recent and sink pages, then best scores; with
    ``top_p`` only the fewest best pages whose mass ``softmax(scale · scores)`` (over the row's valid pages), with
    the forced pages', reaches ``top_p`` (Twilight, arXiv 2502.02770), within ``page_budget``.

    Returns int32 ``[B, Hkv, page_budget]``, ascending, ``-1`` padded. NaN scores count as ``-inf``; ties
    (``-inf`` vs ``-inf`` and NaN vs ``-inf`` included) go to the lower page index.
    """
    opts = V.check_select_inputs(scores, seq_lens, page_size, page_budget, num_sink_pages, num_recent_pages,
                                 num_query_tokens, top_p, scale)
    page_size, page_budget, num_query_tokens = opts["page_size"], opts["page_budget"], opts["num_query_tokens"]
    num_sink_pages, num_recent_pages = opts["num_sink_pages"], opts["num_recent_pages"]
    top_p, scale = opts["top_p"], opts["scale"]
    B, Hkv, _ = scores.shape
    out = torch.full((B, Hkv, page_budget), -1, dtype=torch.int32)
    for b in range(B):
        n_tokens = int(seq_lens[b])
        n = _cdiv(n_tokens, page_size)
        first_query_page = max(n_tokens - num_query_tokens, 0) // page_size
        for h in range(Hkv):
            if top_p is not None:
                keep = _top_p_pages(scores[b, h, :n].float().cpu(), n, first_query_page, page_budget, num_sink_pages,
                                    num_recent_pages, top_p, scale)
            elif n <= page_budget:
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



def _top_p_pages(row, n, first_query_page, page_budget, num_sink_pages, num_recent_pages, top_p, scale) -> list:
    """The top-p rule on one (row, KV head): the forced pages (within the budget) and their mass first, then the
    scored pages in rank order while the mass kept so far is below ``top_p`` and the budget has room."""
    keep = _forced_pages(n, first_query_page, num_sink_pages, num_recent_pages)[:page_budget]
    mass = _masses(row, scale)
    kept = sum(mass[j] for j in keep)
    clean = torch.where(torch.isnan(row), float("-inf"), row)
    ranked = sorted((j for j in range(n) if j not in keep), key=lambda j: (-clean[j].item(), j))
    for j in ranked:
        if len(keep) >= page_budget or (kept >= top_p and top_p < 1.0):
            break
        keep.append(j)
        kept += mass[j]
    return keep


def mask_pages_before_window(scores, seq_lens, *, page_size: int, num_query_tokens: int, window_left: int):
    """``scores`` ``[B, Hkv, P]`` with ``-inf`` (in place) for every page wholly before the window of the row's
    earliest query: its last key ``(j + 1) * page_size - 1`` precedes ``seq_len - Tq - window_left``. No-op for
    ``window_left = -1``."""
    if window_left < 0:
        return scores
    from ..attention.reference import window_start      # the window rule's reference (a query's first key)

    for b in range(scores.shape[0]):
        first_key = window_start(int(seq_lens[b]) - num_query_tokens, window_left)    # the earliest query's
        for j in range(scores.shape[2]):
            if (j + 1) * page_size - 1 < first_key:
                scores[b, :, j] = float("-inf")
    return scores


def _decoded_keys(k_code, k_min, k_max, phys: int, h: int, dt) -> torch.Tensor:
    """``[page_size, D]`` keys of physical page ``phys``, KV head ``h`` as its 4-bit codes stand for them:
    ``k_min + code · (k_max - k_min) / 15`` per channel (low nibble of byte ``i``: channel ``i``; high: ``i + D/2``)."""
    packed = k_code[phys, :, h].to(torch.int64).cpu()                                  # [S, D/2]
    codes = torch.cat([packed & 15, packed >> 4], dim=-1).to(dt)                      # [S, D]
    lo, hi = k_min[phys, h].to(dt).cpu(), k_max[phys, h].to(dt).cpu()
    step = (hi - lo) / 15.0
    return lo + codes * torch.where(step > 0, step, torch.zeros_like(step))


def rerank_scores(q, k_code, k_cache, k_min, k_max, candidates, block_table, seq_lens, *, scale=None, window_left=-1,
                  k_scale=None, backend=None):
    """The log of each candidate page's estimated attention mass, per (row, KV head), from 4-bit keys.

    For row ``b``, KV head ``h`` and its ``M = Tq·G`` query rows ``q_m``: every key of a candidate page is read as
    its codes decode (:func:`_decoded_keys`), except the row's last page, read exactly (it is always attended and
    its codes are written only once it fills); ``λ_mt = scale · q_m·k_t`` over the keys query ``m`` sees (causal,
    window); ``Z_m = logsumexp_t λ_mt``; ``μ_j = log Σ_m Σ_{t∈j} exp(λ_mt - Z_m)`` (queries that see no candidate
    key add nothing). Returns fp32 ``[B, Hkv, max_pages]``: ``μ_j`` at candidate pages, ``-inf`` elsewhere.
    Computed in fp64."""
    from ..attention.reference import window_start

    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    B, Tq, Hq, D = q4.shape
    Hkv, page_size = k_min.shape[1], k_cache.shape[1]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    keys = quant.dequantize(k_cache, k_scale) if k_scale is not None else k_cache
    out = torch.full((B, Hkv, block_table.shape[1]), float("-inf"), dtype=torch.float32)
    for b in range(B):
        n_tokens = int(seq_lens[b])
        n = _cdiv(n_tokens, page_size)
        for h in range(Hkv):
            pages = sorted({int(j) for j in candidates[b, h].tolist() if 0 <= int(j) < n})
            if not pages:
                continue
            logits = {}                                                   # (m, page) -> [S] fp64, -inf hidden
            for j in pages:
                phys = int(block_table[b, j])
                k = (keys[phys, :, h].double().cpu() if j == n - 1
                     else _decoded_keys(k_code, k_min, k_max, phys, h, torch.float64))          # [S, D]
                for t in range(Tq):
                    q_pos = n_tokens - Tq + t
                    first = window_start(q_pos, window_left)
                    for g in range(G):
                        row = scale * (k @ q4[b, t, h * G + g].double().cpu())                 # [S]
                        for s in range(page_size):
                            pos = j * page_size + s
                            if pos >= n_tokens or pos > q_pos or pos < first:
                                row[s] = float("-inf")
                        logits[(t * G + g, j)] = row
            mass = {j: 0.0 for j in pages}
            for m in range(Tq * G):
                z = torch.logsumexp(torch.cat([logits[(m, j)] for j in pages]), 0)
                if z == float("-inf"):
                    continue                                              # sees no candidate key
                for j in pages:
                    mass[j] += float(torch.exp(logits[(m, j)] - z).sum())
            for j in pages:
                out[b, h, j] = math.log(mass[j]) if mass[j] > 0 else float("-inf")
    return out.to(q.device)
