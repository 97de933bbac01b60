"""Index arithmetic of the paged layout (docs/layout.md) shared by the torch forms of every rule.

Pages: a row of ``seq_len`` tokens holds ``num_valid_pages = ceil(seq_len / page_size)`` logical pages.
Queries: ``q`` ``[B, Tq, Hq, D]`` is read by the torch forms as ``[B, Hkv, Tq * G, D]``, the ``G = Hq / Hkv``
query heads that share one KV head side by side (rows ordered ``(t, g)``): one matmul per KV head serves the
whole GQA group.
"""

from __future__ import annotations

import math

import torch

__all__ = ["NEG_INF", "math_dtype", "num_valid_pages", "cdiv_pages", "group_queries", "ungroup", "num_candidates"]

NEG_INF = float("-inf")


def math_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype attention math runs in for inputs like ``x``: fp64 for fp64, fp32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def num_valid_pages(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[B]`` int64: pages that hold at least one valid token, ``ceil(seq_lens / page_size)``."""
    return (seq_lens.to(torch.int64) + page_size - 1) // page_size


def cdiv_pages(num_tokens: int, page_size: int) -> int:
    """Pages that ``num_tokens`` tokens occupy (a Python int)."""
    return -(-int(num_tokens) // page_size)


def group_queries(q4: torch.Tensor, num_kv_heads: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[B, Tq, Hq, D]`` -> ``[B, Hkv, Tq * G, D]``: the queries that share one KV head, rows ordered ``(t, g)``.

    A free view for decode (``Tq == 1``, contiguous heads); a copy otherwise.
    """
    B, Tq, Hq, D = q4.shape
    x = q4 if dtype is None else q4.to(dtype)
    if Tq == 1:
        return x.reshape(B, num_kv_heads, Hq // num_kv_heads, D)
    G = Hq // num_kv_heads
    # explicit sizes, never -1: an empty batch (B = 0) has no size to infer
    return x.reshape(B, Tq, num_kv_heads, G, D).transpose(1, 2).reshape(B, num_kv_heads, Tq * G, D)


def ungroup(x: torch.Tensor, num_query_tokens: int) -> torch.Tensor:
    """Inverse of :func:`group_queries` on ``[B, Hkv, Tq * G, ...]`` -> ``[B, Tq, Hq, ...]``."""
    B, Hkv, M = x.shape[:3]
    rest = x.shape[3:]
    Tq = num_query_tokens
    if Tq == 1:
        return x.reshape(B, 1, Hkv * M, *rest)
    return x.reshape(B, Hkv, Tq, M // Tq, *rest).transpose(1, 2).reshape(B, Tq, Hkv * (M // Tq), *rest)


def num_candidates(page_budget: int, candidates: float, max_pages: int) -> int:
    """Pages the page estimate hands to the re-rank (``rerank="int4"``): ``ceil(candidates · page_budget)``, at most
    ``max(page_budget, max_pages)`` (the table's width: more candidates than a row has pages select the same pages,
    and a kernel block or a workspace sized by a huge ``candidates`` would not fit)."""
    cap = max(page_budget, max_pages)
    want = candidates * page_budget             # compared before ceil: a huge float would overflow int()
    return cap if want >= cap else int(math.ceil(want - 1e-9))
