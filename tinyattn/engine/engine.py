"""``Engine``: requests in, tokens out; continuous batching, chunked prefill, preemption, plug-ins.

One :meth:`Engine.step`:

1. the :class:`tinyattn.engine.Scheduler` picks the step's work under the token budget and the page pool,
   preempting the newest requests when pages run out;
2. one decode forward runs every decoding request (one token each, sparse layers select pages), then one
   dense forward per prefill chunk (:class:`tinyattn.engine.runner.ModelRunner`: the model's math with the
   plug-ins' hooks);
3. new tokens are drawn (per request: greedy, or its own seeded generator), stop conditions checked, and
   finished requests free their pages and come back as :class:`RequestOutput`.

Decode and prefill run as separate forwards within a step: :meth:`LlamaModel.forward` takes one query count
per call, and a prefill chunk alone gives exactly the runtime's prefill when the chunk is the whole prompt.
"""

from __future__ import annotations

import random
import time
import warnings

import torch

from tinyattn.layer import DEFAULT_GAMMA, SparsityConfig
from tinyattn.metrics import PagesAttended

from .params import SamplingParams
from .plugins import Plugin
from .request import Request, RequestOutput, RequestStatus
from .runner import ModelRunner
from .scheduler import Scheduler
from .stats import EngineStats

__all__ = ["Engine"]


