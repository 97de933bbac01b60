"""Teacher-forced evaluation of query-aware sparse decode on real text.

For each story (BOS + tokens, truncated to the context length) and each page budget, every target
token is predicted through the **decode** path one step at a time (the cache starts empty, the
first step feeds BOS), so every prediction after the first page used sparse attention. The dense
baseline is one dense prefill pass over each whole story, computed in the same run; sparse rows are
compared to it:

- mean NLL (nats / target token) and perplexity ``exp(mean NLL)``;
- top-1 agreement: fraction of positions whose argmax equals the dense argmax;
- KL(dense || sparse): mean over target tokens of ``sum_v p_dense(v) (log p_dense(v) - log p_sparse(v))``;
- pages read: pages attended per decode step, relative to dense (over all layers and KV heads).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .llama import GenerationStats, LlamaModel, LlamaRuntime
from .tokenizer import Tokenizer

__all__ = ["EvalRow", "EvalResult", "load_stories", "evaluate", "format_eval_table"]

END_OF_TEXT = "<|endoftext|>"


def load_stories(path: str | os.PathLike) -> list[str]:
    """Stories of a text file: split on ``<|endoftext|>`` when the file has it, else on blank lines.
    Each story is stripped; empty ones are dropped."""
    text = Path(path).read_text(encoding="utf-8")
    parts = text.split(END_OF_TEXT) if END_OF_TEXT in text else re.split(r"\n[ \t]*\n", text)
    return [p.strip() for p in parts if p.strip()]


@dataclass
class EvalRow:
    """One line of the table; ``page_budget is None`` is the dense baseline."""

    page_budget: int | None
    token_budget: int | None
    num_tokens: int
    nll: float
    top1_agreement: float
    kl: float
    pages_read_fraction: float

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    @property
    def name(self) -> str:
        return "dense" if self.page_budget is None else str(self.page_budget)


@dataclass
class EvalResult:
    rows: list[EvalRow]
    num_stories: int
    num_tokens: int
    page_size: int
    max_context: int
    options: dict = field(default_factory=dict)

    @property
    def dense(self) -> EvalRow:
        return self.rows[0]

    def row(self, page_budget: int | None) -> EvalRow:
        for r in self.rows:
            if r.page_budget == page_budget:
                return r
        raise KeyError(page_budget)


@torch.no_grad()
def evaluate(model: LlamaModel, tokenizer: Tokenizer, stories: list[str], *, page_size: int,
             page_budgets: list[int], num_sink_pages: int = 0, num_recent_pages: int = 1, dense_layers: int = 0,
             backend: str | None = None, max_context: int | None = None, progress: bool = True) -> EvalResult:
    """Teacher-forced NLL, perplexity, top-1 agreement and KL vs dense, for each page budget.

    Args:
        model: the model.
        tokenizer: its tokenizer; each story is ``tokenizer.encode(story, bos=True)``.
        stories: the texts, run together as one batch.
        page_size: tokens per KV page.
        page_budgets: the budgets (pages per sequence and KV head) to evaluate.
        num_sink_pages, num_recent_pages, dense_layers, backend: as :class:`LlamaRuntime`.
        max_context: tokens per story including BOS (default: the model's ``max_seq_len``).
        progress: show tqdm progress bars (on stderr).
    """
    from tqdm.auto import tqdm

    if not stories:
        raise ValueError("stories is empty: nothing to evaluate")
    max_context = model.config.max_seq_len if max_context is None else max_context
    if max_context < 2:
        raise ValueError(f"max_context must be >= 2 (BOS + one target), got {max_context}")
    seqs = [tokenizer.encode(s, bos=True)[:max_context] for s in stories]
    seqs = [s for s in seqs if len(s) >= 2]
    if not seqs:
        raise ValueError("no story has a token to predict after BOS")
    B = len(seqs)
    num_targets = sum(len(s) - 1 for s in seqs)

    # dense baseline: one dense prefill per story, log-probs of every target position
    dense_rt = LlamaRuntime(model, page_size=page_size, backend=backend)
    cache = dense_rt.new_cache([len(s) for s in seqs])
    dense_logp: list[torch.Tensor] = []  # [len-1, V] per story
    dense_nll = 0.0
    for s in tqdm(seqs, desc="dense", disable=not progress, leave=False):
        sid = cache.add_sequence()
        logits = dense_rt.prefill(cache, sid, s, last_only=False)[:-1]  # predicts s[1:]
        logp = torch.log_softmax(logits.float(), dim=-1)
        dense_logp.append(logp)
        dense_nll -= float(logp.gather(-1, torch.tensor(s[1:])[:, None]).sum())
        cache.free(sid)
    rows = [EvalRow(None, None, num_targets, dense_nll / num_targets, 1.0, 0.0, 1.0)]

    for budget in page_budgets:
        rt = LlamaRuntime(model, page_size=page_size, page_budget=budget, num_sink_pages=num_sink_pages,
                          num_recent_pages=num_recent_pages, dense_layers=dense_layers, backend=backend)
        cache = rt.new_cache([len(s) for s in seqs])
        seq_ids = [cache.add_sequence() for _ in seqs]
        stats = GenerationStats()
        nll = kl = 0.0
        agree = 0
        max_len = max(len(s) for s in seqs)
        for t in tqdm(range(max_len - 1), desc=f"page_budget={budget}", disable=not progress, leave=False):
            rows_t = [b for b in range(B) if len(seqs[b]) - 1 > t]  # rows with a target at t + 1
            logits = rt.decode(cache, [seq_ids[b] for b in rows_t], [seqs[b][t] for b in rows_t], stats)
            logp = torch.log_softmax(logits.float(), dim=-1)  # [b, V]
            targets = torch.tensor([seqs[b][t + 1] for b in rows_t])
            dlogp = torch.stack([dense_logp[b][t] for b in rows_t])  # [b, V]
            nll -= float(logp.gather(-1, targets[:, None]).sum())
            agree += int((logp.argmax(-1) == dlogp.argmax(-1)).sum())
            kl += float((dlogp.exp() * (dlogp - logp)).sum())
            for b in range(B):  # finished rows leave the batch
                if len(seqs[b]) - 1 == t + 1:
                    cache.free(seq_ids[b])
        frac = stats.pages_read / stats.pages_dense if stats.pages_dense else 1.0
        rows.append(EvalRow(budget, budget * page_size, num_targets, nll / num_targets, agree / num_targets,
                            kl / num_targets, frac))
    return EvalResult(rows=rows, num_stories=B, num_tokens=num_targets, page_size=page_size,
                      max_context=max_context,
                      options=dict(num_sink_pages=num_sink_pages, num_recent_pages=num_recent_pages,
                                   dense_layers=dense_layers, backend=backend))


def format_eval_table(result: EvalResult) -> str:
    """A Markdown table: the dense row, then one row per page budget."""
    o = result.options
    lines = [
        f"{result.num_stories} stories, {result.num_tokens} target tokens, context <= {result.max_context}, "
        f"page_size={result.page_size}, num_sink_pages={o.get('num_sink_pages')}, "
        f"num_recent_pages={o.get('num_recent_pages')}, dense_layers={o.get('dense_layers')}",
        "",
        "| page_budget | token budget | mean NLL | ppl | top-1 agreement | KL(dense‖sparse) | pages read |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result.rows:
        tb = "all" if r.token_budget is None else str(r.token_budget)
        lines.append(f"| {r.name} | {tb} | {r.nll:.4f} | {r.ppl:.3f} | {r.top1_agreement:.2%} | {r.kl:.5f} | "
                     f"{r.pages_read_fraction:.1%} |")
    return "\n".join(lines)
