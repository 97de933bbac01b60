"""Teacher-forced evaluation of sparse decode on real text, per selection policy, page size and budget.

For each story (BOS + tokens, truncated to the context length) and each configuration (policy x page size
x page budget), every target token is predicted through the **decode** path one step at a time (the cache
starts empty, the first step feeds BOS), so every prediction made once a story holds more pages than the
budget used sparse attention. The dense reference is one dense prefill pass over each whole story,
computed once in the same run; each configuration is compared to it:

- mean NLL (nats / target token) and perplexity ``exp(mean NLL)``;
- top-1 agreement: fraction of positions whose argmax equals the dense argmax;
- KL(dense || sparse): mean over target tokens of ``sum_v p_dense(v) (log p_dense(v) - log p_sparse(v))``;
- pages read: pages attended per decode step, relative to dense (over all layers and KV heads);
- hit rate and captured mass against the oracle selection (:class:`tinyattn.selection.SelectionMetrics`):
  over the sparse layers, (row, KV head) pairs and steps where the row held more pages than the budget;
- **long-range NLL**: the mean NLL on the *long-range tokens* only (:func:`long_range_mask`): the tokens of
  a word of >= 3 letters that already occurred in the story, last time more than ``long_range_window``
  (default 64) tokens earlier — names and objects introduced early and used again later, which only a
  selection that finds the old pages can predict as well as dense;
- **repeat NLL**: a second probe whose context is the first ``(max_context - 1) // 2`` tokens of each story
  followed by the same tokens again; the mean NLL on the second copy, whose every token can be copied from
  the first copy, far outside any recent window.

Public names: :func:`evaluate`, :class:`EvalResult`, :class:`EvalRow`, :func:`format_eval_table`,
:func:`format_comparison`, :func:`plot_eval`, :func:`long_range_mask`, :func:`load_stories`.
"""

from __future__ import annotations

import math
import os
import sys
import re
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import tinyattn

from ..layer import DEFAULT_GAMMA, quest_settings
from ..metrics import PagesAttended
from ..results_io import SavesRows
from .llama import GenerationStats, LlamaModel, LlamaRuntime, SparsityConfig
from .tokenizer import Tokenizer

__all__ = ["EvalRow", "EvalResult", "load_stories", "evaluate", "format_eval_table", "format_comparison",
           "plot_eval", "long_range_mask", "JSON_FIELDS"]

END_OF_TEXT = "<|endoftext|>"
DENSE = "dense"


def load_stories(path: str | os.PathLike) -> list[str]:
    """Stories of a text file: split on ``<|endoftext|>`` when the file has it, else on blank lines.
    Each story is stripped; empty ones are dropped."""
    text = Path(path).read_text(encoding="utf-8")
    parts = text.split(END_OF_TEXT) if END_OF_TEXT in text else re.split(r"\n[ \t]*\n", text)
    return [p.strip() for p in parts if p.strip()]


def long_range_mask(tokens: list[int], pieces: list[str], *, window: int = 64, min_letters: int = 3) -> list[bool]:
    """Which positions of ``tokens`` hold a *long-range* token.

    Words are the maximal runs of letters of the text (``pieces[t]`` is the text of token id ``t``; a word
    may span several tokens). A word of at least ``min_letters`` letters is long-range when the same word
    (case-insensitive) occurred before in ``tokens`` and its previous occurrence started more than
    ``window`` tokens before this one does; every token holding a letter of it is marked. Position 0 (BOS)
    is never marked.

    Example (one token per word): ``"Tom" + 70 other tokens + "Tom"`` marks the second ``Tom`` at
    ``window = 64``, not at ``window = 80``.
    """
    words: list[tuple[str, list[int]]] = []
    current: tuple[str, list[int]] | None = None
    for i, t in enumerate(tokens):
        for ch in (pieces[t] if i > 0 else ""):
            if ch.isalpha():
                if current is None:
                    current = ("", [])
                    words.append(current)
                text, idx = current
                if not idx or idx[-1] != i:
                    idx.append(i)
                current = (text + ch, idx)
                words[-1] = current
            else:
                current = None
    mask = [False] * len(tokens)
    last_start: dict[str, int] = {}
    for text, idx in words:
        if len(text) < min_letters:
            continue
        key = text.lower()
        if key in last_start and idx[0] - last_start[key] > window:
            for i in idx:
                mask[i] = True
        last_start[key] = idx[0]
    return mask


