"""Retrieval evaluation: does a selection policy keep the page the answer is on?

For every sample of a task (:func:`tinyattn.retrieval.tasks.make_sample`: a prompt with a needle at a given
depth, and the answer the model must produce) and every page size:

1. **one dense prefill** of the prompt up to its question (a prefill is dense for every policy; it runs in
   chunks of ``prefill_chunk`` tokens, each attending densely to everything before it, so an 8K-token prompt
   never materialises an 8K x 8K score matrix);
2. per (policy, page budget): the question, one token per step, then the answer, **greedily**, through the
   sparse decode path (:class:`tinyattn.layer.PagedAttention` with that :class:`tinyattn.layer.SparsityConfig`).
   The question is decoded rather than prefilled because a densely prefilled question would carry the needle
   into the cache of its own tokens (a layer after a full-attention layer stores what that layer read), and a
   policy keeping only the recent pages (StreamingLLM) would then read the answer from there. The question is
   what follows the prompt's last newline (the tasks' format: filler, ``"\n"``, question); an int
   ``decode_prompt_tokens`` decodes that many trailing prompt tokens instead (``0``: the first answer token comes
   from the dense prefill, the same for every policy);
3. the cache is rolled back to the prefilled prompt with :meth:`tinyattn.PagedKVCache.truncate` (no copy: the
   prompt's K/V are untouched by decode, and the box of a partial last page is recomputed exactly), ready for
   the next configuration.

H2O is stateful and observes the prefill's attention mass, as in :class:`tinyattn.models.LlamaRuntime`: when
``h2o`` is among the policies the prefill runs with an H2O policy attached, and each H2O configuration decodes
with a copy of it (``copy.deepcopy``), so every budget starts from the same observed prefill.

Metrics per row (a task, policy, context, needle depth, page size and budget, over ``samples`` samples):
``accuracy`` = share of samples whose whole greedy answer equals the expected one (exact match), and
``token_accuracy`` = mean share of answer positions whose greedy token equals the expected one.

Budgets are fractions of the context in pages (Quest's axis): ``page_budget = max(ceil(context / page_size *
fraction), num_sink_pages + max(num_recent_pages, 1))`` (:func:`page_budget_for`); rows record the fraction,
the page budget and the token budget ``page_budget * page_size``. The ``dense`` policy has no budget (``None``).

Public names: :func:`evaluate_tasks`, :class:`TaskRow`, :class:`TaskResult`, :func:`page_budget_for`,
:func:`parse_fraction`, :func:`sample_seed`, :data:`TASK_FIELDS`, :data:`DENSE`, :data:`DEFAULT_BUDGETS`.
Tables and plots: :mod:`tinyattn.retrieval.report`.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path

import torch

from ..layer import DEFAULT_GAMMA
from ..results_io import SavesRows

__all__ = ["TaskRow", "TaskResult", "evaluate_tasks", "page_budget_for", "parse_fraction", "sample_seed",
           "format_fraction", "prefill", "greedy_decode", "TASK_FIELDS", "DENSE", "QUESTION", "DEFAULT_BUDGETS", "DEFAULT_CONTEXTS", "DEFAULT_DEPTHS",
           "DEFAULT_POLICIES"]

DENSE = "dense"
QUESTION = "question"
DEFAULT_CONTEXTS = (1024, 2048, 4096, 8192)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_BUDGETS = (Fraction(1, 8), Fraction(1, 16), Fraction(1, 32), Fraction(1, 64), Fraction(1, 128))
DEFAULT_POLICIES = (DENSE, "quest", "meanstd", "oracle", "streaming", "h2o", "random")

#: The fields of a row in JSON and CSV, in order.
TASK_FIELDS = ("task", "policy", "context", "depth", "page_size", "page_budget", "budget_fraction", "token_budget",
               "accuracy", "token_accuracy", "samples")


# ---------------------------------------------------------------------------------------------- budgets
def parse_fraction(value) -> Fraction:
    """A budget fraction in ``(0, 1]`` from ``"1/16"``, ``"0.0625"``, a float or a :class:`~fractions.Fraction`.

    Raises:
        ValueError: not a number, or outside ``(0, 1]`` (the message names the value).
    """
    try:
        frac = Fraction(value.strip()) if isinstance(value, str) else Fraction(value)
    except (ValueError, TypeError, ZeroDivisionError):
        raise ValueError(f"budget fraction: expected a fraction like 1/16 or 0.0625 in (0, 1], got {value!r}") from None
    if not 0 < frac <= 1:
        raise ValueError(f"budget fraction: expected a value in (0, 1], got {value!r}")
    return frac


def format_fraction(fraction: float | Fraction | None) -> str:
    """``1/16`` for a unit fraction, else the decimal; ``"all"`` for ``None`` (dense)."""
    if fraction is None:
        return "all"
    frac = Fraction(fraction).limit_denominator(1 << 20)
    return f"1/{frac.denominator}" if frac.numerator == 1 else (f"{frac.numerator}/{frac.denominator}")


def page_budget_for(context: int, page_size: int, fraction, *, num_sink_pages: int = 0,
                    num_recent_pages: int = 1) -> int:
    """Pages per (sequence, KV head) for a budget given as a ``fraction`` of the context's pages.

    ``max(ceil(context / page_size * fraction), num_sink_pages + max(num_recent_pages, 1))``, exact (rational
    arithmetic: ``1/3`` of 96 pages is 32, not 33). The second term is the smallest budget the selection rules
    accept (:func:`tinyattn.select_pages` always keeps the sink and recent pages).

    Example: ``page_budget_for(8192, 16, Fraction(1, 16)) == 32`` (512 pages of 16 tokens).
    """
    frac = parse_fraction(fraction)
    return max(math.ceil(Fraction(context, page_size) * frac), num_sink_pages + max(num_recent_pages, 1))


def sample_seed(seed: int, task: str, context: int, depth: float, index: int) -> int:
    """The generator seed of one sample: a CRC-32 of its coordinates, the same in every run and process
    (Python's ``hash`` of a string is salted per process), different for every (task, context, depth, index)."""
    return zlib.crc32(f"{seed}/{task}/{context}/{float(depth)!r}/{index}".encode())


# ---------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class TaskRow:
    """Accuracy of one configuration over ``samples`` samples.

    ``context``: the requested prompt length in tokens. ``depth``: needle depth in ``[0, 1]``.
    ``page_budget`` (pages), ``budget_fraction`` (of the context's pages, as requested) and ``token_budget``
    (``page_budget * page_size``) are ``None`` for ``policy == "dense"``. ``accuracy``: exact-match rate of the
    whole answer; ``token_accuracy``: mean per-position match rate of the greedy answer.
    """

    task: str
    policy: str
    context: int
    depth: float
    page_size: int
    page_budget: int | None
    budget_fraction: float | None
    token_budget: int | None
    accuracy: float
    token_accuracy: float
    samples: int

    def as_dict(self) -> dict:
        """The :data:`TASK_FIELDS` in order."""
        d = asdict(self)
        return {k: d[k] for k in TASK_FIELDS}


@dataclass
class TaskResult(SavesRows):
    """The rows of :func:`evaluate_tasks` (dense first within each task, context, depth and page size) and the
    run's options (``meta`` in JSON: model shape, sink / recent pages, dense layers, seed, seconds, ...);
    ``save_json`` / ``save_csv`` from :class:`tinyattn.results_io.SavesRows`."""

    rows: list[TaskRow]
    options: dict = field(default_factory=dict)
    csv_fields = TASK_FIELDS

    def _values(self, name: str) -> list:
        return list(dict.fromkeys(getattr(r, name) for r in self.rows))

    @property
    def tasks(self) -> list[str]:
        return self._values("task")

    @property
    def policies(self) -> list[str]:
        return self._values("policy")

    @property
    def contexts(self) -> list[int]:
        return sorted(self._values("context"))

    @property
    def depths(self) -> list[float]:
        return sorted(self._values("depth"))

    @property
    def page_sizes(self) -> list[int]:
        return sorted(self._values("page_size"))

    @property
    def budget_fractions(self) -> list[float]:
        """The fractions evaluated, largest first (dense's ``None`` left out)."""
        return sorted((f for f in self._values("budget_fraction") if f is not None), reverse=True)

    def select(self, **where) -> list[TaskRow]:
        """The rows whose fields equal ``where`` (e.g. ``task="passkey", policy="quest"``)."""
        bad = [k for k in where if k not in TASK_FIELDS]
        if bad:
            raise ValueError(f"select: expected fields among {', '.join(TASK_FIELDS)}, got {bad[0]!r}")
        return [r for r in self.rows if all(getattr(r, k) == v for k, v in where.items())]

    def accuracy(self, metric: str = "accuracy", **where) -> float:
        """Sample-weighted mean of ``metric`` (``"accuracy"`` or ``"token_accuracy"``) over the rows matching
        ``where`` (e.g. over every depth of one context); NaN when none matches."""
        rows = self.select(**where)
        n = sum(r.samples for r in rows)
        return sum(getattr(r, metric) * r.samples for r in rows) / n if n else float("nan")

    def to_json(self) -> dict:
        """``{"meta": {...}, "rows": [...]}``, rows as :meth:`TaskRow.as_dict`."""
        return {"meta": self.options, "rows": [r.as_dict() for r in self.rows]}

    @classmethod
    def load_json(cls, path: str | os.PathLike) -> "TaskResult":
        """Read back what :meth:`save_json` wrote (to re-plot or tabulate a saved run)."""
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return cls(rows=[TaskRow(**r) for r in data["rows"]], options=data.get("meta", {}))


# ---------------------------------------------------------------------------------------------- evaluation
@dataclass(frozen=True)
class _Config:
    """One decode configuration of a sample: a policy and (unless dense) a budget."""

    policy: str
    fraction: Fraction | None
    page_budget: int | None


@dataclass
class _Tally:
    exact: int = 0
    token_share: float = 0.0
    samples: int = 0


def _check_options(*, tasks, contexts, depths, budgets, page_sizes, policies, samples, num_sink_pages,
                   num_recent_pages, dense_layers, decode_prompt_tokens, prefill_chunk, batch_size, n_layers):
    from tinyattn.layer import SparsityConfig
    from tinyattn.selection import POLICIES

    def ints(name, values, minimum):
        values = list(values)
        if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in values):
            raise ValueError(f"{name}: expected a non-empty list of ints >= {minimum}, got {values!r}")
        return list(dict.fromkeys(values))

    tasks = list(dict.fromkeys(tasks))
    if not tasks or not all(isinstance(t, str) and t for t in tasks):
        raise ValueError(f"tasks: expected a non-empty list of task names, got {tasks!r}")
    contexts, page_sizes = ints("contexts", contexts, 2), ints("page_sizes", page_sizes, 1)
    depths = list(dict.fromkeys(float(d) for d in depths))
    if not depths or not all(0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths: expected a non-empty list of values in [0, 1], got {depths!r}")
    fractions = list(dict.fromkeys(parse_fraction(b) for b in budgets))
    policies = [p.strip().lower() if isinstance(p, str) else p for p in policies]
    bad = [p for p in policies if p != DENSE and p not in POLICIES]
    if not policies or bad:
        raise ValueError(f"policies: expected names among {DENSE}, {', '.join(POLICIES)}, got "
                         f"{bad[0] if bad else policies!r}")
    policies = list(dict.fromkeys(policies))
    if any(p != DENSE for p in policies) and not fractions:
        raise ValueError("budgets: expected at least one fraction for the sparse policies, got none")
    checks = [("samples", samples, 1), ("prefill_chunk", prefill_chunk, 1), ("batch_size", batch_size, 1)]
    if decode_prompt_tokens != QUESTION:
        checks.append(("decode_prompt_tokens", decode_prompt_tokens, 0))
    for name, value, minimum in checks:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            also = "'question' or " if name == "decode_prompt_tokens" else ""
            raise ValueError(f"{name}: expected {also}an int >= {minimum}, got {value!r}")
    SparsityConfig(page_budget=num_sink_pages + max(num_recent_pages, 1), num_sink_pages=num_sink_pages,
                   num_recent_pages=num_recent_pages, dense_layers=dense_layers)    # ValueError naming the option
    if dense_layers > n_layers:
        raise ValueError(f"dense_layers: expected at most the model's n_layers ({n_layers}), got {dense_layers}")
    return tasks, contexts, depths, fractions, page_sizes, policies


def _configs(policies, fractions, context, page_size, num_sink_pages, num_recent_pages) -> list[_Config]:
    out = []
    for policy in policies:
        if policy == DENSE:
            out.append(_Config(DENSE, None, None))
            continue
        for frac in fractions:
            out.append(_Config(policy, frac, page_budget_for(context, page_size, frac, num_sink_pages=num_sink_pages,
                                                             num_recent_pages=num_recent_pages)))
    return out


def _newline_id(tokenizer) -> int:
    if tokenizer is None:
        from .tokenizer import CharTokenizer

        tokenizer = CharTokenizer()
    ids = tokenizer.encode("\n", bos=False)
    if len(ids) != 1:
        raise ValueError(f"decode_prompt_tokens='question' needs a tokenizer that encodes '\\n' as one token, got "
                         f"{ids}; give decode_prompt_tokens as an int")
    return ids[0]


def _prefill_length(sample, task: str, decode_prompt_tokens, newline_id: int | None) -> int:
    """Tokens of ``sample.prompt`` to prefill densely (the rest is decoded)."""
    prompt = list(sample.prompt)
    if decode_prompt_tokens == QUESTION:
        if newline_id not in prompt[1:]:
            raise ValueError(f"make_sample({task!r}) returned a prompt without a newline token ({newline_id}) before "
                             f"its question; give decode_prompt_tokens as an int")
        return len(prompt) - 1 - prompt[::-1].index(newline_id)
    if len(prompt) <= decode_prompt_tokens:
        raise ValueError(f"make_sample({task!r}) returned a prompt of {len(prompt)} tokens; decode_prompt_tokens="
                         f"{decode_prompt_tokens} needs at least {decode_prompt_tokens + 1} (one to prefill)")
    return len(prompt) - decode_prompt_tokens


def _check_sample(sample, task: str, vocab_size: int) -> None:
    prompt, answer = list(sample.prompt), list(sample.answer)
    if not answer:
        raise ValueError(f"make_sample({task!r}) returned an empty answer")
    if not prompt:
        raise ValueError(f"make_sample({task!r}) returned an empty prompt")
    ids = prompt + answer
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"make_sample({task!r}) returned token ids in [{min(ids)}, {max(ids)}], outside the model's "
                         f"vocabulary [0, {vocab_size})")


