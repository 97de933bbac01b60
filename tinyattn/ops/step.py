"""What a planned decode / prefill step is: its geometry and selection rules, fixed at ``plan()`` time.

:class:`Step` is handed by the public front (:class:`tinyattn.PagedAttentionPlan`) to the implementation of its
backend (:mod:`tinyattn.ops.plan_torch`, :mod:`tinyattn.ops.plan_triton`); it holds plain Python values only (no
tensor), so nothing in it can change under the plan after ``plan()``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Step"]


class Step(NamedTuple):
    """One step's sizes (DESIGN.md §2 names) and selection rules.

    ``gamma``: the share of the box half-width in the page estimate (``1``: Quest's bound); ``top_p``: the estimated
    attention mass a selection keeps (``None``: the whole ``page_budget``); ``rerank``: ``"int4"`` ranks the
``ceil(candidates · page_budget)`` best pages of the estimate again by their attention mass estimated from 4-bit
keys (``None``: the estimate alone).

    ``lens``: the rows' ``seq_lens`` on the host, or ``None`` when planning made no host sync (trusted tables on a
    GPU); ``selects``: some row holds more than ``page_budget`` pages (or unknown: ``lens`` is ``None``);
    ``nothing``: no query sees any key (empty batch, no query token, all rows empty).
    """

    backend: str
    device: torch.device
    batch: int
    max_pages: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_query_tokens: int
    page_budget: int | None
    num_sink_pages: int
    num_recent_pages: int
    scale: float
    gamma: float
    top_p: float | None
    rerank: str | None
    candidates: float
    lens: tuple | None
    selects: bool
    nothing: bool

    @property
    def group(self) -> int:
        """``G = Hq / Hkv``: query heads per KV head (GQA)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def selection(self) -> dict:
        """The selection rules as keyword arguments (``page_budget``, ``num_sink_pages``, ``num_recent_pages``,
        ``gamma``, ``top_p``)."""
        return dict(page_budget=self.page_budget, num_sink_pages=self.num_sink_pages,
                    num_recent_pages=self.num_recent_pages, gamma=self.gamma, top_p=self.top_p)