# ---------------------------------------------------------------------------------------------- results
JSON_FIELDS = ("policy", "page_size", "page_budget", "token_budget", "nll", "ppl", "top1_agreement", "kl",
               "hit_rate", "captured_mass", "pages_attended", "long_range_nll", "long_range_tokens", "repeat_nll",
               "repeat_tokens", "pages_read_fraction", "num_tokens", "seconds")


@dataclass
class EvalRow:
    """One configuration; ``policy == "dense"`` (``page_budget is None``) is the dense reference.

    ``hit_rate``/``captured_mass`` are NaN when not measured or when no step selected (every row fit the
    budget); ``long_range_nll``/``repeat_nll`` are NaN when the probe has no token.
    """

    policy: str
    page_size: int | None
    page_budget: int | None
    token_budget: int | None
    num_tokens: int
    nll: float
    top1_agreement: float
    kl: float
    pages_read_fraction: float
    hit_rate: float = float("nan")
    captured_mass: float = float("nan")
    pages_attended: float = float("nan")     # with top_p: mean pages kept per (sparse layer, KV head, row, step)
    long_range_nll: float = float("nan")
    long_range_tokens: int = 0
    repeat_nll: float = float("nan")
    repeat_tokens: int = 0
    seconds: float = 0.0

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    @property
    def name(self) -> str:
        return DENSE if self.page_budget is None else str(self.page_budget)

    def as_dict(self) -> dict:
        """The :data:`JSON_FIELDS`, NaN as ``None``."""
        d = asdict(self)
        d["ppl"] = self.ppl
        return {k: (None if isinstance(d[k], float) and math.isnan(d[k]) else d[k]) for k in JSON_FIELDS}


@dataclass
class EvalResult(SavesRows):
    """``rows[0]`` is the dense reference, then one row per (page size, policy, budget), in that order;
    ``save_json`` / ``save_csv`` from :class:`tinyattn.results_io.SavesRows`."""

    rows: list[EvalRow]
    num_stories: int
    num_tokens: int
    page_size: int
    max_context: int
    options: dict = field(default_factory=dict)
    page_sizes: list[int] = field(default_factory=list)
    policies: list[str] = field(default_factory=list)
    max_sequence_tokens: int = 0     # the longest sequence evaluated (BOS included, repeat probes too)
    csv_fields = JSON_FIELDS

    @property
    def dense(self) -> EvalRow:
        return self.rows[0]

    def row(self, page_budget: int | None, policy: str | None = None, page_size: int | None = None) -> EvalRow:
        """The row of ``page_budget`` (``None`` = dense) for ``policy`` (default: the first one) and
        ``page_size`` (default: the first one)."""
        if page_budget is None:
            return self.dense
        policy = policy or (self.policies[0] if self.policies else "quest")
        page_size = page_size or self.page_size
        for r in self.rows:
            if r.page_budget == page_budget and r.policy == policy and r.page_size == page_size:
                return r
        raise KeyError((page_budget, policy, page_size))

    def to_json(self) -> dict:
        """``{"meta": {...}, "rows": [...]}``, one row per :data:`JSON_FIELDS` dict (dense first)."""
        return {"meta": dict(num_stories=self.num_stories, num_tokens=self.num_tokens, max_context=self.max_context,
                             page_sizes=self.page_sizes, policies=self.policies, **self.options),
                "rows": [r.as_dict() for r in self.rows]}


# ---------------------------------------------------------------------------------------------- evaluation
@dataclass
class _Rows:
    """Per-row, per-target results of one pass (index ``t`` predicts ``seq[t + 1]``)."""

    nll: list[torch.Tensor]
    agree: list[torch.Tensor]
    kl: list[torch.Tensor]


