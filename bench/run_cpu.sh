#!/usr/bin/env bash
# Rerun every CPU figure of docs/benchmarks.md (5-10 minutes on a 2-core machine), into out/bench/ (git-ignored)
# unless OUT says otherwise:
#   bash bench/run_cpu.sh                                # 2 torch threads (an idle machine's cores) -> out/bench/
#   THREADS=1 OUT=docs/bench bash bench/run_cpu.sh       # what docs/benchmarks.md shows, replacing its figures
# Each measurement first waits (up to WAIT seconds, default 60) for the machine to be idle: on a shared VM
# other processes steal the cores, and a 2-thread OpenMP op then waits a scheduler slice per call. The idle
# share seen just before each measurement is kept in the CSVs (column idle_before).
set -euo pipefail
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
cd "$(dirname "$0")/.."
WAIT="${WAIT:-60}"
THREADS="${THREADS:-2}"
OUT="${OUT:-out/bench}"
for t in 1 2; do
  python bench/kernel_breakdown.py --contexts 32K --repeats 30 --threads "$t" --wait-quiet "$WAIT" \
    --name "cpu_target_32k_t$t" --no-plot --out "$OUT"
done
python bench/decode_attention.py --threads "$THREADS" --wait-quiet "$WAIT" --out "$OUT"
python bench/kernel_breakdown.py --threads "$THREADS" --wait-quiet "$WAIT" --out "$OUT"
python bench/e2e_decode.py --threads "$THREADS" --wait-quiet "$WAIT" --out "$OUT"
python bench/profile_generate.py --out "$OUT"