@torch.no_grad()
def evaluate_tasks(model, tokenizer=None, *, tasks: Sequence[str] = ("passkey",),
                   contexts: Sequence[int] = DEFAULT_CONTEXTS, depths: Sequence[float] = DEFAULT_DEPTHS,
                   budgets: Sequence = DEFAULT_BUDGETS, page_sizes: Sequence[int] = (16,),
                   policies: Sequence[str] = DEFAULT_POLICIES, samples: int = 4, seed: int = 0,
                   num_sink_pages: int = 0, num_recent_pages: int = 1, dense_layers: int = 0,
                   backend: str | None = None, decode_prompt_tokens: int | str = "question", prefill_chunk: int = 1024,
                   batch_size: int = 32, make_sample: Callable | None = None, progress: bool = True,
                   gamma: float = DEFAULT_GAMMA, top_p: float | None = None, rerank: str | None = None,
                   candidates: float = 1.0) -> TaskResult:
    """Greedy-answer accuracy of every (task, context, depth, page size, policy, budget) configuration.

    Args:
        model: a :class:`tinyattn.models.LlamaModel` (the shipped retrieval model:
            :func:`tinyattn.retrieval.load_retrieval_model`).
        tokenizer: passed to ``make_sample`` (``None``: the generator's default, the shipped character tokenizer).
        tasks: task names (:data:`tinyattn.retrieval.tasks.TASKS`: ``passkey``, ``multikey``, ``multihop``,
            ``decoy``).
        contexts: prompt lengths in tokens (each >= 2). depths: needle depths in ``[0, 1]``.
        budgets: page budgets as fractions of the context's pages, in ``(0, 1]`` (``"1/16"``, ``0.0625`` or a
            :class:`~fractions.Fraction`); converted per context and page size by :func:`page_budget_for`.
        page_sizes: tokens per KV page.
        policies: ``"dense"`` and names of :data:`tinyattn.selection.POLICIES`.
        samples: samples per (task, context, depth); sample ``i`` uses the seed :func:`sample_seed` ``(seed,
            task, context, depth, i)``, the same for every policy, budget and page size.
        seed: base seed; ``random``'s draws are seeded from it too (per batch), so a run is deterministic.
        num_sink_pages, num_recent_pages, dense_layers, backend: as :class:`tinyattn.models.LlamaRuntime`.
        gamma, top_p: the quest selection's page estimate and top-p budget (:class:`tinyattn.SparsityConfig`),
            applied to the ``quest`` configs (the other policies run as they are; a budget is then top-p's capacity).
        rerank, candidates: the quest selection's second stage (:class:`tinyattn.SparsityConfig`), applied to the
            ``quest`` configs; the shared cache then keeps 4-bit key codes.
        decode_prompt_tokens: the trailing prompt tokens fed through the sparse decode path before the answer:
            ``"question"`` (default) = from the prompt's last newline token on (``tokenizer.encode("\n")``, the
            default tokenizer's when ``tokenizer`` is ``None``), or an int (``0``: the first answer token is
            predicted by the dense prefill).
        prefill_chunk: tokens per dense prefill chunk (bounds the prefill's score matrix to
            ``prefill_chunk x context`` per head).
        batch_size: samples decoded together (all depths and samples of a (task, context) share a budget; a
            batch shares one cache: ``batch_size x (context + answer)`` tokens of K/V).
        make_sample: the sample generator, ``make_sample(task, *, context_tokens, depth, seed, tokenizer)`` ->
            an object with ``prompt`` and ``answer`` token-id lists (:class:`tinyattn.retrieval.tasks.Sample`);
            default :func:`tinyattn.retrieval.tasks.make_sample`.
        progress: a tqdm bar over the (sample, page size, configuration) decodes, on stderr.

    Returns:
        A :class:`TaskResult`: one :class:`TaskRow` per (task, context, depth, page size, policy, budget), in
        that nesting, dense first; ``options`` records every argument, the model's shape and the seconds taken.

    Raises:
        ValueError: an empty or out-of-range option (the message names it, with the expected and actual value),
            an unknown task (default generator) or policy, a sample whose prompt is too short or whose token ids
            fall outside the model's vocabulary.
    """
    from tqdm.auto import tqdm

    cfg = model.config
    tasks, contexts, depths, fractions, page_sizes, policies = _check_options(
        tasks=tasks, contexts=contexts, depths=depths, budgets=budgets, page_sizes=page_sizes, policies=policies,
        samples=samples, num_sink_pages=num_sink_pages, num_recent_pages=num_recent_pages,
        dense_layers=dense_layers, decode_prompt_tokens=decode_prompt_tokens, prefill_chunk=prefill_chunk,
        batch_size=batch_size, n_layers=cfg.n_layers)
    if make_sample is None:
        from .tasks import TASKS, make_sample, min_context_tokens

        unknown = [t for t in tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"tasks: expected names among {', '.join(TASKS)}, got {unknown[0]!r}")
        for task in tasks:                       # before the long run, not at the first sample of that length
            if min(contexts) < min_context_tokens(task):
                raise ValueError(f"contexts: the {task} task needs prompts of at least {min_context_tokens(task)} "
                                 f"tokens (its needles and question), got {min(contexts)}")
    if max(contexts) > cfg.max_seq_len:
        warnings.warn(f"contexts reach {max(contexts)} tokens, past the model's training context max_seq_len="
                      f"{cfg.max_seq_len}; accuracy may degrade", stacklevel=2)
    newline_id = _newline_id(tokenizer) if decode_prompt_tokens == QUESTION else None
    n_configs = {(c, ps): len(_configs(policies, fractions, c, ps, num_sink_pages, num_recent_pages))
                 for c in contexts for ps in page_sizes}
    n_samples = len(depths) * samples              # per (task, context)
    total = len(tasks) * n_samples * sum(1 + n for n in n_configs.values())
    # shown also when stderr is no terminal (a log file, CI: a long run must show it is alive): one update per 30 s
    bar = tqdm(total=total, desc="retrieval", unit="sample-config", disable=not progress,
               mininterval=0.1 if sys.stderr.isatty() else 30)
    tallies: dict[tuple, _Tally] = {}
    t0 = time.perf_counter()
    for task in tasks:
        for context in contexts:
            items, where = [], []
            for depth in depths:
                for index in range(samples):
                    s_seed = sample_seed(seed, task, context, depth, index)
                    sample = make_sample(task, context_tokens=context, depth=depth, seed=s_seed, tokenizer=tokenizer)
                    _check_sample(sample, task, cfg.vocab_size)
                    items.append((sample, _prefill_length(sample, task, decode_prompt_tokens, newline_id)))
                    where.append(depth)
            for ps in page_sizes:
                configs = _configs(policies, fractions, context, ps, num_sink_pages, num_recent_pages)
                for start in range(0, len(items), batch_size):
                    chunk = slice(start, start + batch_size)
                    bar.set_postfix_str(f"{task} context={context} page_size={ps}")
                    outcomes = _run_batch(model, items[chunk], ps, configs, num_sink_pages=num_sink_pages,
                                          seed=sample_seed(seed, task, context, -1.0, start),
                                          num_recent_pages=num_recent_pages, dense_layers=dense_layers,
                                          backend=backend, prefill_chunk=prefill_chunk,
                                          on_prefill=lambda: bar.update(1), on_config=bar.update,
                                          gamma=gamma, top_p=top_p, rerank=rerank, candidates=candidates)
                    for config, per_item in zip(configs, outcomes):
                        for depth, (exact, share) in zip(where[chunk], per_item):
                            t = tallies.setdefault((task, context, depth, ps, config), _Tally())
                            t.exact += exact
                            t.token_share += share
                            t.samples += 1
    bar.close()
    rank = {c: i for i, c in enumerate(dict.fromkeys(k[4] for k in tallies))}       # configs in policy order

    def order(key):            # rows nest task, context, depth, page size, then the configs' order
        task, context, depth, ps, c = key
        return tasks.index(task), contexts.index(context), depths.index(depth), page_sizes.index(ps), rank[c]

    rows = [TaskRow(task=task, policy=c.policy, context=context, depth=depth, page_size=ps, page_budget=c.page_budget,
                    budget_fraction=None if c.fraction is None else float(c.fraction),
                    token_budget=None if c.page_budget is None else c.page_budget * ps,
                    accuracy=t.exact / t.samples, token_accuracy=t.token_share / t.samples, samples=t.samples)
            for (task, context, depth, ps, c), t in sorted(tallies.items(), key=lambda kv: order(kv[0]))]
    options = dict(tasks=tasks, contexts=contexts, depths=depths, budgets=[format_fraction(f) for f in fractions],
                   page_sizes=page_sizes, policies=policies, samples=samples, seed=seed,
                   num_sink_pages=num_sink_pages, num_recent_pages=num_recent_pages, dense_layers=dense_layers,
                   backend=backend, decode_prompt_tokens=decode_prompt_tokens, prefill_chunk=prefill_chunk,
                   batch_size=batch_size, gamma=gamma, top_p=top_p, rerank=rerank, candidates=candidates,
                   model=dict(dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                              vocab_size=cfg.vocab_size, max_seq_len=cfg.max_seq_len,
                              parameters=sum(p.numel() for p in model.parameters())),
                   seconds=round(time.perf_counter() - t0, 1))
    return TaskResult(rows=rows, options=options)


