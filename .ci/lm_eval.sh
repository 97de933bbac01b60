#!/usr/bin/env bash
# The lm-evaluation-harness part of CI (issue 33, docs/lm_eval.md), also runnable alone: the eval extra (lm-eval,
# wonderwords) into the CI venv, then the tests that need it, with every extra required (a skip for want of one
# fails, tests/conftest.py).
#   bash .ci/lm_eval.sh            (VENV=/path of a venv that already has .[test,hf]; default .venv, made by .ci/run)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
start=$(date +%s)
"$VENV/bin/python" -m pip install -q -e ".[eval]"
echo "eval extra installed in $(( $(date +%s) - start )) s: $("$VENV/bin/python" -c 'import lm_eval; print("lm-eval", lm_eval.__version__)')"
HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TINYATTN_REQUIRE_EXTRAS=1 OPENBLAS_NUM_THREADS=1 \
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/integrations/test_lm_eval.py tests/bench/test_ruler.py
echo "lm-eval part of CI: $(( $(date +%s) - start )) s"
