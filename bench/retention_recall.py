"""Gradient-aware KV retention vs recency vs full on the recall fine-tuning task, over several seeds.

Each run is ``python -m tinyattn finetune --task recall`` (the shipped retrieval model; sequences with pass keys
in their first 10% and questions from ``--first-question`` on; loss and accuracy on the answer digits only),
in-process: for every seed, ``full`` (every page), ``recency`` and ``gradient`` at the same
``--kv-budget-pages``. Reported per policy: mean and spread (min, max, standard deviation over seeds) of the
held-out answer-digit accuracy and NLL under the policy's own memory, and the peak KV bytes.

Usage: ``python bench/retention_recall.py`` (writes out/bench/retention_recall.{json,csv,png});
``--out docs/bench`` for the committed figures. ``--help`` lists the options.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

import common as C  # noqa: E402  (bench/common.py; puts the checkout on sys.path)

POLICIES = ("full", "recency", "gradient")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=C.DEFAULT_OUT, help="output folder (default: out/bench)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="finetune --seed values (default: 0 1 2)")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES), help="retention policies")
    p.add_argument("--model", type=Path, default=None, help="retrieval checkpoint dir (default: the shipped one)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default: 1024)")
    p.add_argument("--chunk-size", type=int, default=64, help="tokens per chunk (default: 64)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (default: 16)")
    p.add_argument("--kv-budget-pages", type=int, default=24,
                   help="pages per sequence and layer for recency and gradient (default: 24 = 3/8 of 1024 tokens)")
    p.add_argument("--num-keys", type=int, default=4, help="pass keys per sequence (default: 4)")
    p.add_argument("--num-questions", type=int, default=4, help="questions per sequence (default: 4)")
    p.add_argument("--first-question", type=float, default=0.3, help="first question's position (default: 0.3)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default: 40)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step (default: 4)")
    p.add_argument("--lr", type=float, default=5e-4, help="AdamW learning rate (default: 5e-4)")
    p.add_argument("--eval-sequences", type=int, default=16, help="held-out sequences (default: 16)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return p.parse_args(argv)


def one_run(args, policy: str, seed: int) -> dict:
    from tinyattn.cli import build_parser
    from tinyattn.training import finetune as ft

    argv = ["finetune", "--task", "recall", "--seq-len", str(args.seq_len), "--chunk-size", str(args.chunk_size),
            "--page-size", str(args.page_size), "--retention", policy, "--kv-budget-pages", str(args.kv_budget_pages),
            "--num-keys", str(args.num_keys), "--num-questions", str(args.num_questions),
            "--first-question", str(args.first_question), "--steps", str(args.steps),
            "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--eval-sequences", str(args.eval_sequences),
            "--seed", str(seed), "--backend", "torch", "--eval-before"]
    argv += ["--model", str(args.model)] if args.model else []
    argv += ["--no-progress"] if args.no_progress else []
    out = args.out / "retention_recall_runs" / f"{policy}_seed{seed}.json"
    ns = build_parser().parse_args(argv + ["--json", str(out)])
    t0 = time.perf_counter()
    ft.run(ns)
    row = json.loads(out.read_text())
    row.update(seed=seed, seconds=round(time.perf_counter() - t0, 1))
    return row


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for policy in dict.fromkeys(r["retention"] for r in rows):
        rs = [r for r in rows if r["retention"] == policy]
        acc = [r["eval_accuracy"] for r in rs]
        nll = [r["eval_nll"] for r in rs]
        out.append(dict(retention=policy, seeds=len(rs), accuracy_mean=statistics.fmean(acc),
                        accuracy_min=min(acc), accuracy_max=max(acc),
                        accuracy_std=statistics.stdev(acc) if len(acc) > 1 else 0.0,
                        accuracy_before_mean=statistics.fmean(r["eval_accuracy_before"] for r in rs),
                        nll_mean=statistics.fmean(nll), nll_min=min(nll), nll_max=max(nll),
                        peak_kv_bytes=max(r["peak_kv_bytes"] for r in rs)))
    return out


def table(summary: list[dict]) -> str:
    lines = ["| retention | seeds | answer-digit accuracy, mean (min - max, sd) | before fine-tuning | answer NLL, "
             "mean (min - max) | peak KV bytes |", "|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['retention']} | {s['seeds']} | {s['accuracy_mean']:.1%} ({s['accuracy_min']:.1%} - "
                     f"{s['accuracy_max']:.1%}, {s['accuracy_std']:.1%}) | {s['accuracy_before_mean']:.1%} | "
                     f"{s['nll_mean']:.3f} ({s['nll_min']:.3f} - {s['nll_max']:.3f}) | {s['peak_kv_bytes']:,} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Each seed's held-out accuracy per policy, and the mean; nothing without matplotlib (the plots extra)."""
    plt = C.pyplot()
    if plt is None:
        return
    policies = list(dict.fromkeys(r["retention"] for r in rows))
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for i, policy in enumerate(policies):
        acc = [r["eval_accuracy"] * 100 for r in rows if r["retention"] == policy]
        ax.scatter([i] * len(acc), acc, color="C%d" % i, alpha=0.7)
        ax.hlines(statistics.fmean(acc), i - 0.25, i + 0.25, color="C%d" % i)
    ax.set_xticks(range(len(policies)), policies)
    ax.set_ylabel("held-out answer-digit accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title("recall fine-tuning, equal KV memory (dots: seeds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.model:
        from tinyattn.retrieval.model import default_retrieval_dir

        if not (default_retrieval_dir() / "config.json").exists():
            print("no shipped retrieval model yet: pass --model DIR", file=sys.stderr)
            return 2
    rows = []
    for seed in args.seeds:
        for policy in args.policies:
            rows.append(one_run(args, policy, seed))
            r = rows[-1]
            print(f"seed {seed} {policy:8s} accuracy {r['eval_accuracy']:.1%} (before {r['eval_accuracy_before']:.1%}) "
                  f"nll {r['eval_nll']:.3f}  {r['seconds']} s", flush=True)
    summary = summarize(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"}
    (args.out / "retention_recall.json").write_text(json.dumps(dict(meta=meta, machine=C.machine_name(), runs=rows,
                                                                    summary=summary), indent=1) + "\n")
    with open(args.out / "retention_recall.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot(rows, args.out / "retention_recall.png")
    print(table(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
