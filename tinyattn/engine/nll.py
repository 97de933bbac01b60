"""Teacher-forced NLL through the engine's forward (plug-ins included): the quality side of a plug-in.

Every target token is predicted through the **decode** path, one step at a time, all sequences in one batch
(the cache starts empty, the first step feeds BOS), as :func:`tinyattn.models.evaluate` does; without plug-ins
the two give the same NLL (``tests/engine/test_engine.py``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

import tinyattn
from tinyattn.layer import DEFAULT_GAMMA, SparsityConfig

from .runner import ModelRunner

__all__ = ["NLLResult", "teacher_forced_nll"]


@dataclass
class NLLResult:
    """``nll``: mean over target tokens (nats); ``num_tokens``: targets; ``seconds``: wall time of the steps;
    ``early_exits`` / ``layers_skipped``: decode rows that exited early and the layers they skipped."""

    nll: float
    num_tokens: int
    seconds: float
    early_exits: int = 0
    layers_skipped: int = 0

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    @property
    def layers_skipped_per_token(self) -> float:
        return self.layers_skipped / self.num_tokens if self.num_tokens else 0.0


@torch.no_grad()
def teacher_forced_nll(model, sequences: list[list[int]], *, page_size: int = 16, page_budget: int | None = None,
                       num_sink_pages: int | None = None, num_recent_pages: int = 1, dense_layers: int = 0,
                       policy="quest", backend: str | None = None, plugins=(), gamma: float = DEFAULT_GAMMA,
                       top_p: float | None = None, rerank: str | None = None, candidates: float = 1.0) -> NLLResult:
    """Mean NLL of ``sequences`` (token lists, BOS first, >= 2 tokens each) under the engine's decode path with
    the given sparsity (``gamma`` / ``top_p`` / ``rerank``: the quest selection's, as :class:`tinyattn.SparsityConfig`) and
    ``plugins``."""
    seqs = [list(s) for s in sequences if len(s) >= 2]
    if not seqs:
        raise ValueError("sequences: expected at least one sequence of >= 2 tokens (BOS + a target)")
    sparsity = SparsityConfig(page_budget=page_budget, num_sink_pages=num_sink_pages,
                              num_recent_pages=num_recent_pages, dense_layers=dense_layers, policy=policy,
                              gamma=gamma, top_p=top_p, rerank=rerank, candidates=candidates)
    sparsity.policy.reset()
    cache = model.new_cache(page_size=page_size, num_pages=sum(-(-len(s) // page_size) for s in seqs),
                            key_codes=sparsity.rerank is not None)
    runner = ModelRunner(model, cache, sparsity, backend=backend, plugins=plugins)
    ids = [cache.add_sequence() for _ in seqs]
    total, count, exits, skipped = 0.0, 0, 0, 0
    n_layers = model.config.n_layers
    t0 = time.perf_counter()
    with tinyattn.value_checks(False):
        for t in range(max(len(s) for s in seqs) - 1):
            rows = [b for b, s in enumerate(seqs) if len(s) - 1 > t]
            tokens = torch.tensor([[seqs[b][t]] for b in rows], dtype=torch.long)
            logits, exit_layer = runner.forward(tokens, [ids[b] for b in rows], decode=True)
            logp = torch.log_softmax(logits.float(), dim=-1)
            targets = torch.tensor([seqs[b][t + 1] for b in rows])
            total += float(-logp.gather(-1, targets[:, None]).sum())
            count += len(rows)
            if exit_layer is not None:
                s = n_layers - 1 - exit_layer
                exits += int((s > 0).sum())
                skipped += int(s.sum())
            for b in rows:
                if len(seqs[b]) - 1 == t + 1:
                    cache.free(ids[b])
    return NLLResult(nll=total / count, num_tokens=count, seconds=time.perf_counter() - t0,
                     early_exits=exits, layers_skipped=skipped)
