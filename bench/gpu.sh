#!/usr/bin/env bash
# One command on a CUDA machine (target: about 6 minutes on one H200): the GPU-only tests (kernels, the plan, the
# fused KV write, the CUDA-graph replay of a whole decode step over 50 steps), then the decode benchmarks, eager and
# CUDA-graphed, against SDPA / FlashAttention / FlashInfer (when importable), everything written to one folder with
# a one-screen summary.md: the CUDA-graph goals (PASS / FAIL), the graphed step table with efficiency vs the bytes
# ideal (DESIGN.md §1), the tests' verdict; the other tables follow it.
#
#   bash bench/gpu.sh                  # writes out/gpu/  (or "$OUT" when set, e.g. by a CI / device runner)
#   QUICK=1 bash bench/gpu.sh          # smaller sweep (about 1 minute)
#
# Needs torch (CUDA build) and triton on the machine; flash-attn is used when importable and skipped
# otherwise. The pure-Python packages the tests and the ops need (einops, pytest, hypothesis, ...) are
# installed from wheels carried with the checkout in .whl/ (git-ignored) when the machine lacks them, so a
# GPU machine without a package registry works. Download them once, on a machine that has one:
#
#   pip download --no-deps --only-binary=:all: --platform any --python-version 3.10 -d .whl einops pytest \
#       pluggy iniconfig packaging pygments hypothesis sortedcontainers attrs pytest-xdist execnet tqdm \
#       exceptiongroup tomli typing_extensions
#
# (`--platform any`: pure-Python wheels, which install on any Python >= 3.10 whatever the machine's version;
# exceptiongroup, tomli and typing_extensions are only used on Python < 3.11). They are installed with
# `pip install --no-index --find-links .whl --target .whl/site` and put on PYTHONPATH: the machine's own
# environment is not changed. No interactive input; each step has its own time limit and a failed step does
# not stop the others (the exit status is that of the first failure); the limits add up to 410 s. Commit the
# CSV / PNG / summary.md it writes to docs/bench/gpu/ with the GPU named (docs/benchmarks.md, "GPU").
set -uo pipefail
export PYTHONUNBUFFERED=1
export TRITON_INTERPRET=0           # tests/conftest.py defaults it to 1 for the CPU suites
unset CUDA_LAUNCH_BLOCKING
cd "$(dirname "$0")/.."
# the checkout's package, installed or not (a GPU machine gets a bare copy of the tree: bench scripts import tinyattn)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DEST="${OUT:-out/gpu}"
mkdir -p "$DEST"
STATUS=0
START=$(date +%s)

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $DEST/NAME.log, remember a failure
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s): $*"
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > >(tee "$DEST/$name.log") 2>&1
  local rc=$?
  echo "=== $name: exit $rc after $(( $(date +%s) - t0 ))s"
  if [ $rc -ne 0 ] && [ $STATUS -eq 0 ]; then STATUS=$rc; fi
}

python - > "$DEST/env.txt" 2>&1 <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton; print("triton", triton.__version__)
except Exception as e:
    print("triton: not importable:", e)
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"gpu{i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs")
else:
    print("no CUDA device")
try:
    import flash_attn; print("flash_attn", flash_attn.__version__)
except Exception as e:
    print("flash_attn: not available")
