"""Command line: ``python -m tinyattn {generate,eval,convert,finetune,serve-bench}`` (also installed as ``tinyattn``).

``generate`` runs a llama2.c checkpoint with dense prefill and query-aware sparse decode and
prints the text, then a stats block; ``eval`` prints teacher-forced NLL / perplexity / agreement
with dense for a list of page budgets. Run ``python -m tinyattn COMMAND --help`` for the options.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .argtypes import non_negative_float, non_negative_int, positive_int, positive_int_list

__all__ = ["main", "build_parser"]

_PROG = "tinyattn"                # the console script; ``python -m tinyattn`` passes its own name
_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


class CLIError(Exception):
    """A user error: printed as ``tinyattn COMMAND: error: ...`` with exit status 2."""


def _add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", type=Path, default=None,
                   help="llama2.c checkpoint (legacy format); default: stories260K, the 260K-parameter "
                        "TinyStories model shipped with tinyattn (tinyattn/data/)")
    g.add_argument("--tokenizer", type=Path, default=None,
                   help="llama2.c tokenizer .bin; default: the shipped stories260K's tok512.bin (512 tokens; "
                        "give the model's own tokenizer with another --model)")
    g.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32",
                   help="weight and KV-cache dtype (default: fp32)")
    g.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="PyTorch CPU threads (default: 1 for small models, dim < 512, whose ops are too small to "
                        "split; PyTorch's default otherwise)")


# the names of tinyattn.selection.POLICIES (kept here so that --help does not import torch; a test checks them)
_POLICY_NAMES = ("quest", "meanstd", "oracle", "streaming", "h2o", "random")
_POLICY_HELP = ("quest = query-aware min/max bounding box (Quest/TinyServe); meanstd = the box from per-page key "
                "mean +- 1 std; oracle = the pages of most true attention mass (upper bound); streaming = sink + "
                "recent pages (StreamingLLM); h2o = heavy hitters by accumulated attention (H2O); random")


def _policy_list(text: str) -> list[str]:
    items = [t.strip().lower() for t in text.split(",")]
    bad = [t for t in items if t not in _POLICY_NAMES]
    if not text.strip() or bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(_POLICY_NAMES)}, "
                                         f"got {text!r}")
    return list(dict.fromkeys(items))


def _add_attention_options(p: argparse.ArgumentParser, *, budgets: bool) -> None:
    g = p.add_argument_group("paged / sparse attention")
    if budgets:
        g.add_argument("--page-size", type=positive_int, default=16,
                       help="tokens per KV page (default: 16; see --page-sizes)")
        g.add_argument("--page-sizes", type=positive_int_list, default=None, metavar="S1,S2,...",
                       help="comma-separated page sizes to evaluate (default: --page-size)")
        b = g.add_mutually_exclusive_group()
        b.add_argument("--page-budgets", type=positive_int_list, default=None, metavar="K1,K2,...",
                       help="comma-separated page budgets to evaluate, pages per sequence and KV head "
                            "(default: 2,4,8)")
        b.add_argument("--token-budgets", type=positive_int_list, default=None, metavar="T1,T2,...",
                       help="budgets in tokens instead, divided by each page size (e.g. 32,64,128,256)")
        g.add_argument("--policies", type=_policy_list, default=["quest"], metavar="P1,P2,...",
                       help=f"page-selection policies to compare (default: quest): {_POLICY_HELP}")
    else:
        g.add_argument("--page-size", type=positive_int, default=16, help="tokens per KV page (default: 16)")
        g.add_argument("--page-budget", type=positive_int, default=None, metavar="K",
                       help="pages attended per sequence and KV head at each decode step; "
                            "omit for dense decode")
        g.add_argument("--policy", choices=_POLICY_NAMES, default="quest",
                       help=f"page-selection policy (default: quest): {_POLICY_HELP}")
        g.add_argument("--selection-metrics", action="store_true",
                       help="also report the hit rate and captured attention mass of the selections against the "
                            "oracle (a dense attention pass per sparse layer and step)")
    g.add_argument("--num-sink-pages", type=non_negative_int, default=0,
                   help="leading pages always kept (default: 0)")
    g.add_argument("--num-recent-pages", type=non_negative_int, default=1,
                   help="trailing pages always kept; the page being written is always kept (default: 1)")
    g.add_argument("--dense-layers", type=non_negative_int, default=0,
                   help="leading layers that stay dense during decode; Quest keeps 2 (default: 0)")
    g.add_argument("--backend", choices=["torch", "triton"], default=None,
                   help="attention backend (default: by device: triton on CUDA, torch on CPU); "
                        "'triton' on a CPU-only machine runs the Triton interpreter (slow)")
    from .ops.boxes import BOX_DTYPES
    from .ops.quant import KV_CACHE_DTYPES

    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="KV cache storage format (vLLM's option): auto = the model dtype (--dtype), fp16, bf16, "
                        "or int8 / fp8_e4m3 with one fp32 scale per (page, KV head) for K and for V (about 0.3x "
                        "fp32's bytes; fp8_e4m3 on the triton backend needs an sm_89+ GPU)" + (
                            "; eval: the sparse passes use it, the dense reference keeps the model dtype"
                            if budgets else "") + " (default: auto)")
    g.add_argument("--box-dtype", choices=sorted(BOX_DTYPES), default="auto",
                   help="dtype of the per-page key bounding boxes that Quest scores: auto = the cache's dtype (fp32 "
                        "for int8 / fp8), exact; bf16 / fp16 halve the bytes scoring reads and are rounded outward "
                        "(k_min down, k_max up) so the score stays an upper bound (default: auto)")
    from .profiler import add_cli_option

    add_cli_option(g)


def build_parser(prog: str = _PROG) -> argparse.ArgumentParser:
    """The ``tinyattn`` parser; ``prog`` is the name usage lines and examples show (``tinyattn`` for the console
    script, ``python -m tinyattn`` when run as a module)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="tinyattn: query-aware sparse paged attention (Quest / TinyServe) on a real model. With no "
                    "--model / --tokenizer / --data, every command uses the stories260K model and TinyStories "
                    "text shipped with the package.",
        epilog="examples:\n"
               f"  {prog} generate --max-new-tokens 200 --temperature 0\n"
               f"  {prog} generate --prompt 'Once upon a time' --page-size 16 --page-budget 4\n"
               f"  {prog} eval --page-size 16 --page-budgets 2,4,8",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    gen = sub.add_parser(
        "generate", help="generate text with dense prefill and sparse decode",
        description="Generate text from a llama2.c checkpoint: each prompt is prefilled densely, then the batch "
                    "decodes together through query-aware sparse paged attention. Prints the text of each prompt "
                    "then a stats block (tokens/s, pages read per step vs dense, KV bytes).",
        epilog="examples:\n"
               f"  {prog} generate --max-new-tokens 200 --page-size 16 --page-budget 4 \\\n"
               "      --prompt 'Once upon a time' --prompt 'Tom had a dog'\n"
               f"  {prog} generate --model stories15M.bin --tokenizer tokenizer.bin --prompt 'Once upon a time'",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_options(gen)
    g = gen.add_argument_group("generation")
    g.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="prompt text; repeat for a batch (default: one empty prompt, i.e. BOS only)")
    g.add_argument("--max-new-tokens", type=non_negative_int, default=200,
                   help="tokens to generate per prompt; a row also stops at EOS, and at BOS (the start of a next "
                        "story, as llama2.c's run.c stops) unless --no-stop-at-bos (default: 200)")
    g.add_argument("--no-stop-at-bos", action="store_true",
                   help="keep generating past a BOS token (the model then starts a new story)")
    g.add_argument("--temperature", type=non_negative_float, default=0.0,
                   help="sampling temperature; 0 = greedy (default: 0)")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampling torch.Generator (default: 0)")
    g.add_argument("--no-stats", action="store_true", help="print only the text")
    _add_attention_options(gen, budgets=False)
    gen.set_defaults(func=_cmd_generate)

    ev = sub.add_parser(
        "eval", help="teacher-forced NLL / perplexity / agreement with dense per page budget",
        description="Teacher-forced evaluation: the stories of FILE (split on <|endoftext|>, or on blank lines) run "
                    "as a batch; every target token is predicted through the sparse decode path step by step, "
                    "and compared with one dense pass. Prints a table per page size and policy: the dense row, "
                    "then one row per budget (mean NLL in nats/token, perplexity, top-1 agreement with dense, "
                    "KL(dense||sparse), pages read vs dense, hit rate and captured attention mass against the "
                    "oracle selection, NLL on the long-range tokens, NLL on the second copy of a story repeated "
                    "twice); see docs/accuracy.md.",
        epilog="examples:\n"
               f"  {prog} eval --page-size 16 --page-budgets 2,4,8\n"
               f"  {prog} eval --data my_stories.txt --page-size 16 --page-budgets 2,4,8\n"
               f"  {prog} eval --page-sizes 8,16 --token-budgets 32,64,128,256 \\\n"
               "      --policies quest,meanstd,oracle,streaming,h2o,random \\\n"
               "      --json docs/accuracy/results.json --plot-dir docs/accuracy",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_options(ev)
    g = ev.add_argument_group("data")
    g.add_argument("--data", type=Path, default=None,
                   help="text file of stories; default: 7 TinyStories validation stories shipped with tinyattn "
                        "(tinyattn/data/tinystories_valid_excerpt.txt)")
    g.add_argument("--max-stories", type=positive_int, default=None, metavar="N",
                   help="evaluate only the first N stories (default: all)")
    g.add_argument("--max-context", type=positive_int, default=None, metavar="N",
                   help="tokens per story including BOS (default: the model's seq_len)")
    g.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    g.add_argument("--long-range-window", type=positive_int, default=64, metavar="W",
                   help="a word of >= 3 letters is long-range when it occurred before, more than W tokens "
                        "earlier (default: 64)")
    g.add_argument("--no-repeat-probe", action="store_true",
                   help="skip the probe that repeats each story's first half (saves about a third of the time)")
    g.add_argument("--no-selection-metrics", action="store_true",
                   help="skip the hit rate / captured mass against the oracle (a dense pass per sparse layer)")
    g = ev.add_argument_group("output")
    g.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="write one row per policy x page size x budget (and the dense row) as JSON")
    g.add_argument("--csv", type=Path, default=None, metavar="PATH", help="the same rows as CSV")
    g.add_argument("--plot-dir", type=Path, default=None, metavar="DIR",
                   help="write PNG plots (NLL, top-1 agreement, long-range NLL, repeat NLL, hit rate, captured "
                        "mass vs budget; one line per policy, one panel per page size) into DIR")
    _add_attention_options(ev, budgets=True)
    ev.set_defaults(func=_cmd_eval)
    _add_convert_command(sub, prog)
    _add_finetune_command(sub, prog)
    _add_serve_bench_command(sub, prog)
    _add_train_retrieval_command(sub, prog)
    return parser