def _budgets_for(page_size: int, page_budgets, token_budgets) -> list[int]:
    if token_budgets is None:
        return list(page_budgets or [])
    out = []
    for tb in token_budgets:
        if tb % page_size:
            raise ValueError(f"token_budgets: {tb} tokens is not a whole number of pages of {page_size} tokens")
        out.append(tb // page_size)
    return out


@torch.no_grad()
def evaluate(model: LlamaModel, tokenizer: Tokenizer, stories: list[str], *, page_size: int = 16,
             page_budgets: list[int] | None = None, policies=("quest",), page_sizes: list[int] | None = None,
             token_budgets: list[int] | None = None, num_sink_pages: int | None = None, num_recent_pages: int = 1,
             dense_layers: int = 0, backend: str | None = None, max_context: int | None = None,
             long_range_window: int = 64, repeat_probe: bool = True, selection_metrics: bool = True,
             progress: bool = True, kv_cache_dtype: str = "auto", box_dtype: str = "auto", gamma: float = DEFAULT_GAMMA,
             top_p: float | None = None, rerank: str | None = None, candidates: float = 1.0) -> EvalResult:
    """Teacher-forced NLL, perplexity, agreement, KL, hit rate and the long-range probes, per configuration.

    Args:
        model: the model.
        tokenizer: its tokenizer; each story is ``tokenizer.encode(story, bos=True)``.
        stories: the texts, run together as one batch (with their repeat probes).
        page_size: tokens per KV page (ignored when ``page_sizes`` is given).
        page_budgets: budgets in pages per sequence and KV head, the same for every page size; or
        token_budgets: budgets in tokens, converted per page size (each must be a multiple of it).
        policies: names of :data:`tinyattn.selection.POLICIES` (or instances), one pass each.
        page_sizes: page sizes to evaluate (default ``[page_size]``).
        num_sink_pages, num_recent_pages, dense_layers, backend: as :class:`LlamaRuntime`.
        max_context: tokens per story including BOS (default: the model's ``max_seq_len``).
        long_range_window: tokens back beyond which a repeated word counts as long-range.
        repeat_probe: also run the story-repeated-twice probe (in the same batch).
        selection_metrics: measure hit rate and captured mass against the oracle (a dense pass per sparse
            layer and step).
        progress: a tqdm bar over the configurations (and one over the steps of each), on stderr.
        kv_cache_dtype: KV storage format of the sparse passes (``"auto"``, ``"fp16"``, ``"bf16"``, ``"int8"``,
            ``"fp8_e4m3"``); the dense reference keeps the model dtype, so NLL, agreement and KL compare each
            format's sparse decode with the full-precision dense one. ``options["kv_bytes_per_token"]`` records the
            format's cache bytes per token (pools, boxes and scales, all layers).
        box_dtype: dtype of the page boxes of the sparse passes (``"auto"``, ``"fp32"``, ``"bf16"``, ``"fp16"``;
            narrower boxes are rounded outward), as :class:`LlamaRuntime`.
        gamma, top_p: the quest selection's page estimate and top-p budget (:class:`SparsityConfig`), applied to
            the passes of ``quest`` (the other policies run as they are); with ``top_p`` the row's
            ``pages_attended`` is the mean number of pages each (sparse layer, KV head, row, step) kept, at most
            its ``page_budget`` (``pages_read_fraction`` counts the capacity).
        rerank, candidates: the quest selection's second stage (:class:`SparsityConfig`), applied to the passes of
            ``quest`` as ``gamma`` / ``top_p`` are.
    """
    from tqdm.auto import tqdm

    from tinyattn.selection import SelectionMetrics, get_policy

    if not stories:
        raise ValueError("stories is empty: nothing to evaluate")
    if page_budgets is not None and token_budgets is not None:
        raise ValueError("give page_budgets or token_budgets, not both")
    from tinyattn.cache import PagedKVCache

    cfg = model.config
    probe = PagedKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim,
                         page_size=page_sizes[0] if page_sizes else page_size, num_pages=1, dtype=model.dtype,
                         kv_cache_dtype=kv_cache_dtype, box_dtype=box_dtype)    # ValueError: an unknown format
    kv_bytes_per_token = probe.kv_bytes / probe.page_size
    del probe
    LlamaRuntime(model, backend=backend, kv_cache_dtype=kv_cache_dtype)   # a format the backend cannot run: now
    max_context = model.config.max_seq_len if max_context is None else max_context
    if max_context < 2:
        raise ValueError(f"max_context must be >= 2 (BOS + one target), got {max_context}")
    page_sizes = list(page_sizes) if page_sizes else [page_size]
    policy_names = [get_policy(p).name for p in policies]
    if not policy_names:
        raise ValueError("policies is empty")
    configs = []  # (page_size, budget, policy) in table order; all validated before the long run
    for ps in page_sizes:
        for pol, name in zip(policies, policy_names):
            for b in _budgets_for(ps, page_budgets, token_budgets):
                SparsityConfig(page_budget=b, num_sink_pages=num_sink_pages, num_recent_pages=num_recent_pages,
                               dense_layers=dense_layers, policy=pol, **quest_settings(pol, gamma, top_p, rerank, candidates))
                configs.append((ps, b, pol, name))

    encoded = [tokenizer.encode(s, bos=True) for s in stories]
    seqs = [e[:max_context] for e in encoded if len(e) >= 2]
    if not seqs:
        raise ValueError("no story has a token to predict after BOS")
    n_main = len(seqs)
    num_targets = sum(len(s) - 1 for s in seqs)
    pieces = [tokenizer.decode([i]) for i in range(tokenizer.vocab_size)]
    long_masks = [torch.tensor(long_range_mask(s, pieces, window=long_range_window)[1:]) for s in seqs]
    probe_masks: list[torch.Tensor] = []
    if repeat_probe:
        half = (max_context - 1) // 2
        for e in encoded:
            body = e[1:1 + half]
            if body:
                seqs.append(e[:1] + body + body)
                probe_masks.append(torch.arange(2 * len(body)) >= len(body))  # targets of the second copy
    longest = max(len(s) for s in seqs)
    if longest > model.config.max_seq_len:        # the same warning as LlamaRuntime.generate
        warnings.warn(f"sequences reach {longest} tokens, past the model's training context "
                      f"max_seq_len={model.config.max_seq_len}; quality will degrade", stacklevel=2)

    # dense reference: one dense prefill per sequence, log-probs of every target position
    dense_rt = LlamaRuntime(model, page_size=page_sizes[0], backend=backend)
    cache = dense_rt.new_cache([len(s) for s in seqs])
    dense_logp: list[torch.Tensor] = []
    dense_nll: list[torch.Tensor] = []
    for s in tqdm(seqs, desc="dense", disable=None if progress else True, leave=False):
        sid = cache.add_sequence()
        logp = torch.log_softmax(dense_rt.prefill(cache, sid, s, last_only=False)[:-1].float(), dim=-1)
        dense_logp.append(logp)
        dense_nll.append(-logp.gather(-1, torch.tensor(s[1:])[:, None]).squeeze(1))
        cache.free(sid)
    dense_top = [lp.argmax(-1) for lp in dense_logp]

    def summarize(nll, agree, kl):
        main = slice(0, n_main)
        all_nll = torch.cat(nll[main])
        lr = torch.cat([x[m] for x, m in zip(nll[main], long_masks)])
        rep = torch.cat([x[m] for x, m in zip(nll[n_main:], probe_masks)]) if probe_masks else torch.empty(0)
        nan = float("nan")
        return dict(num_tokens=num_targets, nll=float(all_nll.mean()),
                    top1_agreement=float(torch.cat(agree[main]).float().mean()), kl=float(torch.cat(kl[main]).mean()),
                    long_range_nll=float(lr.mean()) if lr.numel() else nan, long_range_tokens=int(lr.numel()),
                    repeat_nll=float(rep.mean()) if rep.numel() else nan, repeat_tokens=int(rep.numel()))

    zeros = [torch.zeros(len(x)) for x in dense_nll]
    rows = [EvalRow(policy=DENSE, page_size=None, page_budget=None, token_budget=None, pages_read_fraction=1.0,
                    **summarize(dense_nll, [torch.ones(len(x), dtype=torch.bool) for x in dense_nll], zeros))]

    bar = tqdm(configs, desc="configs", disable=not progress, unit="config",   # also into a log: every 30 s
               mininterval=0.1 if sys.stderr.isatty() else 30)
    for ps, budget, pol, name in bar:
        bar.set_postfix_str(f"{name} page_size={ps} page_budget={budget} ({budget * ps} tokens)")
        t0 = time.perf_counter()
        rt = LlamaRuntime(model, page_size=ps, page_budget=budget, num_sink_pages=num_sink_pages,
                          num_recent_pages=num_recent_pages, dense_layers=dense_layers, backend=backend,
                          policy=get_policy(pol) if not isinstance(pol, str) else pol, kv_cache_dtype=kv_cache_dtype,
                          box_dtype=box_dtype, **quest_settings(pol, gamma, top_p, rerank, candidates))
        rt.sparsity.policy.reset()
        # top_p keeps a varying count: the pages each sparse step kept, counted on the device (one sync at the end)
        rt.attention.attended = attended = PagesAttended() if rt.sparsity.top_p is not None else None
        metrics = SelectionMetrics() if selection_metrics else None
        stats = GenerationStats()
        res = _teacher_forced(rt, seqs, dense_logp, dense_top, stats, metrics, progress,
                              f"{name} S={ps} K={budget}")
        frac = stats.pages_read / stats.pages_dense if stats.pages_dense else 1.0
        nan = float("nan")
        rows.append(EvalRow(policy=name, page_size=ps, page_budget=budget, token_budget=budget * ps,
                            pages_read_fraction=frac,
                            hit_rate=metrics.hit_rate if metrics is not None else nan,
                            captured_mass=metrics.captured_mass if metrics is not None else nan,
                            pages_attended=attended.summary()["mean"] if attended is not None else nan,
                            seconds=time.perf_counter() - t0, **summarize(res.nll, res.agree, res.kl)))
    bar.close()
    return EvalResult(rows=rows, num_stories=n_main, num_tokens=num_targets, page_size=page_sizes[0],
                      max_context=max_context, page_sizes=page_sizes, policies=list(dict.fromkeys(policy_names)),
                      max_sequence_tokens=longest,
                      options=dict(num_sink_pages="auto" if num_sink_pages is None else num_sink_pages,
                                   num_recent_pages=num_recent_pages,
                                   dense_layers=dense_layers, backend=backend, long_range_window=long_range_window,
                                   repeat_probe=repeat_probe, page_budgets=page_budgets, token_budgets=token_budgets,
                                   kv_cache_dtype=kv_cache_dtype, box_dtype=box_dtype,
                                   kv_bytes_per_token=kv_bytes_per_token, gamma=gamma, top_p=top_p,
                                   rerank=rerank, candidates=candidates))


