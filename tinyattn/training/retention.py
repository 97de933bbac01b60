"""KV retention policies for chunked long-context fine-tuning: which memory pages to free when over budget.

A long sequence is processed in chunks; the K/V of earlier chunks stay in a paged cache as memory
(:class:`tinyattn.training.memory.ChunkedKVMemory`). When the next chunk does not fit in the budget, the
memory asks its policy for a score of every page it holds (per layer, per row) and frees the
lowest-scoring pages that are not protected (the first ``num_sink_pages`` pages, attention sinks, and the
newest ``num_recent_pages`` pages), returning them to the pool.

- :class:`FullRetention`: never frees anything (the pool holds the whole sequence): the reference point.
- :class:`RecencyRetention`: score = page position: keeps the sinks and the newest pages (StreamingLLM,
  Xiao et al., ICLR 2024).
- :class:`GradientRetention`: score = exponential moving average, over the chunks that attended the page,
  of a gradient signal observed after each chunk's backward (TinyServe, Liu & Yu, arXiv 2509.12211, §3.4:
  "gradient-aware memory management selectively retains KV cache entries based on their gradient magnitude
  during backpropagation"). The signal, per logical page ``p`` of a row, with ``k, v`` its stored K/V and
  ``dk, dv`` the gradients of the chunk's loss with respect to them (all slots, KV heads and channels):

  - ``"taylor"`` (default): ``g_p = -sum(dk * k + dv * v)``, the first-order (Taylor) estimate of the loss
    change if the page's K/V were removed (set to zero), :func:`page_taylor_scores`: the first-order Taylor pruning
    criterion of Molchanov et al. (ICLR 2017), applied to KV pages and kept signed (they take its absolute
    value). Signed: a page whose removal would *lower* the loss
    (``g_p < 0``, it misleads the current chunk) is freed first; a page the loss leans on is kept.
    Gradient magnitude alone cannot tell those two kinds of page apart.
  - ``"magnitude"``: ``g_p = ||dK_p||^2 + ||dV_p||^2`` summed over KV heads (TinyServe's wording taken
    literally; the previous default).

  ``ema = g`` at a page's first observation, then ``ema = decay * ema + (1 - decay) * g``; the lowest ``ema``
  among the unprotected pages is freed first (ties: the older page). With ``recent_pages=R`` (default 0) the
  ``R`` newest held pages rank above all others, in recency order, and the score chooses among the older ones.
"""

from __future__ import annotations

import torch

__all__ = ["page_taylor_scores", "RetentionPolicy", "FullRetention", "RecencyRetention", "GradientRetention",
           "make_policy", "POLICIES"]


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


def page_taylor_scores(k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
    """fp32 ``[num_pages]``: first-order estimate of the loss change if each physical page's K/V were removed.

    ``k_pool``, ``v_pool`` ``[num_pages, page_size, Hkv, D]`` hold the values the attention read and, in
    ``.grad``, the gradients of the chunk's loss. Removing a page's contribution (``k, v -> 0``) changes the
    loss by, to first order (a Taylor expansion around the current values; Molchanov et al., "Pruning
    convolutional neural networks for resource efficient inference", ICLR 2017, use its absolute value)::

        dL[p] = L(k_p = 0, v_p = 0) - L  ~  -sum_{s,h,d} (dk[p,s,h,d] * k[p,s,h,d] + dv[p,s,h,d] * v[p,s,h,d])

    Positive: the page helps (freeing it would raise the loss); negative: it misleads. Pages never read have a
    zero gradient and score 0.
    """
    dk, dv = k_pool.grad, v_pool.grad
    dims = (1, 2, 3)
    return -((dk.float() * k_pool.detach().float()).sum(dims) + (dv.float() * v_pool.detach().float()).sum(dims))


class GradientRetention(RetentionPolicy):
    """Keep the pages whose K/V the gradients say matter most (EMA over the chunks they were attended in).

    Args:
        decay: EMA factor ``beta``: ``ema = beta * ema + (1 - beta) * g``; a page's first observation sets
            ``ema = g`` (no bias towards pages seen for longer).
        signal: what ``g`` is, per page (see the module docstring): ``"taylor"`` (default), the signed
            first-order loss change of removing the page, :func:`page_taylor_scores`; ``"magnitude"``, the
            gradient magnitude ``||dK||^2 + ||dV||^2`` summed over KV heads.
        recent_pages: ``R``: the newest ``R`` pages a row holds (by logical position) rank above every other
            page, in recency order, so the score chooses only among the older ones (H2O, Zhang et al.,
            NeurIPS 2023, keeps half its budget for the newest tokens and the other half by score). Added on
            top of the memory's own protection of its newest pages. Default 0: the score alone.
    """

    name = "gradient"
    needs_gradients = True
    SIGNALS = ("taylor", "magnitude")

    def __init__(self, decay: float = 0.5, signal: str = "taylor", recent_pages: int = 0):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay: expected a float in [0, 1), got {decay!r}")
        if signal not in self.SIGNALS:
            raise ValueError(f"signal: expected one of {list(self.SIGNALS)}, got {signal!r}")
        if not (isinstance(recent_pages, int) and recent_pages >= 0):
            raise ValueError(f"recent_pages: expected an int >= 0, got {recent_pages!r}")
        self.decay = decay
        self.signal = signal
        self.recent_pages = recent_pages
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
        ema = self.ema[layer]
        if not self.recent_pages:
            return ema
        held = held.to(ema.device)
        newer = held.flip(1).long().cumsum(1).flip(1) - held.long()        # held pages newer than each page
        recent = held & (newer < self.recent_pages)
        top = ema.masked_fill(~held, float("-inf")).amax(1, keepdim=True).clamp_min(0.0)
        position = torch.arange(held.shape[1], dtype=ema.dtype, device=ema.device)
        return torch.where(recent, top + 1.0 + position, ema)

    def __repr__(self):
        return (f"GradientRetention(decay={self.decay}, signal={self.signal!r}, "
                f"recent_pages={self.recent_pages})")


POLICIES = {"full": FullRetention, "recency": RecencyRetention, "gradient": GradientRetention}


def make_policy(name: str, **options) -> RetentionPolicy:
    """``"full" | "recency" | "gradient"`` -> a policy; ``options`` go to its constructor (``decay``, ``signal``,
    ``recent_pages``)."""
    if name not in POLICIES:
        raise ValueError(f"retention: expected one of {sorted(POLICIES)}, got {name!r}")
    if name != "gradient":
        options = {}
    return POLICIES[name](**options)
