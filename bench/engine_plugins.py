"""The engine's plug-ins on the shipped stories260K: NLL effect and speed of each one.

For each configuration (the engine's ``page_budget`` and plug-ins):

- ``nll``: teacher-forced NLL (nats / token) of the shipped validation stories (tinyattn/data/
  tinystories_valid_excerpt.txt, 7 stories cut at ``--context`` tokens), every target through the decode path
  with the plug-ins (:func:`tinyattn.engine.teacher_forced_nll`); ``nll_delta`` against dense;
- ``layers_skipped_per_token`` and ``exit_rate`` (early exit);
- ``ms_per_token_b1``: one request alone generating ``--tokens`` greedy tokens (wall time / tokens: decode
  dominated); ``ms_per_step_b8``: 8 requests together, wall time / engine steps. Timed interleaved: every
  repeat runs each configuration once, in turn; the median of ``--repeats`` is reported.

Usage: ``python bench/engine_plugins.py`` (writes out/bench/engine_plugins.{csv,json});
``--out docs/bench`` for the committed figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import common as C  # noqa: E402  (bench/common.py; puts the checkout on sys.path)
import torch

from tinyattn.assets import default_model_path, default_text_path, default_tokenizer_path
from tinyattn.engine import (ApproximateAttention, EarlyExit, Engine, LayerPolicies, SamplingParams,
                             teacher_forced_nll)
from tinyattn.models import LlamaModel, Tokenizer, load_stories

BUDGET = 4

CONFIGS = {
    "dense": (None, lambda: []),
    "quest": (BUDGET, lambda: []),
    "quest + layer policies (streaming in layers 0-1)": (BUDGET, lambda: [LayerPolicies({0: "streaming", 1: "streaming"})]),
    "quest + approx (dense 0 and 4, budgets 4,3,2)": (BUDGET, lambda: [ApproximateAttention(dense_first=1, dense_last=1)]),
    "dense + early exit (H<0.25, from layer 3)": (None, lambda: [EarlyExit(0.25, min_layer=3)]),
    "quest + early exit (H<0.25, from layer 3)": (BUDGET, lambda: [EarlyExit(0.25, min_layer=3)]),
    "quest + early exit (H<0.25, from layer 2)": (BUDGET, lambda: [EarlyExit(0.25, min_layer=2)]),
    "quest + early exit (H<0.25, from layer 1)": (BUDGET, lambda: [EarlyExit(0.25, min_layer=1)]),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=C.DEFAULT_OUT, help="output folder (default: out/bench)")
    p.add_argument("--context", type=int, default=256, help="tokens per story for the NLL (default: 256)")
    p.add_argument("--tokens", type=int, default=160, help="tokens generated per request when timing (default: 160)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per configuration (default: 5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    return p.parse_args(argv)


def timed(model, budget, plugins, prompts, tokens) -> tuple[float, int]:
    engine = Engine(model, page_size=16, num_pages=256, page_budget=budget, backend="torch", plugins=plugins)
    t0 = time.perf_counter()
    engine.generate(prompts, SamplingParams(tokens, ignore_eos=True))
    return time.perf_counter() - t0, engine.stats.steps


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = LlamaModel.from_llama2c(default_model_path())
    tok = Tokenizer(default_tokenizer_path())
    stories = [tok.encode(s, bos=True) for s in load_stories(default_text_path())]
    seqs = [s[: args.context] for s in stories]
    prompts8 = [s[:16] for s in stories] + [stories[0][:24]]
    rows = {}
    for name, (budget, plugins) in CONFIGS.items():
        r = teacher_forced_nll(model, seqs, page_budget=budget, backend="torch", plugins=plugins())
        rows[name] = dict(config=name, page_budget=budget, nll=r.nll, num_tokens=r.num_tokens,
                          layers_skipped_per_token=r.layers_skipped_per_token, exit_rate=r.early_exits / r.num_tokens)
        print(f"{name}: nll {r.nll:.4f}", file=sys.stderr)
    b1 = {n: [] for n in CONFIGS}
    b8 = {n: [] for n in CONFIGS}
    for name, (budget, plugins) in CONFIGS.items():                      # warm-up
        timed(model, budget, plugins(), prompts8[:2], 8)
    for _ in range(args.repeats):
        for name, (budget, plugins) in CONFIGS.items():
            s, _ = timed(model, budget, plugins(), prompts8[:1], args.tokens)
            b1[name].append(s / args.tokens * 1e3)
            s, steps = timed(model, budget, plugins(), prompts8, args.tokens)
            b8[name].append(s / steps * 1e3)
    dense_nll = rows["dense"]["nll"]
    for name, row in rows.items():
        row.update(nll_delta=row["nll"] - dense_nll, ms_per_token_b1=statistics.median(b1[name]),
                   ms_per_step_b8=statistics.median(b8[name]))
    machine = C.machine_name("cpu")
    print(f"machine: {machine}")
    print("| configuration | NLL | ΔNLL vs dense | layers skipped / token | exit rate | ms / token, 1 request | "
          "ms / step, 8 requests |")
    print("|---|---|---|---|---|---|---|")
    for row in rows.values():
        print(f"| {row['config']} | {row['nll']:.4f} | {row['nll_delta']:+.4f} | {row['layers_skipped_per_token']:.2f} | "
              f"{row['exit_rate']:.1%} | {row['ms_per_token_b1']:.2f} | {row['ms_per_step_b8']:.2f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    C.write_csv(args.out / "engine_plugins.csv", list(rows.values()))
    (args.out / "engine_plugins.json").write_text(json.dumps(dict(machine=machine, context=args.context,
                                                                  tokens=args.tokens, repeats=args.repeats,
                                                                  rows=list(rows.values())), indent=2) + "\n")
    print(f"wrote {args.out / 'engine_plugins.csv'} and .json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