EOF
cat "$DEST/env.txt"
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device: nothing to do (the CPU benchmarks are bench/*.py without --device cuda)"
  exit 1
fi
# the Python packages of the run: the machine's own, else the wheels carried in .whl/ (see the top)
NEEDED="einops pytest hypothesis xdist tqdm"
have_all() { python -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" $NEEDED; }
if ! have_all; then
  if ! ls .whl/*.whl > /dev/null 2>&1; then
    echo "missing Python packages (need: $NEEDED) and no wheels in .whl/: run the pip download command at the" \
         "top of bench/gpu.sh on a machine with a package registry, and bring .whl/ with the checkout"
    exit 1
  fi
  echo "installing the carried wheels from .whl/ into .whl/site"
  python -m pip install --quiet --no-index --find-links .whl --target .whl/site --upgrade \
    einops pytest hypothesis pytest-xdist tqdm || { echo "pip install from .whl/ failed"; exit 1; }
  export PYTHONPATH="$PWD/.whl/site${PYTHONPATH:+:$PYTHONPATH}"
  have_all || { echo "still missing one of: $NEEDED"; exit 1; }
fi
python -c "import einops, pytest, hypothesis; print('einops', einops.__version__, 'pytest', pytest.__version__,
'hypothesis', hypothesis.__version__)" | tee -a "$DEST/env.txt"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv > "$DEST/nvidia-smi.csv" 2>/dev/null || true

if [ "${QUICK:-0}" = "1" ]; then
  CONTEXTS="4K,32K"; BUDGETS="2048"; E2E_CONTEXTS="4K,32K"; REPEATS=30
else
  CONTEXTS="1K,4K,16K,32K,64K,128K"; BUDGETS="1024,2048,4096"; E2E_CONTEXTS="1K,16K,32K,128K"; REPEATS=100
fi

# four workers: most of the tests' time is Triton compiling their specialisations (16 CPU cores on an H200 machine)
step gpu_tests 150 python -m pytest -q -p no:cacheprovider -n 4 tests/gpu -rs
step gpu_graphs 75 python bench/gpu_graphs.py --out "$DEST" --contexts 4K,32K,128K --batches 1,8
step decode_attention 75 python bench/decode_attention.py --device cuda --out "$DEST" \
  --contexts "$CONTEXTS" --budgets "$BUDGETS" --repeats "$REPEATS"
step kernel_breakdown 35 python bench/kernel_breakdown.py --device cuda --out "$DEST" \
  --contexts 4K,32K,128K --repeats "$REPEATS"
step e2e_decode 35 python bench/e2e_decode.py --device cuda --out "$DEST" --contexts "$E2E_CONTEXTS" --steps 8
# where the eager public op's host time goes (515-555 us per call on an H200 at the last run: not yet split)
step host_profile 40 python bench/host_profile.py --device cuda --out "$DEST"

{
  echo "# tinyattn GPU run, $(date -u +%Y-%m-%dT%H:%MZ), $(( $(date +%s) - START ))s"
  head -n 3 "$DEST/env.txt"
  echo
  echo "## CUDA-graph goals (32K, budget 2048 tokens; graphed = CUDA-graph replay); issue 35's re-rank cost bar"
  grep -E '^goal:' "$DEST/gpu_graphs.log" 2>/dev/null || echo "(no goals: see gpu_graphs.log)"
  echo
  echo "## decode step, eager and graphed, vs SDPA gqa (efficiency = speedup / bytes-ideal speedup)"
  grep -E '^\|' "$DEST/gpu_graphs.log" 2>/dev/null | grep -E '^\| (B|---|1 \| 32768|8 \| 32768)' || echo "(no table: see gpu_graphs.log)"
  echo
  echo "## host time of the eager public op (32K, budget 2048; by function and by torch op: host_profile.md)"
  sed -n '/^## Per call/,/^## By function/p' "$DEST/host_profile.md" 2>/dev/null | grep -E '^\|' || echo "(none: see host_profile.log)"
  echo
  echo "## gpu_tests"
  tail -n 3 "$DEST/gpu_tests.log" 2>/dev/null
  echo
  echo "# details"
  for f in gpu_graphs decode_attention kernel_breakdown e2e_decode; do
    echo
    echo "## $f"
    # the Markdown table each script prints last
    grep -E '^\|' "$DEST/$f.log" 2>/dev/null || echo "(no table: see $f.log)"
  done
} > "$DEST/summary.md"
cat "$DEST/summary.md"
echo "wrote $DEST/ (summary.md, *.csv, *.png, *.log); exit $STATUS"
exit $STATUS
