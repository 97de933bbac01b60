"""The scheduler: which requests run this step, how many tokens each, and who is preempted.

Continuous batching with chunked prefill (vLLM's scheduler, in miniature). Each :meth:`Scheduler.schedule`:

1. **Running requests, oldest first.** A decoding request gets 1 token; a prefilling one a chunk of its
   remaining prompt, both within the step's token budget ``max_num_batched_tokens`` (decode tokens count).
   When the pool has no page for a request, the **newest** running request is preempted (vLLM's recompute
   policy): its pages go back to the pool, it returns to the head of the waiting queue, and it is recomputed
   later. A prefill chunk first shrinks to what fits. The oldest request is never preempted for a newer one,
   and every request fits the pool alone (the engine refuses any other), so every request completes.
2. **Waiting requests, first come first served**, while tokens, pages and ``max_num_seqs`` allow, and only in a
   step that preempted no one (admitting then would only be preempted again). A request is admitted with a
   first chunk of its prompt; the next steps bring the rest.

The scheduler owns the cache's allocation map for requests (``add_sequence`` on admission, ``free`` on
preemption); the model's forward extends the sequences by exactly the tokens scheduled here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .request import Request, RequestStatus

__all__ = ["Scheduler", "ScheduledBatch"]


@dataclass
class ScheduledBatch:
    """One step's work: ``decode`` requests feed one token each (one forward for all), ``prefill`` holds
    ``(request, num_tokens)`` chunks (one forward each), ``preempted`` the requests that lost their pages."""

    decode: list[Request] = field(default_factory=list)
    prefill: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    """Continuous batching over a :class:`tinyattn.PagedKVCache` (see the module docstring).

    Args:
        cache: the engine's cache. max_num_batched_tokens: tokens per step, decode and prefill together.
        max_num_seqs: requests running at once. recompute: what a preempted request rebuilds by prefill:
            ``"replay"`` its prompt only, then its generated tokens one decode step each (exactly the K/V the
            first run wrote, sparse decode included); ``"prefill"`` prompt and generated tokens in chunks
            (vLLM's recompute: faster, but those tokens' K/V then come from dense attention).
        on_release: called with a request before its sequence is freed (policy state, plug-ins).
        watermark: admit a waiting request only while a free page per running request stays in reserve.
    """

    def __init__(self, cache, *, max_num_batched_tokens: int, max_num_seqs: int, recompute: str = "replay",
                 on_release=None, watermark: bool = True):
        self.cache = cache
        self.page_size = cache.page_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.recompute = recompute
        self.on_release = on_release
        self.watermark = watermark
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []       # admission order: the last one is the newest
        self.recomputed_tokens = 0             # K/V tokens lost to preemptions (computed again later)

    # ---- queue ------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def pages_in_use(self) -> int:
        return self.cache.num_pages - self.cache.num_free_pages

    def release(self, req: Request) -> None:
        """Take ``req`` out of the queues; free its pages if it holds any."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._free(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def _free(self, req: Request) -> None:
        if self.on_release is not None:
            self.on_release(req)
        self.cache.free(req.seq_id)
        req.seq_id = None
        req.num_cached = 0

    def _preempt(self, req: Request) -> None:
        self.recomputed_tokens += req.num_cached
        self.running.remove(req)
        self._free(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        req.prefill_len = len(req.prompt) if self.recompute == "replay" else max(len(req.prompt), req.num_tokens - 1)
        self.waiting.appendleft(req)

    # ---- pages ------------------------------------------------------------------------------------
    def _pages_needed(self, req: Request, n: int) -> int:
        ps = self.page_size
        return -(-(req.num_cached + n) // ps) - (-(-req.num_cached // ps))

    def _tokens_that_fit(self, req: Request, free_pages: int) -> int:
        ps = self.page_size
        slack = -(-req.num_cached // ps) * ps - req.num_cached      # room left in its last page
        return slack + free_pages * ps

    # ---- one step ---------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        reserved = 0                                                   # pages promised to this step
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            want = min(req.prefill_len - req.num_cached, budget) if req.is_prefilling else 1
            while self._pages_needed(req, want) > self.cache.num_free_pages - reserved:
                fit = self._tokens_that_fit(req, self.cache.num_free_pages - reserved)
                if req.is_prefilling and fit >= 1:
                    want = min(want, fit)                              # a smaller chunk that fits
                    break
                victim = self.running[-1]                              # the newest running request
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    want = 0
                    break
            if want == 0:
                break                                                  # req was the newest: all others scheduled
            reserved += self._pages_needed(req, want)
            budget -= want
            if req.is_prefilling:
                batch.prefill.append((req, want))
            else:
                batch.decode.append(req)
            i += 1
        if batch.preempted:
            return batch
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            # keep a page per running request in reserve: admitting into the last pages only gets the
            # newcomer preempted a few steps later, when the running requests cross a page boundary
            free = self.cache.num_free_pages - reserved - (len(self.running) if self.watermark else 0)
            want = min(req.prefill_len, budget, free * self.page_size)
            if want < 1:
                break
            self.waiting.popleft()
            req.seq_id = self.cache.add_sequence()
            req.num_cached = 0
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            reserved += self._pages_needed(req, want)
            budget -= want
            batch.prefill.append((req, want))
        return batch
