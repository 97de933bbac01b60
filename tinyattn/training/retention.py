"""KV retention policies for chunked long-context fine-tuning: which memory pages to free when over budget.

A long sequence is processed in chunks; the K/V of earlier chunks stay in a paged cache as memory
(:class:`tinyattn.training.memory.ChunkedKVMemory`). When the next chunk does not fit in the budget, the
memory asks its policy for a score of every page it holds (per layer, per row) and frees the
lowest-scoring pages that are not protected (the first ``num_sink_pages`` pages, attention sinks, and the
newest ``num_recent_pages`` pages), returning them to the pool.

- :class:`FullRetention`: never frees anything (the pool holds the whole sequence): the reference point.
- :class:`RecencyRetention`: score = page position: keeps the sinks and the newest pages (StreamingLLM,
  Xiao et al., ICLR 2024).
- :class:`GradientRetention`: score = exponential moving average of the page's gradient magnitude
  ``||dK_page||^2 + ||dV_page||^2`` (summed over KV heads), observed after each chunk's backward
  (TinyServe, Liu & Yu, arXiv 2509.12211, §3.4: "gradient-aware memory management selectively retains KV
  cache entries based on their gradient magnitude during backpropagation").
"""

from __future__ import annotations

import torch

__all__ = ["RetentionPolicy", "FullRetention", "RecencyRetention", "GradientRetention", "make_policy", "POLICIES"]


class RetentionPolicy:
    """Base class. ``evicts`` is False for a policy that never frees pages.

    Subclasses implement :meth:`scores`; :meth:`reset` is called at the start of each batch of sequences and
    :meth:`observe` after each chunk's backward with the per-page gradient magnitudes.
    """

    name = "base"
    evicts = True
    needs_gradients = False

    def reset(self, num_layers: int, batch: int, max_pages: int, device=None) -> None:
        """Forget everything: a new batch of ``batch`` sequences of at most ``max_pages`` logical pages."""

    def observe(self, layer: int, norms: torch.Tensor, held: torch.Tensor) -> None:
        """``norms`` ``[B, max_pages]`` gradient magnitude of each held logical page (0 elsewhere)."""

    def scores(self, layer: int, held: torch.Tensor) -> torch.Tensor:
        """``[B, max_pages]`` float: higher = keep. Only entries where ``held`` is True are read."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FullRetention(RetentionPolicy):
    """Keep every page: the memory is sized for the whole sequence."""

    name = "full"
    evicts = False

    def scores(self, layer, held):
        return torch.zeros(held.shape)


class RecencyRetention(RetentionPolicy):
    """Keep the sinks and the newest pages: evict the oldest unprotected page first."""

    name = "recency"

    def scores(self, layer, held):
        return torch.arange(held.shape[1], dtype=torch.float32, device=held.device).expand(held.shape)


class GradientRetention(RetentionPolicy):
    """Keep the pages whose K/V receive the largest gradients (EMA over the chunks they were attended in).

    Args:
        decay: EMA factor ``beta``: ``ema = beta * ema + (1 - beta) * g``; a page's first observation sets
            ``ema = g`` (no bias towards pages seen for longer).
    """

    name = "gradient"
    needs_gradients = True

    def __init__(self, decay: float = 0.5):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay: expected a float in [0, 1), got {decay!r}")
        self.decay = decay
        self.ema: list[torch.Tensor] = []
        self.seen: list[torch.Tensor] = []

    def reset(self, num_layers, batch, max_pages, device=None):
        self.ema = [torch.zeros(batch, max_pages, device=device) for _ in range(num_layers)]
        self.seen = [torch.zeros(batch, max_pages, dtype=torch.bool, device=device) for _ in range(num_layers)]

    def observe(self, layer, norms, held):
        ema, seen = self.ema[layer], self.seen[layer]
        g = norms.float()
        updated = torch.where(seen, self.decay * ema + (1.0 - self.decay) * g, g)
        self.ema[layer] = torch.where(held, updated, ema)
        self.seen[layer] = seen | held

    def scores(self, layer, held):
        return self.ema[layer]

    def __repr__(self):
        return f"GradientRetention(decay={self.decay})"


POLICIES = {"full": FullRetention, "recency": RecencyRetention, "gradient": GradientRetention}


def make_policy(name: str, **options) -> RetentionPolicy:
    """``"full" | "recency" | "gradient"`` -> a policy; ``options`` go to its constructor (``decay``)."""
    if name not in POLICIES:
        raise ValueError(f"retention: expected one of {sorted(POLICIES)}, got {name!r}")
    if name != "gradient":
        options = {}
    return POLICIES[name](**options)