def _teacher_forced(rt: LlamaRuntime, seqs, dense_logp, dense_top, stats, metrics, progress, desc) -> _Rows:
    """Feed every sequence token by token through ``rt.decode`` (one batch); per-target NLL, agreement, KL."""
    from tqdm.auto import tqdm

    B = len(seqs)
    cache = rt.new_cache([len(s) for s in seqs])
    seq_ids = [cache.add_sequence() for _ in seqs]
    nll = [torch.empty(len(s) - 1) for s in seqs]
    agree = [torch.empty(len(s) - 1, dtype=torch.bool) for s in seqs]
    kl = [torch.empty(len(s) - 1) for s in seqs]
    max_len = max(len(s) for s in seqs)
    with tinyattn.value_checks(False):  # cache-built inputs: skip the per-call host syncs of the data checks
        for t in tqdm(range(max_len - 1), desc=desc, disable=None if progress else True, leave=False):
            rows_t = [b for b in range(B) if len(seqs[b]) - 1 > t]  # rows with a target at t + 1
            logits = rt.decode(cache, [seq_ids[b] for b in rows_t], [seqs[b][t] for b in rows_t], stats,
                               selection_metrics=metrics)
            logp = torch.log_softmax(logits.float(), dim=-1)  # [b, V]
            targets = torch.tensor([seqs[b][t + 1] for b in rows_t])
            dlogp = torch.stack([dense_logp[b][t] for b in rows_t])  # [b, V]
            step_nll = -logp.gather(-1, targets[:, None]).squeeze(1)
            step_agree = logp.argmax(-1) == torch.stack([dense_top[b][t] for b in rows_t])
            step_kl = (dlogp.exp() * (dlogp - logp)).sum(-1)
            for i, b in enumerate(rows_t):
                nll[b][t], agree[b][t], kl[b][t] = step_nll[i], step_agree[i], step_kl[i]
                if len(seqs[b]) - 1 == t + 1:  # finished rows leave the batch
                    cache.free(seq_ids[b])
    return _Rows(nll, agree, kl)


