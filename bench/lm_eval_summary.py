"""Side-by-side summary of lm-eval runs of one task (docs/lm_eval.md): scores, and every sample's response per run.

Each run is an lm-eval ``--output_path`` folder written with ``--log_samples`` (``results_*.json`` and
``samples_<task>_*.jsonl``, possibly in a sub-folder named after the model). Writes into ``--out``:

- ``<name>_results.json``: each run's lm-eval result file, as lm-eval wrote it;
- ``responses.jsonl``: per sample (``doc_id``), the prompt's sha256 (lm-eval's ``doc_hash``), the target, and each
  run's response and score, so that equal responses can be checked without the 2K-token prompts;
- ``summary.md``: the table of scores, and how many responses equal the first run's.

    python bench/lm_eval_summary.py --task niah_single_1 --metric 2048 --out docs/lm_eval \\
        stock=out/lm_eval/stock dense=out/lm_eval/dense quest16=out/lm_eval/quest16
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def _newest(folder: Path, pattern: str) -> Path:
    files = sorted(folder.rglob(pattern), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"{folder}: no {pattern} (run lm-eval with --output_path there and --log_samples)")
    return files[-1]


def load_run(folder: Path, task: str):
    """(result dict, samples by doc_id, result file) of the newest lm-eval run in ``folder``."""
    results_file = _newest(folder, "results_*.json")
    samples_file = _newest(folder, f"samples_{task}_*.jsonl")
    samples = {}
    with open(samples_file, encoding="utf-8") as f:
        for line in f:
            s = json.loads(line)
            samples[s["doc_id"]] = s
    return json.loads(results_file.read_text(encoding="utf-8")), samples, results_file


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="NAME=FOLDER",
                   help="an lm-eval output folder per run, named; the first run is the reference of 'same responses'")
    p.add_argument("--task", required=True, help="the lm-eval task name (e.g. niah_single_1)")
    p.add_argument("--metric", required=True, help="the metric key of the task's results (RULER: the length, e.g. 2048)")
    p.add_argument("--out", type=Path, required=True, help="folder to write the summary into (created if missing)")
    args = p.parse_args(argv)
    runs = []
    for spec in args.runs:
        name, _, folder = spec.partition("=")
        if not name or not folder:
            p.error(f"runs: expected NAME=FOLDER, got {spec!r}")
        runs.append((name, *load_run(Path(folder), args.task)))
    args.out.mkdir(parents=True, exist_ok=True)
    ref_name, _, ref_samples, _ = runs[0]
    ids = sorted(ref_samples)
    for name, _, samples, _ in runs[1:]:
        if sorted(samples) != ids or any(samples[i]["doc_hash"] != ref_samples[i]["doc_hash"] for i in ids):
            raise SystemExit(f"{name}: not the same samples as {ref_name} (doc ids or prompt hashes differ)")
    with open(args.out / "responses.jsonl", "w", encoding="utf-8") as f:
        for i in ids:
            row = {"doc_id": i, "doc_hash": ref_samples[i]["doc_hash"], "target": ref_samples[i]["target"]}
            for name, _, samples, _ in runs:
                row[name] = {"response": samples[i]["filtered_resps"][0], "score": samples[i][args.metric]}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    lines = [f"| run | model_args | {args.task} @ {args.metric} | samples | responses equal to {ref_name}'s |",
             "|---|---|---:|---:|---:|"]
    for name, result, samples, results_file in runs:
        shutil.copyfile(results_file, args.out / f"{name}_results.json")
        score = result["results"][args.task][f"{args.metric},none"]
        margs = ",".join(f"{k}={v}" for k, v in result["config"]["model_args"].items() if k != "pretrained")
        same = sum(samples[i]["filtered_resps"] == ref_samples[i]["filtered_resps"] for i in ids)
        lines.append(f"| {name} | `{result['config']['model']}` {margs} | {score:.2f} | {len(ids)} | {same} |")
    (args.out / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
