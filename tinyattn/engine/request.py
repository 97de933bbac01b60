"""A request's life in the engine (:class:`Request`) and what the engine hands back (:class:`RequestOutput`).

Token bookkeeping: ``tokens = prompt + output``; ``num_cached`` of them have K/V in the cache. A request is

- *prefilling* while ``num_cached < prefill_len`` (chunks of its prompt, dense);
- *decoding* otherwise: each step feeds ``tokens[num_cached]`` (one token, through the sparse decode path).
  When that token is the last one (``num_cached == len(tokens) - 1``) the step's logits give a new token;
  before that (after a preemption, ``recompute="replay"``) the step only rebuilds K/V: a *replayed* token.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

from .params import SamplingParams

__all__ = ["RequestStatus", "Request", "RequestOutput"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"          # queued (new, or preempted and waiting to be recomputed)
    RUNNING = "running"          # holds pages of the cache
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One request inside the engine (the engine owns it; read-only for plug-ins)."""

    request_id: int
    prompt: list[int]
    params: SamplingParams
    arrival_time: float
    output: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    seq_id: int | None = None           # its sequence in the cache while RUNNING
    num_cached: int = 0                 # tokens of prompt + output whose K/V is in the cache
    prefill_len: int = 0                # tokens to prefill before decoding (the prompt, or more after a preemption)
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None    # "stop" (EOS / stop token), "length", "abort"
    generator: torch.Generator | None = None

    def __post_init__(self):
        self.prefill_len = len(self.prompt)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def is_prefilling(self) -> bool:
        return self.num_cached < self.prefill_len

    def token_at(self, i: int) -> int:
        n = len(self.prompt)
        return self.prompt[i] if i < n else self.output[i - n]

    def tokens_from(self, start: int, count: int) -> list[int]:
        return (self.prompt + self.output)[start:start + count]


@dataclass
class RequestOutput:
    """A finished request: its new tokens and its timings (seconds of the engine's clock).

    ``tokens``: the generated tokens (the stopping token included when ``finish_reason == "stop"``).
    ``ttft``: first token time minus arrival; ``tpot``: mean time per output token after the first
    (NaN with fewer than 2 tokens); ``latency``: finish minus arrival.
    """

    request_id: int
    prompt: list[int]
    tokens: list[int]
    finish_reason: str
    num_preemptions: int
    arrival_time: float
    first_token_time: float | None
    finish_time: float

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.arrival_time if self.first_token_time is not None else math.nan

    @property
    def tpot(self) -> float:
        if self.first_token_time is None or len(self.tokens) < 2:
            return math.nan
        return (self.finish_time - self.first_token_time) / (len(self.tokens) - 1)

    @property
    def latency(self) -> float:
        return self.finish_time - self.arrival_time

    @classmethod
    def of(cls, req: Request) -> "RequestOutput":
        return cls(request_id=req.request_id, prompt=list(req.prompt), tokens=list(req.output),
                   finish_reason=req.finish_reason, num_preemptions=req.num_preemptions,
                   arrival_time=req.arrival_time, first_token_time=req.first_token_time,
                   finish_time=req.finish_time)
