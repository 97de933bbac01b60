#!/usr/bin/env bash
# A fresh user's first two commands, proved: clone the repository into an empty temporary folder (no ../shared
# beside it), make a new virtual environment, install with the README's quick-start install line, and run the
# README's main job from a directory with no ../shared, with CC/CXX pointing at `false` (no compiler). The printed story must be exactly
# tests/known_good_stories260K.txt. Also: the console script's name and output, and a built wheel holding the
# shipped model and texts (tinyattn/data/); the core install leaves matplotlib out (the plots extra) and
# `eval --plot-dir` without it writes CSV / JSON and names the extra. About a minute and a half with torch's wheel
# on local disk.
#   bash .ci/fresh_clone.sh            (run by .ci/run; clones the committed HEAD of this checkout)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
unset PYTHONPATH TRITON_INTERPRET
# no compiler on this "machine": tinyattn builds nothing at install or run time; a build step would fail
export CC=false CXX=false
export PIP_QUIET=1 PIP_DISABLE_PIP_VERSION_CHECK=1
git clone -q "$REPO" "$WORK/tinyattn"
cd "$WORK/tinyattn"
INSTALL="$(grep -m1 '^pip install torch==' README.md)"
[ -n "$INSTALL" ] || { echo "fresh clone: no 'pip install torch==...' line in README.md" >&2; exit 1; }
python3 -m venv "$WORK/venv"
. "$WORK/venv/bin/activate"
echo "fresh clone: $INSTALL"
t0=$(date +%s)
if ! eval "$INSTALL" > "$WORK/install.log" 2>&1; then
  cat "$WORK/install.log" >&2
  echo "fresh clone: the README's install line failed" >&2
  exit 1
fi
echo "fresh clone: installed in $(( $(date +%s) - t0 ))s"
if python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("matplotlib") is None)'; then
  echo "fresh clone: the core install (the README's line) pulled matplotlib; it belongs to the plots extra" >&2
  exit 1
fi
echo "fresh clone: the core install has no matplotlib"
mkdir -p "$WORK/elsewhere/run"
cd "$WORK/elsewhere/run"
[ ! -e ../shared ] && [ ! -e ../../shared ] || { echo "fresh clone: a shared/ folder lies beside the run" >&2; exit 1; }
python -m tinyattn generate --max-new-tokens 200 --temperature 0 > generate.txt
tinyattn generate --max-new-tokens 200 --temperature 0 --no-stats > console.txt
tinyattn --help > help.txt
python -m tinyattn eval --max-stories 1 --max-context 64 --page-budgets 2,4 --no-progress --plot-dir plots \
  > eval.txt 2> eval.err || { cat eval.err >&2; echo "fresh clone: eval --plot-dir failed without matplotlib" >&2; exit 1; }
grep -qF 'pip install -e ".[plots]"' eval.err && [ -s plots/results.csv ] && [ -s plots/results.json ] || {
  cat eval.err >&2; echo "fresh clone: eval --plot-dir without matplotlib did not write CSV/JSON and name the extra" >&2
  exit 1; }
echo "fresh clone: eval --plot-dir without matplotlib wrote plots/results.csv|json and named the plots extra"
python - "$REPO/tests/known_good_stories260K.txt" <<'PY'
import sys
expected = open(sys.argv[1], encoding="utf-8").read()
out = open("generate.txt", encoding="utf-8").read()
text = out.split("\n---\n", 1)[0] + "\n"
problems = []
if text != expected:
    problems.append(f"python -m tinyattn generate printed:\n{text}\nexpected:\n{expected}")
if "tokens/s" not in out:
    problems.append("no stats block after the text")
if open("console.txt", encoding="utf-8").read() != expected:
    problems.append("the tinyattn console script (--no-stats) did not print the known-good text")
if not open("help.txt", encoding="utf-8").read().startswith("usage: tinyattn "):
    problems.append("tinyattn --help does not say 'usage: tinyattn'")
if problems:
    sys.exit("fresh clone: FAILED\n" + "\n".join(problems))
print("fresh clone: python -m tinyattn generate --max-new-tokens 200 --temperature 0 printed the known-good text")
PY
cd "$WORK/tinyattn"
python -m pip wheel --no-deps -w "$WORK/wheel" . > /dev/null
python - "$WORK"/wheel/tinyattn-*.whl <<'PY'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
need = [f"tinyattn/data/{n}" for n in ("stories260K.bin", "tok512.bin", "tinystories_valid_excerpt.txt",
                                       "tinystories_sample.txt", "README.md", "LICENSE-stories260K",
                                       "LICENSE-TinyStories")]
missing = [n for n in need if n not in names]
if missing:
    sys.exit(f"fresh clone: the wheel lacks {missing}")
print(f"fresh clone: the wheel holds the shipped model and texts ({len(need)} files)")
PY
