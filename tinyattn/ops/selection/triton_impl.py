"""The Triton form of scoring and selection: launchers of ``kernels/scoring.py`` (the Quest bound, or the box
estimate with ``gamma < 1``), ``kernels/topk.py`` (one-stage selection, one program per (row, KV head), and the top-p
filter of a capacity selection) and ``kernels/chunk_topk.py`` (the two-stage selection: fused bound + per-chunk
top-k, then a merge; with top-p stage 1 also writes every valid page's score, which the filter reads).

Launchers take canonical, validated tensors (int32 tables, preallocated outputs) and make one launch each, with
keyword arguments; the block sizes come from the kernel modules' ``*_blocks`` functions (shared with the compile
tier, :mod:`tinyattn.kernels.compile`).
"""
from __future__ import annotations

import torch
import triton

from ...kernels import strides
from ...kernels.chunk_topk import merge_chunks_kernel, score_chunk_topk_kernel
from ...kernels.rerank import rerank_blocks, rerank_kernel
from ...kernels.scoring import page_scores_kernel, score_blocks
from ...kernels.topk import select_pages_kernel, top_p_blocks, top_p_filter_kernel, topk_blocks

__all__ = ["page_scores", "select_pages", "top_p_filter", "score_chunks", "merge_chunks", "score_and_select_pages",
           "rerank_scores"]