def _run_sample(model, sample, page_size: int, configs: list[_Config], *, prefill_tokens: int, **kw
                ) -> list[tuple[bool, float]]:
    """:func:`_run_batch` of one sample: ``(exact match, share of answer tokens matched)`` per config."""
    return [o[0] for o in _run_batch(model, [(sample, prefill_tokens)], page_size, configs, **kw)]


def _run_batch(model, items: list[tuple], page_size: int, configs: list[_Config], *, seed: int, num_sink_pages: int,
               num_recent_pages: int, dense_layers: int, backend, prefill_chunk: int, on_prefill=lambda: None,
               on_config=lambda n: None, gamma: float = DEFAULT_GAMMA,
               top_p: float | None = None, rerank: str | None = None,
               candidates: float = 1.0) -> list[list[tuple[bool, float]]]:
    """``items``: ``(sample, prefill_tokens)`` pairs of one (task, context). Each sample's first
    ``prefill_tokens`` prompt tokens are prefilled once (dense) into a sequence of one shared cache; then, per
    config, the rest of every prompt and the answers are decoded greedily, all samples as one batch, from the
    prefilled cache, which is rolled back after each config (``gamma`` / ``top_p``: the quest configs' estimate and
    top-p budget). ``[config][item]`` -> ``(exact match, share of answer tokens matched)``."""
    from tinyattn.layer import PagedAttention, SparsityConfig, quest_settings
    from tinyattn.selection import H2OPolicy, RandomPolicy, get_policy

    prompts = [list(s.prompt) for s, _ in items]
    answers = [list(s.answer) for s, _ in items]
    n_prefill = [n for _, n in items]
    cache = model.new_cache(page_size=page_size, num_pages=sum(-(-(len(p) + len(a)) // page_size)
                                                               for p, a in zip(prompts, answers)),
                            key_codes=rerank is not None)
    seq_ids = [cache.add_sequence() for _ in items]

    def sparsity(budget, policy):
        return SparsityConfig(page_budget=budget, num_sink_pages=num_sink_pages, num_recent_pages=num_recent_pages,
                              dense_layers=dense_layers, policy=policy, **quest_settings(policy, gamma, top_p, rerank, candidates))

    # H2O observes the prefill's attention mass (the runtime prefills with the policy attached)
    observer = H2OPolicy() if any(c.policy == "h2o" for c in configs) else None
    prefill_attention = PagedAttention(sparsity(num_sink_pages + max(num_recent_pages, 1), observer)
                                       if observer is not None else None, backend=backend)
    first = []
    for sid, prompt, n in zip(seq_ids, prompts, n_prefill):
        first.append(prefill(model, cache, sid, prompt[:n], attention=prefill_attention, chunk=prefill_chunk))
        on_prefill()
    first_logits = torch.stack(first)
    outcomes = []
    for c in configs:
        if c.policy == DENSE:
            attention = PagedAttention(None, backend=backend)
        else:
            policy = (copy.deepcopy(observer) if c.policy == "h2o" else RandomPolicy(seed=seed)
                      if c.policy == "random" else get_policy(c.policy))
            attention = PagedAttention(sparsity(c.page_budget, policy), backend=backend)
        got = greedy_decode(model, cache, seq_ids, [p[n:] for p, n in zip(prompts, n_prefill)],
                            [len(a) for a in answers], attention=attention, first_logits=first_logits)
        for sid, n in zip(seq_ids, n_prefill):
            cache.truncate(sid, n)                   # back to the prefilled prompt for the next config
        outcomes.append([(g == a, sum(x == y for x, y in zip(g, a)) / len(a)) for g, a in zip(got, answers)])
        on_config(len(items))
    return outcomes


def prefill(model, cache, seq_id: int, tokens: list[int], *, attention, chunk: int = 1024) -> torch.Tensor:
    """Dense prefill of ``tokens`` into sequence ``seq_id`` of ``cache``, ``chunk`` tokens per forward (each
    chunk attends to every earlier token: the same attention as one pass); fp32 logits ``[V]`` of the last
    token."""
    logits = None
    for start in range(0, len(tokens), chunk):
        t = torch.tensor(tokens[start:start + chunk], dtype=torch.long, device=model.device)[None]
        logits = model(t, cache, [seq_id], sparse=False, attention=attention, last_only=True)[0]
    return logits


def greedy_decode(model, cache, seq_ids: list[int], feeds: list[list[int]], num_tokens: list[int], *, attention,
                  first_logits: torch.Tensor | None = None) -> list[list[int]]:
    """Greedy decoding of a batch, one token per row and step through ``attention`` (sparse decode).

    Row ``b`` (sequence ``seq_ids[b]`` of ``cache``) is first fed ``feeds[b]``, one token per step, then generates
    ``num_tokens[b]`` tokens (argmax of the logits). A row with an empty feed starts from the argmax of
    ``first_logits[b]`` (``[B, V]``, the prefill's last logits). Rows leave the batch when done. Returns the
    generated token ids per row.
    """
    B = len(seq_ids)
    out: list[list[int]] = [[] for _ in range(B)]
    fed = [0] * B
    pending: dict[int, int] = {}                  # row -> the token it feeds at the next step

    def advance(row: int, logits_row: torch.Tensor | None) -> None:
        if fed[row] < len(feeds[row]):
            pending[row] = feeds[row][fed[row]]
            fed[row] += 1
            return
        out[row].append(int(logits_row.argmax()))
        if len(out[row]) < num_tokens[row]:
            pending[row] = out[row][-1]

    for b in range(B):
        if num_tokens[b] > 0:
            advance(b, None if first_logits is None else first_logits[b])
    while pending:
        rows = sorted(pending)
        tokens = torch.tensor([[pending.pop(r)] for r in rows], dtype=torch.long, device=model.device)
        logits = model(tokens, cache, [seq_ids[r] for r in rows], sparse=True, attention=attention, last_only=True)
        for i, r in enumerate(rows):
            advance(r, logits[i])
    return out
