#!/usr/bin/env bash
# The RULER runs of docs/accuracy.md (issue 34), as two queues of resumable commands: a queue can be stopped and
# started again at any point (finished cells are skipped, partial results stay on disk). Two queues at most at
# once on the shared 2-core machine, one torch thread each, niced:
#
#   nohup bash bench/ruler_runs.sh A > /tmp/ruler_A.log 2>&1 &
#   nohup bash bench/ruler_runs.sh B > /tmp/ruler_B.log 2>&1 &
#   python bench/smollm2_ruler.py --report          # tables and plot from whatever has finished
#
# The selection policies run first on every sample; H2O's cells (an observed prefill, ~3-4x a plain one) after; stock
# transformers (one more prefill per sample) on the first samples first, on all of them later.
set -uo pipefail
cd "$(dirname "$0")/.."
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
R() { echo "=== $(date -Is) $*"; nice -n 10 "$PY" bench/smollm2_ruler.py --threads 1 "$@"; }
SEL=dense,quest,questmass,oracle,streaming
CEIL="niah_multikey_2,niah_multikey_3,vt,cwe,fwe"

case "${1:-}" in
A)
  R --tasks niah_single_1 --contexts 2048 --samples 50 --batch 8 --policies $SEL --stock 20
  R --tasks niah_single_1 --contexts 2048 --samples 50 --diagnose 8 --budgets 1/8,1/16
  R --tasks niah_single_1 --contexts 2048 --samples 20 --lm-eval 20
  R --tasks niah_single_1 --contexts 2048 --samples 50 --batch 8 --policies h2o --stock none
  R --tasks niah_single_1 --contexts 2048 --samples 50 --batch 8 --policies dense --stock all
  R --tasks niah_single_1 --contexts 8192 --samples 20 --batch 4 --policies $SEL --stock 5
  R --tasks niah_single_2,niah_single_3 --contexts 2048 --samples 50 --batch 8 --policies $SEL --stock 10
  R --tasks niah_single_1 --contexts 8192 --samples 20 --batch 4 --policies h2o --stock none
  R --tasks niah_single_2,niah_single_3 --contexts 8192 --samples 20 --batch 4 --policies $SEL --stock 5
  R --tasks $CEIL --contexts 2048 --samples 20 --batch 8 --policies dense --stock all
  R --tasks niah_single_2,niah_single_3 --contexts 2048,4096 --samples 50 --batch 8 --policies dense --stock all
  R --tasks niah_single_2 --contexts 2048 --samples 50 --diagnose 8 --budgets 1/8,1/16
  R --tasks niah_single_3 --contexts 2048 --samples 50 --diagnose 8 --budgets 1/8,1/16
  R --tasks niah_single_1,niah_single_2,niah_single_3 --contexts 8192 --samples 20 --batch 4 --policies dense --stock all
  ;;
B)
  R --tasks niah_single_1 --contexts 4096 --samples 50 --batch 8 --policies $SEL --stock 20
  R --tasks niah_single_1 --contexts 4096 --samples 50 --diagnose 6 --budgets 1/8,1/16
  R --tasks niah_single_1 --contexts 4096 --samples 50 --batch 8 --policies h2o --stock none
  R --tasks niah_single_1 --contexts 4096 --samples 50 --batch 8 --policies dense --stock all
  R --tasks niah_single_2,niah_single_3 --contexts 4096 --samples 50 --batch 8 --policies $SEL --stock 10
  R --tasks niah_single_2,niah_single_3 --contexts 2048,4096 --samples 50 --batch 8 --policies h2o --stock none
  R --tasks $CEIL --contexts 4096 --samples 10 --batch 8 --policies dense --stock all
  R --tasks niah_single_2,niah_single_3 --contexts 8192 --samples 20 --batch 4 --policies h2o --stock none
  ;;
*)
  echo "usage: bash bench/ruler_runs.sh A|B" >&2
  exit 2
  ;;
esac
echo "=== $(date -Is) queue ${1} done"
