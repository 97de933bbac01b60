"""``SamplingParams``: how one request of the engine generates (length, temperature, seed, stop tokens)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """How a request generates (vLLM's names).

    Args:
        max_new_tokens: tokens to generate at most (the stopping token, if any, included); 0 = none.
        temperature: 0 = greedy (argmax, ties to the lowest id); otherwise tokens are drawn from
            ``softmax(logits / temperature)`` with the request's own ``torch.Generator``.
        seed: seed of that generator; ``None`` = a fresh random seed. A seeded request draws the same tokens
            whatever else the engine runs beside it, and after a preemption (see docs/engine.md).
        ignore_eos: keep generating past the engine's EOS token (benchmarks with fixed output lengths).
        stop_token_ids: more tokens that end the request (kept in its output, as EOS is), e.g. BOS for
            llama2.c models, whose stories end where the next one's BOS would be.

    Raises:
        ValueError naming the field for a negative length, a negative / non-finite temperature, or a
        stop token that is not an int >= 0.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens: expected an int >= 0, got {self.max_new_tokens!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature: expected a finite number >= 0, got {t!r}")
        object.__setattr__(self, "temperature", float(t))
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed: expected an int or None, got {self.seed!r}")
        stops = (self.stop_token_ids,) if isinstance(self.stop_token_ids, int) else tuple(self.stop_token_ids)
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in stops):
            raise ValueError(f"stop_token_ids: expected token ids (ints >= 0), got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stops)
        object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))
