#!/usr/bin/env bash
# Regenerate every CPU figure of docs/benchmarks.md into docs/bench/ (5-10 minutes on a 2-core machine).
#   bash bench/run_cpu.sh                 # 2 torch threads (an idle machine's cores)
#   THREADS=1 bash bench/run_cpu.sh       # what docs/benchmarks.md shows: robust to another job on the VM
# Each measurement first waits (up to WAIT seconds, default 60) for the machine to be idle: on a shared VM
# other processes steal the cores, and a 2-thread OpenMP op then waits a scheduler slice per call. The idle
# share seen just before each measurement is kept in the CSVs (column idle_before).
set -euo pipefail
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
cd "$(dirname "$0")/.."
WAIT="${WAIT:-60}"
THREADS="${THREADS:-2}"
for t in 1 2; do
  python bench/kernel_breakdown.py --contexts 32K --repeats 30 --threads "$t" --wait-quiet "$WAIT" \
    --name "cpu_target_32k_t$t" --no-plot
done
python bench/decode_attention.py --threads "$THREADS" --wait-quiet "$WAIT"
python bench/kernel_breakdown.py --threads "$THREADS" --wait-quiet "$WAIT"
python bench/e2e_decode.py --threads "$THREADS" --wait-quiet "$WAIT"
python bench/profile_generate.py