class Engine:
    """A serving loop over one :class:`tinyattn.models.LlamaModel` and one page pool.

    Args:
        model: the model (its dtype and device are the cache's).
        page_size: tokens per KV page. num_pages: pages in the pool: the engine's whole KV memory.
        page_budget, num_sink_pages, num_recent_pages, dense_layers, policy: decode sparsity, as
            :class:`tinyattn.SparsityConfig` (``page_budget=None``: dense; ``num_sink_pages=None``: one sink
            page when ``page_budget >= 16``).
        gamma: the page estimate of the ``quest`` selection, in ``[0, 1]``: ``q·c + gamma·|q|·r`` over each page's
            key box (default :data:`tinyattn.layer.DEFAULT_GAMMA`; ``1`` is Quest's bound, issue 35 measured ``0.25``
            best on RULER); as :class:`tinyattn.SparsityConfig`.
        top_p: ``None`` (default: ``page_budget`` pages) or a number in ``(0, 1]``: the ``quest`` selection keeps the
            fewest best pages whose estimated attention mass reaches ``top_p``, ``page_budget`` being the capacity
            (Twilight, arXiv 2502.02770). ``gamma`` / ``top_p`` with another policy: ``ValueError`` naming
            ``policy``; out of range: ``ValueError`` naming the argument (``TypeError`` for a non-number).
            :attr:`stats` ``pages_attended`` counts the pages each sparse step attended.
        rerank, candidates: the ``quest`` selection's second stage (:class:`tinyattn.SparsityConfig`): ``"int4"``
            re-ranks ``ceil(candidates · page_budget)`` candidates by their attention mass estimated from 4-bit key
            codes, which the engine's cache then keeps (issue 35; docs/design_rerank.md).
        backend: ``None`` (by device), ``"torch"`` or ``"triton"``.
        max_num_batched_tokens: tokens per step, decode and prefill chunks together (vLLM's name); a prompt
            longer than this is prefilled in chunks over several steps.
        max_num_seqs: requests running (holding pages) at once.
        recompute: how a preempted request is rebuilt: ``"replay"`` (default; prompt by prefill, then its
            generated tokens one decode step each: exactly the K/V of its first run, so preemption never changes
            an output) or ``"prefill"`` (everything by prefill, vLLM's way: faster; with a page budget the
            rebuilt tokens' K/V come from dense attention, so later tokens may differ).
        eos_token_id: the token that ends a request unless ``ignore_eos`` (llama2.c: 2); ``None``: none.
        plugins: :class:`tinyattn.engine.Plugin` instances (see :mod:`tinyattn.engine.plugins`).
        clock: the time source of the timings (seconds).
        kv_cache_dtype: the pool's storage format (``"auto"`` = the model dtype, ``"fp16"``, ``"bf16"``, ``"int8"``,
            ``"fp8_e4m3"``; see :class:`tinyattn.PagedKVCache`); ``ValueError`` naming the supported set otherwise.
        box_dtype: dtype of the page boxes (``"auto"``, exact; ``"fp32"``, ``"bf16"``, ``"fp16"`` rounded outward;
            see :mod:`tinyattn.ops.kv_cache.torch_impl`).
        cuda_graphs: replay decode forwards as CUDA graphs captured per batch-size bucket (``1, 2, 4, ...`` up to
            ``max_num_seqs``; :mod:`tinyattn.models.graphs`), as :class:`tinyattn.models.LlamaRuntime` does. A step
            with an early-exit hook, a plug-in that changes a layer's sparsity, a profiler, or more rows than
            ``max_num_seqs`` runs eagerly; so do prefill chunks. Where no step can be captured (a model off CUDA,
            the torch backend, an int8 / fp8 pool, a policy other than Quest) one warning says why and every step
            runs eagerly. The pool gets one extra page for the padding rows (``num_pages`` stays what requests
            may use).

    Example::

        engine = Engine(model, page_size=16, num_pages=64, page_budget=4, backend="torch")
        outs = engine.generate([tok.encode("Once upon a time")], SamplingParams(max_new_tokens=32))
    """

    def __init__(self, model, *, page_size: int = 16, num_pages: int, page_budget: int | None = None,
                 num_sink_pages: int | None = None, num_recent_pages: int = 1, dense_layers: int = 0, policy="quest",
                 backend: str | None = None, max_num_batched_tokens: int = 256, max_num_seqs: int = 64,
                 recompute: str = "replay", eos_token_id: int | None = 2, plugins=(), clock=time.perf_counter,
                 kv_cache_dtype: str = "auto", box_dtype: str = "auto", cuda_graphs: bool = False,
                 gamma: float = DEFAULT_GAMMA, top_p: float | None = None, rerank: str | None = None,
                 candidates: float = 1.0):
        for name, v in (("page_size", page_size), ("num_pages", num_pages),
                        ("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if backend not in (None, "torch", "triton"):
            raise ValueError(f"backend: expected None, 'torch' or 'triton', got {backend!r}")
        if recompute not in ("replay", "prefill"):
            raise ValueError(f"recompute: expected 'replay' or 'prefill', got {recompute!r}")
        n_layers = model.config.n_layers
        if dense_layers > n_layers:
            raise ValueError(f"dense_layers ({dense_layers}) exceeds the model's n_layers ({n_layers})")
        plugins = tuple(plugins)
        bad = [p for p in plugins if not isinstance(p, Plugin)]
        if bad:
            raise TypeError(f"plugins: expected tinyattn.engine.Plugin instances, got {type(bad[0]).__name__}")
        self.model = model
        self.sparsity = SparsityConfig(page_budget=page_budget, num_sink_pages=num_sink_pages,
                                       num_recent_pages=num_recent_pages, dense_layers=dense_layers, policy=policy,
                                       gamma=gamma, top_p=top_p, rerank=rerank, candidates=candidates)
        self.page_size, self.num_pages = page_size, num_pages
        self.eos_token_id = eos_token_id
        self.plugins = plugins
        self.clock = clock
        self.cuda_graphs = bool(cuda_graphs)
        self.graphs_off = None        # why requested graphs cannot be used (a sentence), else None
        if self.cuda_graphs:
            from tinyattn.models.graphs import why_not_graphed

            self.graphs_off = why_not_graphed(model, self.sparsity, backend=backend, kv_cache_dtype=kv_cache_dtype)
            if self.graphs_off is not None:
                warnings.warn(f"cuda_graphs=True: {self.graphs_off}; decode steps run eagerly", stacklevel=2)
        graphed = self.cuda_graphs and self.graphs_off is None
        self._reserved_pages = int(graphed)            # the padding rows' scratch page, outside num_pages
        self.cache = model.new_cache(page_size=page_size, num_pages=num_pages + self._reserved_pages,
                                     kv_cache_dtype=kv_cache_dtype, box_dtype=box_dtype,
                                     key_codes=self.sparsity.rerank is not None)
        self.runner = ModelRunner(model, self.cache, self.sparsity, backend=backend, plugins=plugins)
        self._logit_hooks = [p for p in plugins if type(p).after_logits is not Plugin.after_logits]
        if graphed:
            from tinyattn.models.graphs import DecodeGraphs

            self.runner.graphs = DecodeGraphs(model, self.cache, self.sparsity, backend=backend,
                                              max_batch=max_num_seqs, max_pages_per_seq=num_pages)
        self.scheduler = Scheduler(self.cache, max_num_batched_tokens=max_num_batched_tokens,
                                   max_num_seqs=max_num_seqs, recompute=recompute, on_release=self._on_release)
        self.stats = EngineStats(num_pages=num_pages,
                                 pages_attended=None if self.sparsity.is_dense else PagesAttended())
        self.runner.attended = self.stats.pages_attended
        self._requests: dict[int, Request] = {}
        self._done: list[RequestOutput] = []          # finished outside a step (abort, max_new_tokens=0)
        self._next_id = 0

    def __repr__(self) -> str:
        s = self.sparsity
        return (f"Engine(page_size={self.page_size}, num_pages={self.num_pages}, page_budget={s.page_budget}, "
                f"policy={s.policy.name!r}, gamma={s.gamma}, top_p={s.top_p}, rerank={s.rerank!r}, "
                f"plugins={list(self.plugins)})")

    # ---- requests -----------------------------------------------------------------------------------
    def add_request(self, prompt_ids, params: SamplingParams | None = None, *, arrival_time: float | None = None
                    ) -> int:
        """Queue a request; return its id. ``arrival_time`` (engine clock) defaults to now.

        Raises:
            ValueError for an empty prompt, token ids outside the vocabulary, or a request that cannot fit the
            pool even alone (prompt + ``max_new_tokens``), naming the sizes.
        """
        if isinstance(prompt_ids, str):
            raise TypeError("prompt_ids: expected a list of token ids, got text; encode it first (Tokenizer.encode)")
        prompt = [int(t) for t in (prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else prompt_ids)]
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
        vocab = self.model.config.vocab_size
        if not prompt:
            raise ValueError("prompt_ids: expected at least one token (start with BOS)")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt_ids: token ids must be in [0, {vocab}), got min {min(prompt)} max {max(prompt)}")
        most = len(prompt) + max(params.max_new_tokens - 1, 0)      # tokens in the cache at the last step
        need = -(-most // self.page_size)
        if need > self.num_pages:
            raise ValueError(
                f"request too large for the KV pool: {len(prompt)} prompt tokens + up to "
                f"{max(params.max_new_tokens - 1, 0)} generated tokens in the cache need {need} pages of "
                f"{self.page_size} tokens, the pool has {self.num_pages} pages ({self.num_pages * self.page_size} "
                f"tokens); shorten the prompt or max_new_tokens, or build the engine with more num_pages")
        rid, self._next_id = self._next_id, self._next_id + 1
        now = self.clock()
        req = Request(request_id=rid, prompt=prompt, params=params,
                      arrival_time=now if arrival_time is None else arrival_time)
        if params.temperature > 0:
            req.generator = torch.Generator(device=self.model.device)
            req.generator.manual_seed(params.seed if params.seed is not None else random.SystemRandom().getrandbits(63))
        self.stats.requests_added += 1
        if params.max_new_tokens == 0:
            self._done.append(self._finish(req, "length", now))
        else:
            self._requests[rid] = req
            self.scheduler.add(req)
        return rid

    def abort(self, request_id: int) -> bool:
        """Stop a request now; its pages go back to the pool, and it comes back from the next :meth:`step` with
        ``finish_reason="abort"`` and the tokens it had. False if it is unknown or already finished."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self.scheduler.release(req)
        self.stats.requests_aborted += 1
        self._done.append(self._finish(req, "abort", self.clock()))
        return True

    def has_unfinished_requests(self) -> bool:
        """Whether a request is queued or running, or a finished one is waiting to be returned by :meth:`step`
        (an abort, ``max_new_tokens=0``): loop ``while engine.has_unfinished_requests(): engine.step()``."""
        return bool(self._requests) or bool(self._done)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---- the loop -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return the requests that finished (in finishing order)."""
        finished, self._done = self._done, []
        batch = self.scheduler.schedule()
        self.stats.preemptions += len(batch.preempted)
        self.stats.recomputed_tokens = self.scheduler.recomputed_tokens
        if batch.empty:
            if self.scheduler.has_work():       # cannot happen: every request fits the pool alone
                raise RuntimeError(f"Engine.step: the scheduler found nothing to run for {len(self._requests)} "
                                   f"unfinished requests ({self.cache.num_free_pages} free pages); please report")
            return finished
        self.stats.steps += 1
        self.stats.step_tokens.append(batch.num_tokens)
        self.stats.decode_batch_sizes.append(len(batch.decode))
        self.stats.peak_pages = max(self.stats.peak_pages, self.scheduler.pages_in_use() - self._reserved_pages
                                    + self._new_pages(batch))
        if batch.decode:
            reqs = batch.decode
            tokens = torch.tensor([[r.token_at(r.num_cached)] for r in reqs], dtype=torch.long)
            logits, exit_layer = self.runner.forward(tokens, [r.seq_id for r in reqs], decode=True, requests=reqs)
            self.stats.decode_rows += len(reqs)
            if self.runner.graphs is not None:
                self.stats.graphed_steps = self.runner.graphs.replays
            if exit_layer is not None:
                skipped = self.model.config.n_layers - 1 - exit_layer
                self.stats.early_exits += int((skipped > 0).sum())
                self.stats.layers_skipped += int(skipped.sum())
            now = self.clock()
            # greedy rows' tokens in one host read for the batch (one sync on a GPU, not one per row)
            greedy = None if self._logit_hooks else logits.argmax(-1).tolist()
            for row, req in enumerate(reqs):
                req.num_cached += 1
                if req.num_cached == req.num_tokens:
                    self._sample(req, logits[row], now, finished, greedy=None if greedy is None else greedy[row])
        for req, n in batch.prefill:
            tokens = torch.tensor([req.tokens_from(req.num_cached, n)], dtype=torch.long)
            logits, _ = self.runner.forward(tokens, [req.seq_id], decode=False, requests=[req])
            self.stats.prefill_tokens += n
            req.num_cached += n
            if req.num_cached == req.num_tokens:
                self._sample(req, logits[0], self.clock(), finished)
        return finished

    def _new_pages(self, batch) -> int:
        return sum(self.scheduler._pages_needed(r, 1) for r in batch.decode) + sum(
            self.scheduler._pages_needed(r, n) for r, n in batch.prefill)

    def _sample(self, req: Request, logits: torch.Tensor, now: float, finished: list, greedy: int | None = None
                ) -> None:
        """Draw ``req``'s next token from ``logits`` ``[V]`` (``greedy``: its argmax, already read, when no plug-in
        changes logits); stop and finish it if it ends."""
        for p in self.plugins:
            logits = p.after_logits(req, logits)
        params = req.params
        if params.temperature == 0:
            tok = greedy if greedy is not None else int(logits.argmax())
        else:
            probs = torch.softmax(logits[None].float() / params.temperature, dim=-1)
            tok = int(torch.multinomial(probs, 1, generator=req.generator))
        req.output.append(tok)
        self.stats.generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
        if (not params.ignore_eos and tok == self.eos_token_id) or tok in params.stop_token_ids:
            reason = "stop"
        elif len(req.output) >= params.max_new_tokens:
            reason = "length"
        else:
            return
        self.scheduler.release(req)
        finished.append(self._finish(req, reason, now))

    def _finish(self, req: Request, reason: str, now: float) -> RequestOutput:
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.finish_time = reason, now
        self._requests.pop(req.request_id, None)
        self.stats.requests_finished += 1
        return RequestOutput.of(req)

    def _on_release(self, req: Request) -> None:
        for policy in self.runner.policies:
            if policy.stateful:
                policy.reset([req.seq_id])
        for p in self.plugins:
            p.release(req)

    # ---- batch API ----------------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[list[int]]:
        """Run ``prompts`` (token-id lists) to completion; their new tokens, in input order. ``params``: one
        :class:`SamplingParams` for all, or one per prompt. Requests queued before run alongside; those that
        finish meanwhile come back from the next :meth:`step`. The model's weights are read once per call
        (``LlamaModel.frozen_weights``): a weight changed by another thread meanwhile is seen by the next call."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], str)):
            raise TypeError("prompts: expected a list of token-id lists, got text; encode it first")
        plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: expected one SamplingParams or {len(prompts)} (one per prompt), got {len(plist)}")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        want, got, others = set(ids), {}, []
        with self.model.frozen_weights():     # weights checked once per call, not per step (as LlamaRuntime)
            while want - set(got):
                for out in self.step():
                    if out.request_id in want:
                        got[out.request_id] = out.tokens
                    else:
                        others.append(out)
        self._done.extend(others)           # requests queued by add_request: the next step() returns them
        return [got[i] for i in ids]