def page_scores(q: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor, block_table: torch.Tensor,
                seq_lens: torch.Tensor, *, page_size: int, out: torch.Tensor, gamma: float = 1.0) -> None:
    """Write ``ub`` of every logical page (the box estimate with ``gamma < 1``) into ``out`` ``[B, Hkv, max_pages]``
    fp32.

    q ``[B, Tq, Hq, D]``; k_min/k_max ``[num_pages, Hkv, D]``; block_table ``[B, max_pages]`` int32;
    seq_lens ``[B]`` int32. Pages ``j >= cdiv(seq_len, page_size)`` get ``-inf``.
    """
    batch, num_queries, num_heads, head_dim = q.shape
    num_kv_heads = k_min.shape[1]
    max_pages = block_table.shape[1]
    assert page_size & (page_size - 1) == 0, "page_size must be a power of two"
    if batch == 0 or max_pages == 0:
        return
    meta = score_blocks(num_queries, num_heads // num_kv_heads, head_dim, page_size, max_pages)
    grid = (batch, num_kv_heads, triton.cdiv(max_pages, meta["BP"]))
    page_scores_kernel[grid](
        q=q, k_min=k_min, k_max=k_max, block_table=block_table, seq_lens=seq_lens, out=out,
        **strides("q", q, "bthd"), **strides("n", k_min, "phd"), **strides("x", k_max, "phd"),
        **strides("b", block_table, "t"), **strides("o", out, "bhj"),
        MAXP=max_pages, TQ=num_queries, D=head_dim, GAMMA=float(gamma), **meta,
    )


def select_pages(scores: torch.Tensor, seq_lens: torch.Tensor, *, page_size: int, page_budget: int,
                 num_sink_pages: int, num_recent_pages: int, num_query_tokens: int, out: torch.Tensor) -> None:
    """Write the selected logical pages ``[B, Hkv, page_budget]`` int32 (ascending, -1 padded) into ``out``.

    scores ``[B, Hkv, max_pages]`` fp32; seq_lens ``[B]`` int32 (including the ``num_query_tokens``).
    """
    batch, num_kv_heads, max_pages = scores.shape
    assert page_size & (page_size - 1) == 0, "page_size must be a power of two"
    if batch == 0 or num_kv_heads == 0 or page_budget == 0:
        return
    meta = topk_blocks(max_pages, page_budget, page_size)
    select_pages_kernel[(batch, num_kv_heads)](
        scores=scores, seq_lens=seq_lens, out=out,
        **strides("s", scores, "bhj"), **strides("o", out, "bhk"),
        MAXP=max_pages, BUDGET=page_budget, NUM_SINK=num_sink_pages, NUM_RECENT=num_recent_pages,
        TQ=num_query_tokens, **meta,
    )


def score_chunks(q: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, *, page_size: int, page_budget: int, num_sink_pages: int,
                 num_recent_pages: int, meta: dict, ws_key: torch.Tensor, ws_page: torch.Tensor,
                 window_left: int = -1, gamma: float = 1.0, scores: torch.Tensor | None = None) -> None:
    """Stage 1: each chunk's candidates (order keys, logical pages, ascending, -1 padded) into the workspace.

    q ``[B, Tq, Hq, D]``; k_min/k_max ``[num_pages, Hkv, D]``; block_table ``[B, max_pages]`` int32; seq_lens
    ``[B]`` int32 (including the Tq queries). ``meta`` from :func:`chunk_blocks`; ``ws_key`` / ``ws_page``
    ``workspace_shape(...)`` int32 with unit last stride (preallocated by the plan, overwritten).
    ``window_left`` >= 0: pages wholly before the earliest query's window score ``-inf``. ``scores``: a
    ``[B, Hkv, max_pages]`` fp32 buffer (unit last stride) that also receives the score of every valid page (the
    forced ones included; what :func:`top_p_filter` reads), or ``None``.
    """
    batch, num_queries, _, head_dim = q.shape
    num_kv_heads, max_pages = k_min.shape[1], block_table.shape[1]
    assert page_size & (page_size - 1) == 0, "page_size must be a power of two"
    assert ws_key.stride(-1) == 1 and ws_page.stride() == ws_key.stride()
    assert ws_key.shape[-1] >= meta["NC"] * meta["KC"]
    if batch == 0 or num_kv_heads == 0 or max_pages == 0 or page_budget == 0:
        return
    if scores is not None:
        assert scores.stride(-1) == 1 and tuple(scores.shape) == (batch, num_kv_heads, max_pages)
    out_scores = ws_key if scores is None else scores          # a dummy pointer when not written (SCORES=False)
    score_chunk_topk_kernel[(batch, num_kv_heads, meta["NC"])](
        q=q, k_min=k_min, k_max=k_max, block_table=block_table, seq_lens=seq_lens, ws_key=ws_key, ws_page=ws_page,
        scores=out_scores, **strides("s", out_scores, "bh"),
        **strides("q", q, "bthd"), **strides("n", k_min, "phd"), **strides("x", k_max, "phd"),
        **strides("b", block_table, "t"), **strides("w", ws_key, "bh"),
        MAXP=max_pages, TQ=num_queries, D=head_dim, BUDGET=page_budget, NUM_SINK=num_sink_pages,
        NUM_RECENT=num_recent_pages, WINDOW=window_left, KC=meta["KC"], GAMMA=float(gamma), **meta["stage1"],
        SCORES=scores is not None,
    )


def merge_chunks(ws_key: torch.Tensor, ws_page: torch.Tensor, seq_lens: torch.Tensor, *, max_pages: int,
                 page_size: int, page_budget: int, num_sink_pages: int, num_recent_pages: int,
                 num_query_tokens: int, meta: dict, out: torch.Tensor) -> None:
    """Stage 2: the selected logical pages ``[B, Hkv, page_budget]`` int32 (ascending, -1 padded) into ``out``."""
    batch, num_kv_heads = out.shape[:2]
    if batch == 0 or num_kv_heads == 0 or page_budget == 0:
        return
    if max_pages == 0:              # stage 1 had no chunk to write: every slot is padding
        out.fill_(-1)
        return
    merge_chunks_kernel[(batch, num_kv_heads)](
        ws_key=ws_key, ws_page=ws_page, seq_lens=seq_lens, out=out,
        **strides("w", ws_key, "bh"), **strides("o", out, "bhk"),
        NCAND=meta["NC"] * meta["KC"], MAXP=max_pages, TQ=num_query_tokens, BUDGET=page_budget,
        NUM_SINK=num_sink_pages, NUM_RECENT=num_recent_pages, **meta["stage2"],
    )


def top_p_filter(scores: torch.Tensor, selected: torch.Tensor, seq_lens: torch.Tensor, *, page_size: int,
                 num_sink_pages: int, num_recent_pages: int, num_query_tokens: int, top_p: float, scale: float,
                 out: torch.Tensor) -> None:
    """The pages of the capacity selection ``selected`` ``[B, Hkv, page_budget]`` int32 (ascending, -1 padded) that
    top-p keeps, into ``out`` (same shape, another buffer): ``kernels/topk.py::top_p_filter_kernel``.

    scores ``[B, Hkv, max_pages]`` fp32: the scores ``selected`` was chosen by, every valid page's (forced ones
    included); seq_lens ``[B]`` int32; ``top_p`` in ``(0, 1]``, ``scale`` > 0 the softmax scale of the mass.
    """
    batch, num_kv_heads, page_budget = selected.shape
    if batch == 0 or num_kv_heads == 0 or page_budget == 0:
        return
    max_pages = scores.shape[2]
    top_p_filter_kernel[(batch, num_kv_heads)](
        scores=scores, sel=selected, seq_lens=seq_lens, out=out,
        **strides("s", scores, "bhj"), **strides("c", selected, "bhk"), **strides("o", out, "bhk"),
        MAXP=max_pages, BUDGET=page_budget, NUM_SINK=num_sink_pages, NUM_RECENT=num_recent_pages,
        TQ=num_query_tokens, TOP_P=float(top_p), SCALE=float(scale),
        **top_p_blocks(max_pages, page_budget, page_size),
    )


def score_and_select_pages(q: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, *, page_size: int, page_budget: int, num_sink_pages: int,
                           num_recent_pages: int, meta: dict, ws_key: torch.Tensor, ws_page: torch.Tensor,
                           out: torch.Tensor, window_left: int = -1, gamma: float = 1.0) -> None:
    """``select_pages(page_scores(q, ...))`` into ``out`` ``[B, Hkv, page_budget]`` int32, in two launches
    (:func:`score_chunks`, then :func:`merge_chunks`); arguments as theirs."""
    opts = dict(page_size=page_size, page_budget=page_budget, num_sink_pages=num_sink_pages,
                num_recent_pages=num_recent_pages, meta=meta)
    score_chunks(q, k_min, k_max, block_table, seq_lens, ws_key=ws_key, ws_page=ws_page, window_left=window_left,
                 gamma=gamma, **opts)
    merge_chunks(ws_key, ws_page, seq_lens, max_pages=block_table.shape[1], num_query_tokens=q.shape[1], out=out,
                 **opts)


def rerank_scores(q: torch.Tensor, k_code: torch.Tensor, k_cache: torch.Tensor, k_min: torch.Tensor,
                  k_max: torch.Tensor, candidates: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                  page_size: int, scale: float, out: torch.Tensor, window_left: int = -1,
                  k_scale: torch.Tensor | None = None) -> None:
    """Write the log of each candidate's estimated attention mass into ``out`` ``[B, Hkv, max_pages]`` fp32
    (``-inf`` elsewhere; ``kernels/rerank.py``, one fill and one launch, grid ``(B, Hkv)``).

    q ``[B, Tq, Hq, D]``; k_code ``[num_pages, page_size, Hkv, D/2]`` uint8; k_cache the pool (its last pages are
    read exactly; int8 / fp8 with ``k_scale``); candidates ``[B, Hkv, C]`` int32, ``-1`` padded, distinct;
    block_table ``[B, max_pages]`` int32; seq_lens ``[B]`` int32.
    """
    batch, num_queries, num_heads, head_dim = q.shape
    num_kv_heads, num_candidates = k_min.shape[1], candidates.shape[2]
    out.fill_(float("-inf"))
    if batch == 0 or num_kv_heads == 0 or num_candidates == 0 or block_table.shape[1] == 0:
        return
    quantized = k_scale is not None
    rerank_kernel[(batch, num_kv_heads)](
        q=q, k_code=k_code, k_cache=k_cache, k_min=k_min, k_max=k_max, k_scale=k_scale if quantized else k_min,
        cand=candidates, block_table=block_table, seq_lens=seq_lens, out=out,
        **strides("q", q, "bthd"), **strides("c", candidates, "bh"), **strides("b", block_table, "t"),
        stride_cp=k_code.stride(0), stride_cs=k_code.stride(1), stride_chh=k_code.stride(2),
        stride_cd=k_code.stride(3), **strides("k", k_cache, "pshd"), **strides("n", k_min, "phd"),
        **strides("x", k_max, "phd"), **strides("s", k_scale, "ph"), **strides("o", out, "bhj"),
        TQ=num_queries, C=num_candidates, HALF=head_dim // 2, scale=float(scale), WINDOW_LEFT=int(window_left),
        QUANT=quantized, **rerank_blocks(num_queries, num_heads // num_kv_heads, head_dim, page_size, num_candidates),
    )
