#!/usr/bin/env bash
# The runs of docs/accuracy.md's "Selection that finds what the oracle finds" section (issue 35): the box estimate
# (quest:gamma=...) and the top-p budget (quest:...:top_p=...) on RULER, passkey and long-text NLL, as two queues of
# commands. The RULER commands resume (finished cells are skipped); passkey runs in two depth halves merged at the
# end, so a killed queue loses at most one half. One torch thread per process, niced:
#
#   nohup bash bench/selection_runs.sh A > /tmp/selection_A.log 2>&1 &
#   nohup bash bench/selection_runs.sh B > /tmp/selection_B.log 2>&1 &
#   bash bench/selection_runs.sh C                  # the 4-bit re-rank prototype, into out/prototypes
#   python bench/smollm2_ruler.py --report          # RULER tables and plot from whatever has finished
set -uo pipefail
cd "$(dirname "$0")/.."
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
run() { echo "=== $(date -Is) $*"; nice -n 10 "$PY" "$@"; }
R() { run bench/smollm2_ruler.py --threads 1 "$@"; }
TOPP=quest:top_p=0.8,quest:top_p=0.95,quest:gamma=0.25:top_p=0.8,quest:gamma=0.25:top_p=0.95
PK="--contexts 8192 --depths 10 --samples 3 --budgets 1/32,1/64 --recipes default --batch 5 --threads 1"
PKPOL=dense,quest,quest:gamma=0.25,oracle

case "${1:-}" in
A)
  R --tasks niah_single_1 --contexts 4096 --samples 50 --batch 8 --policies quest:gamma=0.25 --stock none
  R --tasks niah_single_1 --contexts 4096 --samples 50 --batch 8 --budgets 1/4 --stock none \
    --policies quest:top_p=0.9,quest:gamma=0.25:top_p=0.9
  run bench/smollm2_passkey.py --out out/passkey_8k_gamma/1 $PK --policies $PKPOL --depth-part 1/2
  run bench/smollm2_passkey.py --out out/passkey_8k_gamma/2 $PK --policies $PKPOL --depth-part 2/2
  run bench/smollm2_passkey.py --out docs/smollm2/passkey_8k_gamma $PK --policies $PKPOL \
    --merge out/passkey_8k_gamma/1,out/passkey_8k_gamma/2
  run bench/smollm2_long_text.py --out docs/smollm2/long_text_gamma --context 8192 --buckets 2048,4096,8128 \
    --tokens 64 --budgets 1/8,1/16 --policies quest,quest:gamma=0.25,quest:gamma=0.5 --recipes default,sink1
  ;;
B)
  R --tasks niah_single_1 --contexts 2048 --samples 50 --batch 8 --budgets 1/4 --stock none --policies $TOPP
  R --tasks niah_single_2,niah_single_3 --contexts 2048 --samples 50 --batch 8 --stock 10 \
    --policies dense,quest,quest:gamma=0.25,questmass,oracle,streaming
  R --tasks niah_single_1 --contexts 8192 --samples 20 --batch 4 --stock 5 \
    --policies dense,quest,quest:gamma=0.25,questmass,oracle,streaming
  # held out: top-p on niah_single_2; niah_single_3 at 4K (20 samples so far)
  R --tasks niah_single_2 --contexts 2048 --samples 50 --batch 8 --budgets 1/4 --stock none \
    --policies quest:top_p=0.9,quest:gamma=0.25:top_p=0.9
  R --tasks niah_single_3 --contexts 4096 --samples 50 --batch 4 --stock 5 \
    --policies dense,quest,quest:gamma=0.25,oracle,streaming
  R --tasks niah_single_2,niah_single_3 --contexts 8192 --samples 20 --batch 4 --stock 5 \
    --policies dense,quest,quest:gamma=0.25,oracle,streaming
  # page size 8: passkey at 1/64 and NLL at 1/8 (docs/accuracy.md, "Page size 8")
  run bench/smollm2_passkey.py --out docs/smollm2/passkey_8k_ps8 --contexts 8192 --depths 10 --samples 3 \
    --budgets 1/64 --recipes default --batch 5 --threads 1 --page-size 8 --policies dense,quest,quest:gamma=0.25,oracle
  ;;
C)
  # the 4-bit re-rank prototype (bench/prototypes/int4_rerank.py) on the stored samples, beside the library's cells:
  # its own output folder (copy docs/ruler/samples and results there first to report them side by side)
  PR() { run bench/prototypes/int4_rerank.py bench/smollm2_ruler.py --out out/prototypes --threads 1 --stock none \
    --samples 50 --batch 8 "$@"; }
  PR --tasks niah_single_2 --contexts 2048 --budgets 1/4 --policies int4rerank:top_p=0.8,int4rerank:top_p=0.9
  PR --tasks niah_single_2 --contexts 2048 --budgets 1/8,1/16,1/32 --policies int4rerank:candidates=2
  PR --tasks niah_single_3 --contexts 2048 --budgets 1/4 --policies int4rerank:top_p=0.8,int4rerank:top_p=0.9
  PR --tasks niah_single_1 --contexts 2048 --budgets 1/4 --policies int4rerank:top_p=0.8,int4rerank:top_p=0.9
  PR --tasks niah_single_3 --contexts 2048 --budgets 1/8,1/16 --policies int4rerank:candidates=2
  PR --tasks niah_single_1 --contexts 4096 --budgets 1/4 --policies int4rerank:top_p=0.8,int4rerank:top_p=0.9
  PR --tasks niah_single_2 --contexts 4096 --budgets 1/4 --policies int4rerank:top_p=0.8,int4rerank:top_p=0.9
  run bench/prototypes/int4_rerank.py bench/smollm2_passkey.py --out docs/smollm2/passkey_8k_rerank --contexts 8192 \
    --depths 10 --samples 3 --budgets 1/64 --recipes default --batch 5 --threads 1 \
    --policies dense,int4rerank:candidates=2,oracle
  run bench/prototypes/int4_rerank.py bench/smollm2_long_text.py --out docs/smollm2/long_text_rerank_640 --windows 2 \
    --buckets 4096,5120,6144,7168,8064 --tokens 64 --budgets 1/8 --recipes sink1 --page-sizes 16 --threads 1 \
    --policies int4rerank:candidates=2,quest:gamma=0.25
  ;;
*)
  echo "usage: bash bench/selection_runs.sh A|B|C" >&2
  exit 2
  ;;
esac
echo "=== $(date -Is) queue ${1} done"