# ---------------------------------------------------------------------------------------------- reports
def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.1%}"


def _num(x: float, fmt: str = ".4f") -> str:
    return "n/a" if math.isnan(x) else format(x, fmt)


def format_eval_table(result: EvalResult) -> str:
    """Markdown tables, one per (page size, policy): the dense row, then one row per page budget."""
    o = result.options
    dense = result.dense
    head = (f"{result.num_stories} stories, {result.num_tokens} target tokens "
            f"({dense.long_range_tokens} long-range: a word seen > {o.get('long_range_window')} tokens earlier"
            + (f"; repeat probe: {dense.repeat_tokens} second-copy tokens" if dense.repeat_tokens else "")
            + f"), context <= {result.max_context}")
    blocks = [head]
    groups: dict[tuple, list[EvalRow]] = {}
    for r in result.rows[1:]:
        groups.setdefault((r.page_size, r.policy), []).append(r)
    if not groups:
        groups[(result.page_size, result.policies[0] if result.policies else "quest")] = []
    for (ps, policy), rows in groups.items():
        fused = tinyattn.selection.get_policy(policy).fused  # those that take gamma / top_p
        lines = [
            f"page_size={ps}, policy={policy}, num_sink_pages={o.get('num_sink_pages')}, "
            f"num_recent_pages={o.get('num_recent_pages')}, dense_layers={o.get('dense_layers')}"
            + ("" if o.get("kv_cache_dtype", "auto") == "auto" else
               f", kv_cache_dtype={o['kv_cache_dtype']} ({o['kv_bytes_per_token']:.0f} cache bytes per token; "
               f"the dense row keeps the model dtype)")
            + ("" if o.get("box_dtype", "auto") == "auto" else f", box_dtype={o['box_dtype']}")
            # always named for the fused quest selection: the default moved from Quest's bound (1.0) to 0.25
            + (f", gamma={o.get('gamma', DEFAULT_GAMMA)}" if fused else "")
            + ("" if o.get("top_p") is None or not fused else
               f", top_p={o['top_p']} (pages read: the capacity; then the pages attended, mean per sparse layer, "
               f"KV head, row and step)")
            + ("" if o.get("rerank") is None or not fused else
               f", rerank={o['rerank']} (candidates {o.get('candidates', 1.0):g} x the budget)"),
            "",
            "| page_budget | token budget | mean NLL | ppl | top-1 agreement | KL(dense‖sparse) | pages read "
            "| hit rate | captured mass | long-range NLL | repeat NLL |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in [dense] + rows:
            tb = "all" if r.token_budget is None else str(r.token_budget)
            hit = "" if r.page_budget is None else _pct(r.hit_rate)
            mass = "" if r.page_budget is None else _pct(r.captured_mass)
            lines.append(f"| {r.name} | {tb} | {r.nll:.4f} | {r.ppl:.3f} | {r.top1_agreement:.2%} | {r.kl:.5f} | "
                         f"{r.pages_read_fraction:.1%}"
                         + ("" if math.isnan(r.pages_attended) else f", attended {r.pages_attended:.1f}")
                         + f" | {hit} | {mass} | {_num(r.long_range_nll)} | "
                         f"{_num(r.repeat_nll)} |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


_METRICS = {
    "nll": ("mean NLL (nats/token)", ".4f"),
    "top1_agreement": ("top-1 agreement with dense", ".1%"),
    "kl": ("KL(dense‖sparse)", ".4f"),
    "hit_rate": ("hit rate (against the oracle)", ".1%"),
    "captured_mass": ("captured attention mass", ".1%"),
    "long_range_nll": ("long-range-token NLL", ".4f"),
    "repeat_nll": ("repeat-probe NLL (second copy)", ".4f"),
}


def format_comparison(result: EvalResult, metric: str = "nll", *, relative: bool = False) -> str:
    """A Markdown table of one metric: a row per (page size, token budget), a column per policy, and the
    dense value. ``relative=True`` shows the change from dense in percent (NLL-like metrics)."""
    if metric not in _METRICS:
        raise ValueError(f"metric: expected one of {', '.join(_METRICS)}, got {metric!r}")
    _, fmt = _METRICS[metric]
    dense_v = getattr(result.dense, metric)
    policies = result.policies
    lines = ["| page size | token budget | " + " | ".join(policies) + " | dense |",
             "|---" * (len(policies) + 3) + "|"]
    cells: dict[tuple, dict[str, float]] = {}
    for r in result.rows[1:]:
        cells.setdefault((r.page_size, r.token_budget), {})[r.policy] = getattr(r, metric)
    for (ps, tb), vals in cells.items():
        out = []
        for p in policies:
            v = vals.get(p, float("nan"))
            if math.isnan(v):
                out.append("n/a")
            elif relative:
                out.append(f"{format(v, fmt)} ({(v / dense_v - 1):+.1%})")
            else:
                out.append(format(v, fmt))
        dv = "" if metric in ("hit_rate", "captured_mass") else _num(dense_v, fmt)
        lines.append(f"| {ps} | {tb} | " + " | ".join(out) + f" | {dv} |")
    return "\n".join(lines)


def plot_eval(result: EvalResult, out_dir: str | os.PathLike,
              metrics=("nll", "top1_agreement", "long_range_nll", "repeat_nll", "hit_rate", "captured_mass"),
              prefix: str = "") -> list[Path]:
    """One PNG per metric (``<prefix><metric>.png``): the metric vs token budget, one panel per page size,
    one line per policy, the dense value as a dashed line. NLL-like metrics get a second row with the
    excess over dense on a symlog scale (the gaps near dense are invisible on a linear axis). Returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    styles = {"quest": ("C0", "o"), "questmass": ("C2", "D"), "meanstd": ("C9", "s"), "oracle": ("k", "*"), "streaming": ("C1", "v"),
              "h2o": ("C3", "^"), "random": ("C7", "x")}
    for metric in metrics:
        label, _ = _METRICS[metric]
        dv = getattr(result.dense, metric)
        if math.isnan(dv) and all(math.isnan(getattr(r, metric)) for r in result.rows[1:]):
            continue                    # nothing measured (no long-range token, repeat probe off): no empty PNG
        excess = metric in ("nll", "long_range_nll", "repeat_nll", "kl") and not math.isnan(dv)
        n_rows = 2 if excess else 1
        fig, axes = plt.subplots(n_rows, len(result.page_sizes), figsize=(5.2 * len(result.page_sizes), 3.6 * n_rows),
                                 squeeze=False, sharey="row")
        for col, ps in enumerate(result.page_sizes):
            ticks = sorted({r.token_budget for r in result.rows[1:] if r.page_size == ps})
            for row in range(n_rows):
                ax = axes[row][col]
                for i, pol in enumerate(result.policies):
                    rs = sorted((r for r in result.rows[1:] if r.policy == pol and r.page_size == ps),
                                key=lambda r: r.token_budget)
                    pts = [(r.token_budget, getattr(r, metric)) for r in rs if not math.isnan(getattr(r, metric))]
                    if row == 1:
                        pts = [(x, y - dv) for x, y in pts]
                    if not pts:
                        continue
                    color, marker = styles.get(pol, (f"C{i}", "o"))
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=pol,
                            linewidth=1.6, markersize=6)
                if row == 0 and metric not in ("hit_rate", "captured_mass") and not math.isnan(dv):
                    ax.axhline(dv, color="k", linestyle="--", linewidth=1, label="dense")
                if row == 1:
                    ax.set_yscale("symlog", linthresh=1e-3)  # log above 1e-3 nats, linear through 0
                    ax.axhline(0.0, color="k", linestyle="--", linewidth=1)
                ax.set_xscale("log", base=2)
                ax.set_xticks(ticks)
                ax.set_xticklabels([str(t) for t in ticks])
                ax.grid(True, which="both", alpha=0.3)
                if metric in ("top1_agreement", "hit_rate", "captured_mass"):
                    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
                if row == n_rows - 1:
                    ax.set_xlabel(f"token budget (page size {ps}; context <= {result.max_context})")
                else:
                    ax.set_title(f"page size {ps}", fontsize=10)
        axes[0][0].set_ylabel(label)
        if excess:
            axes[1][0].set_ylabel("NLL - dense NLL (symlog)")
        if axes[0][-1].get_legend_handles_labels()[0]:
            axes[0][-1].legend(fontsize=8)
        fig.suptitle(f"{label} vs budget: {result.num_stories} stories, {result.num_tokens} target tokens",
                     fontsize=11)
        fig.tight_layout()
        path = out_dir / f"{prefix}{metric}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
