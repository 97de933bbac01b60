"""Scoring and selection as ``torch.library`` custom ops, so that the sparse op traces under ``torch.compile``.

- ``tinyattn::page_scores(q, k_min, k_max, block_table, seq_lens, page_size, backend) -> scores``
- ``tinyattn::select_pages(scores, seq_lens, page_size, page_budget, num_sink_pages, num_recent_pages,
  num_query_tokens, backend) -> page_indices``

Both take validated, canonical inputs (``q`` as ``[B, Tq, Hq, D]``). Their bodies hold what the compiler
cannot trace (Triton launches, host-side size decisions of the torch backend); the fake kernels give it
the output shapes. Eager calls skip the dispatcher and run :func:`run_page_scores` / :func:`run_select_pages`
directly (see ``api._page_scores``); under ``torch.compile`` the public ops call the custom ops instead,
the same way the attention goes through ``tinyattn::paged_attention_fwd`` (:mod:`tinyattn.ops.autograd`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import torch_backend as T

__all__ = ["run_page_scores", "run_select_pages", "page_scores_op", "select_pages_op"]


def _kernels():
    from .. import kernels       # imported lazily: a CPU-only user never needs triton
    return kernels


def run_page_scores(q4: Tensor, k_min: Tensor, k_max: Tensor, block_table: Tensor, seq_lens: Tensor,
                    page_size: int, backend: str) -> Tensor:
    """fp32 ``[B, Hkv, max_pages_per_seq]`` upper-bound scores (the body of ``tinyattn.page_scores``)."""
    if backend == "torch" or q4.dtype == torch.float64:
        return T.page_scores(q4, k_min, k_max, block_table, seq_lens, page_size=page_size)
    out = torch.empty(q4.shape[0], k_min.shape[1], block_table.shape[1], dtype=torch.float32, device=q4.device)
    _kernels().page_scores(q4, k_min, k_max, block_table.to(torch.int32).contiguous(),
                           seq_lens.to(torch.int32).contiguous(), page_size=page_size, out=out)
    return out


def run_select_pages(scores: Tensor, seq_lens: Tensor, page_size: int, page_budget: int, num_sink_pages: int,
                     num_recent_pages: int, num_query_tokens: int, backend: str) -> Tensor:
    """int32 ``[B, Hkv, page_budget]`` selected logical pages (the body of ``tinyattn.select_pages``)."""
    options = dict(page_size=page_size, page_budget=page_budget, num_sink_pages=num_sink_pages,
                   num_recent_pages=num_recent_pages, num_query_tokens=num_query_tokens)
    if backend == "torch":
        return T.select_pages(scores, seq_lens, **options)
    out = torch.empty(*scores.shape[:2], page_budget, dtype=torch.int32, device=scores.device)
    _kernels().select_pages(scores.contiguous(), seq_lens.to(torch.int32).contiguous(), **options, out=out)
    return out


@torch.library.custom_op("tinyattn::page_scores", mutates_args=())
def page_scores_op(q: Tensor, k_min: Tensor, k_max: Tensor, block_table: Tensor, seq_lens: Tensor,
                   page_size: int, backend: str) -> Tensor:
    return run_page_scores(q, k_min, k_max, block_table, seq_lens, page_size, backend)


@page_scores_op.register_fake
def _(q, k_min, k_max, block_table, seq_lens, page_size, backend):
    return q.new_empty((q.shape[0], k_min.shape[1], block_table.shape[1]), dtype=torch.float32)


@torch.library.custom_op("tinyattn::select_pages", mutates_args=())
def select_pages_op(scores: Tensor, seq_lens: Tensor, page_size: int, page_budget: int, num_sink_pages: int,
                    num_recent_pages: int, num_query_tokens: int, backend: str) -> Tensor:
    return run_select_pages(scores, seq_lens, page_size, page_budget, num_sink_pages, num_recent_pages,
                            num_query_tokens, backend)


@select_pages_op.register_fake
def _(scores, seq_lens, page_size, page_budget, num_sink_pages, num_recent_pages, num_query_tokens, backend):
    return scores.new_empty((scores.shape[0], scores.shape[1], page_budget), dtype=torch.int32)