def _add_serve_bench_command(sub, prog: str) -> None:
    """``serve-bench``: Poisson request stream through the engine; TTFT, TPOT, throughput, NLL per configuration."""
    from .engine import serve_bench

    sb = sub.add_parser("serve-bench", help="serve a Poisson request stream through the engine: TTFT, TPOT, "
                                            "throughput, preemptions per configuration (dense, quest, early exit, ...)",
                        description=serve_bench.DESCRIPTION,
                        epilog=serve_bench.EPILOG.replace("python -m tinyattn", prog),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_options(sb)
    serve_bench.add_arguments(sb)
    sb.set_defaults(func=serve_bench.run)


def _add_finetune_command(sub, prog: str) -> None:
    """``finetune``: chunked long-context fine-tuning with KV retention (full / recency / gradient)."""
    from .training import finetune

    ft = sub.add_parser("finetune", help="chunked long-context fine-tuning with KV retention (full / recency / gradient)",
                        description=finetune.__doc__.split("\n\n")[0].replace("``finetune``: ", ""),
                        epilog=finetune.EPILOG.replace("python -m tinyattn", prog),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    finetune.add_arguments(ft)
    ft.set_defaults(func=finetune.run)


def _add_train_retrieval_command(sub, prog: str) -> None:
    """``train-retrieval``: train the small retrieval model (tinyattn.retrieval) from scratch."""
    from .retrieval import command

    tr = sub.add_parser("train-retrieval", help="train the small retrieval model (passkey, multikey, multihop, "
                                                "decoy) from scratch on the CPU",
                        description=command.DESCRIPTION, epilog=command.EPILOG.replace("python -m tinyattn", prog),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    command.add_arguments(tr)
    tr.set_defaults(func=command.run)


def _add_convert_command(sub, prog: str) -> None:
    """``convert``: llama2.c -> Hugging Face checkpoint (needs the ``hf`` extra only when run)."""
    from .integrations import convert

    c = sub.add_parser("convert", help="llama2.c checkpoint -> Hugging Face checkpoint (Llama, or SmolLM3 for hybrid models)",
                       description=convert.DESCRIPTION, epilog=convert.EPILOG.replace("python -m tinyattn", prog),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    convert.add_arguments(c)
    c.set_defaults(func=convert.run)


def _prepare_backend(backend: str | None) -> None:
    """``--backend triton`` without CUDA needs the interpreter, which must be chosen before triton loads."""
    if backend != "triton" or os.environ.get("TRITON_INTERPRET") == "1":
        return
    import torch

    if not torch.cuda.is_available():
        if "triton" in sys.modules:
            raise CLIError("--backend triton: no CUDA device, and triton was imported before TRITON_INTERPRET=1 "
                           "could be set; run with TRITON_INTERPRET=1")
        os.environ["TRITON_INTERPRET"] = "1"
        from .ops import plan
        plan._INTERPRET = None                   # re-read: the ops choose their backend from it
        print("note: no CUDA device; running the Triton kernels in the interpreter (TRITON_INTERPRET=1, slow)",
              file=sys.stderr)


def _load(args):
    import torch

    from . import assets
    from .models import LlamaModel, Tokenizer

    model_path = assets.resolve_file(args.model, "--model", assets.default_model_path)
    tok_path = assets.resolve_file(args.tokenizer, "--tokenizer", assets.default_tokenizer_path)
    _prepare_backend(args.backend)
    model = LlamaModel.from_llama2c(model_path, dtype=getattr(torch, _DTYPES[args.dtype]))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif model.config.dim < 512:
        torch.set_num_threads(1)  # tiny matmuls: threads only add synchronisation (20x slower on a busy machine)
    tokenizer = Tokenizer(tok_path)
    if tokenizer.vocab_size != model.config.vocab_size:
        hint = "" if args.tokenizer is not None else " (the default tokenizer is stories260K's: give --tokenizer)"
        raise CLIError(f"--tokenizer: {tok_path} has {tokenizer.vocab_size} tokens but the model {model_path} "
                       f"expects vocab_size={model.config.vocab_size}{hint}")
    return model, tokenizer


def _cmd_generate(args) -> int:
    import warnings

    from .models import LlamaRuntime

    model, tokenizer = _load(args)
    runtime = LlamaRuntime(model, page_size=args.page_size, page_budget=args.page_budget,
                           num_sink_pages=args.num_sink_pages, num_recent_pages=args.num_recent_pages,
                           dense_layers=args.dense_layers, backend=args.backend, policy=args.policy,
                           selection_metrics=args.selection_metrics, kv_cache_dtype=args.kv_cache_dtype,
                           box_dtype=args.box_dtype)
    texts = args.prompt if args.prompt else [""]
    prompts = [tokenizer.encode(t, bos=True) for t in texts]
    from .profiler import cli_profile, print_cli_report

    with warnings.catch_warnings(), cli_profile(args.profile) as prof:
        warnings.simplefilter("ignore")  # past-context warning: reported below instead
        out = runtime.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               seed=args.seed, eos_id=tokenizer.eos_id,
                               stop_token_ids=() if args.no_stop_at_bos else (tokenizer.bos_id,))
    for i, (p, new) in enumerate(zip(prompts, out.tokens)):
        if len(prompts) > 1:
            print(f"=== [{i}] ===")
        print(tokenizer.decode(p + new))
    if not args.no_stats:
        s = runtime.sparsity
        mode = "dense" if s.page_budget is None else (
            f"page_budget={s.page_budget} ({s.page_budget * args.page_size} tokens), "
            f"num_sink_pages={s.num_sink_pages}, num_recent_pages={s.num_recent_pages}, dense_layers={s.dense_layers}, "
            f"policy={s.policy.name}")
        print("---")
        from .ops.plan import resolve_backend

        backend = resolve_backend(args.backend, model.device)
        print(f"attention:          page_size={args.page_size}, {mode}, backend={backend}"
              + ("" if args.kv_cache_dtype == "auto" else f", kv_cache_dtype={args.kv_cache_dtype}"))
        print(out.stats.format())
    longest = max(len(p) + len(n) for p, n in zip(prompts, out.tokens))
    budget = runtime.sparsity.page_budget
    if budget is not None and not args.no_stats and budget * args.page_size >= longest:
        print(f"note: the budget ({budget} pages = {budget * args.page_size} tokens) covers every row's whole "
              f"context ({longest} tokens at most): every step attended densely")
    _warn_past_context(longest, model.config.max_seq_len)
    print_cli_report(prof, args.profile)
    return 0


def _warn_past_context(longest: int, max_seq_len: int) -> None:
    """The one past-the-training-context warning of generate and eval (on stderr, after the output)."""
    if longest > max_seq_len:
        print(f"warning: sequences reached {longest} tokens, past the model's training context "
              f"({max_seq_len}); quality will degrade", file=sys.stderr)


def _cmd_eval(args) -> int:
    import warnings

    from .models import evaluate, format_eval_table, load_stories
    from .models.evaluate import format_comparison, plot_eval

    from . import assets

    data = assets.resolve_file(args.data, "--data", assets.default_text_path)
    page_sizes = args.page_sizes or [args.page_size]
    if args.token_budgets is None and args.page_budgets is None:
        args.page_budgets = [2, 4, 8]
    for ps in page_sizes:
        for tb in args.token_budgets or []:
            if tb % ps:
                raise CLIError(f"--token-budgets: {tb} tokens is not a whole number of pages of {ps} tokens")
    model, tokenizer = _load(args)
    # validate the sparsity options once, before the long run
    from .models import SparsityConfig

    for ps in page_sizes:
        for b in args.page_budgets or [tb // ps for tb in args.token_budgets]:
            SparsityConfig(page_budget=b, num_sink_pages=args.num_sink_pages,
                           num_recent_pages=args.num_recent_pages, dense_layers=args.dense_layers)
    if args.dense_layers > model.config.n_layers:
        raise CLIError(f"--dense-layers ({args.dense_layers}) exceeds the model's n_layers ({model.config.n_layers})")
    stories = load_stories(data)
    if args.max_stories is not None:
        stories = stories[: args.max_stories]
    if not stories:
        raise CLIError(f"--data: no stories in {data}")
    max_context = args.max_context
    if max_context is not None and max_context < 2:
        raise CLIError(f"--max-context must be >= 2, got {max_context}")
    from .profiler import cli_profile, print_cli_report

    with warnings.catch_warnings(), cli_profile(args.profile) as prof:
        warnings.filterwarnings("ignore", message="sequences reach")  # past-context warning: reported below
        result = evaluate(model, tokenizer, stories, page_size=args.page_size, page_budgets=args.page_budgets,
                          token_budgets=args.token_budgets, page_sizes=page_sizes, policies=args.policies,
                          num_sink_pages=args.num_sink_pages, num_recent_pages=args.num_recent_pages,
                          dense_layers=args.dense_layers, backend=args.backend, max_context=max_context,
                          long_range_window=args.long_range_window, repeat_probe=not args.no_repeat_probe,
                          selection_metrics=not args.no_selection_metrics, progress=not args.no_progress,
                          kv_cache_dtype=args.kv_cache_dtype, box_dtype=args.box_dtype)
    print(f"data: {data if args.data is not None else data.name + ' (shipped with tinyattn)'}")
    print(format_eval_table(result))
    _warn_past_context(result.max_sequence_tokens, model.config.max_seq_len)
    print_cli_report(prof, args.profile)
    if len(result.policies) > 1 and len(result.rows) > 1:
        for metric, relative in (("nll", True), ("top1_agreement", False), ("hit_rate", False),
                                 ("long_range_nll", True), ("repeat_nll", True)):
            print(f"\n{metric} by policy:\n")
            print(format_comparison(result, metric, relative=relative))
    if args.json is not None:
        result.save_json(args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.csv is not None:
        result.save_csv(args.csv)
        print(f"wrote {args.csv}", file=sys.stderr)
    if args.plot_dir is not None and len(result.rows) > 1:
        for path in plot_eval(result, args.plot_dir):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None, prog: str = _PROG) -> int:
    """Run the command line; ``prog`` names the program in usage lines (``python -m tinyattn`` passes its own)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (CLIError, ValueError, OSError) as exc:
        sub = f"{parser.prog} {args.command}"
        print(f"{sub}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main(prog="python -m tinyattn.cli"))
