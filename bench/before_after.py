"""Two checkouts of tinyattn side by side: the same benchmark run from each in alternation, one table.

Each round runs ``bench/decode_attention.py`` (same arguments) from the *before* checkout, then from the
*after* one, each in a fresh process with ``PYTHONPATH`` at its checkout, so both import their own tinyattn. Every
row's speed-up is against the faster SDPA form timed **in the same process** (the benchmark's own baseline), so the
two columns are comparable even when the machine's load moves between processes; the table gives the median over
the rounds. Extra arguments for one side only (e.g. the old checkout's ``--torch-ops``, which times its PyTorch path
beside its compiled kernel) go in ``--before-args`` / ``--after-args``.

Example (the C++ CPU kernel of fc1b6be, since removed, vs the PyTorch path of this checkout)::

    git worktree add /tmp/before fc1b6be
    python bench/before_after.py --before /tmp/before --after . --rounds 3 --before-args=--torch-ops \\
        -- --contexts 32K --budgets 2048 --value-checks --repeats 7
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C  # noqa: E402


def run_side(checkout: Path, bench_args: list[str], extra: list[str], out: Path) -> list[dict]:
    """One run of the checkout's own ``bench/decode_attention.py``; its CSV rows."""
    env = dict(os.environ, PYTHONPATH=str(checkout))
    cmd = [sys.executable, str(checkout / "bench" / "decode_attention.py"), *bench_args, *extra, "--no-plot",
           "--out", str(out)]
    subprocess.run(cmd, cwd=checkout, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out / "decode_attention.csv", newline="") as f:
        return list(csv.DictReader(f))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--before", type=Path, required=True, help="the checkout before the change (a git worktree)")
    p.add_argument("--after", type=Path, required=True, help="the checkout after the change")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: 3)")
    p.add_argument("--before-args", default="", help="extra benchmark arguments for the before side only")
    p.add_argument("--after-args", default="", help="extra benchmark arguments for the after side only")
    p.add_argument("--csv", type=Path, default=None, help="also write the table's rows to this CSV file")
    p.add_argument("bench_args", nargs=argparse.REMAINDER,
                   help="arguments for bench/decode_attention.py on both sides (after a --)")
    args = p.parse_args(argv)
    bench_args = [a for a in args.bench_args if a != "--"]
    sides = {"before": (args.before.resolve(), args.before_args.split()),
             "after": (args.after.resolve(), args.after_args.split())}
    speedups: dict[tuple, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side, (checkout, extra) in sides.items():
                rows = run_side(checkout, bench_args, extra, Path(tmp) / f"{side}{r}")
                for row in rows:
                    key = (side, int(row["context"]), row["method"], int(row["budget_tokens"]), row["threads"])
                    speedups.setdefault(key, []).append(float(row["speedup"]))
                print(f"round {r + 1}/{args.rounds}: {side} done", file=sys.stderr)
    table = [dict(side=k[0], context=k[1], method=k[2], budget_tokens=k[3], threads=k[4],
                  speedup_median=statistics.median(v), speedup_min=min(v), speedup_max=max(v), rounds=len(v))
             for k, v in sorted(speedups.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0]))]
    print("| checkout | context | method | budget | threads | x fastest SDPA (median) | min-max |")
    print("|---|---:|---|---:|---:|---:|---|")
    for t in table:
        print(f"| {t['side']} | {t['context']} | {t['method']} | {t['budget_tokens']} | {t['threads']} | "
              f"{t['speedup_median']:.2f} | {t['speedup_min']:.2f}-{t['speedup_max']:.2f} |")
    if args.csv:
        C.write_csv(args.csv, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
