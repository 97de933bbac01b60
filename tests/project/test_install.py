"""Installing tinyattn: what the wheel ships (pyproject's package data), what the core install leaves to the extras,
the install lines the docs give (from a checkout; the vLLM venv's list equal to CI's), and no path outside the
repository. The fresh-clone install itself is .ci/fresh_clone.sh (run by .ci/run)."""

from __future__ import annotations

import fnmatch
import re

import pytest

from paths import REPO
from tinyattn import assets

DATA = REPO / "tinyattn" / "data"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python >= 3.11's")
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def test_package_data_covers_every_shipped_file():
    """pyproject's package-data globs match every file of tinyattn/data/ (the wheel check is in .ci/fresh_clone.sh)."""
    globs = _pyproject()["tool"]["setuptools"]["package-data"]["tinyattn"]
    files = sorted(p.name for p in DATA.iterdir() if p.is_file())
    assert set(files) == set(assets.DATA_FILES)
    for name in files:
        assert any(fnmatch.fnmatch(f"data/{name}", g) for g in globs), name


def test_core_dependencies_leave_matplotlib_to_the_plots_extra():
    project = _pyproject()["project"]
    assert not [d for d in project["dependencies"] if d.startswith("matplotlib")]
    assert any(d.startswith("matplotlib") for d in project["optional-dependencies"]["plots"])


def test_nothing_in_the_package_refers_to_shared():
    """The package reads nothing from a ../shared folder beside the checkout (a fresh clone has none)."""
    offenders = []
    for path in (REPO / "tinyattn").rglob("*.py"):
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"\.\./shared|[\"']shared[\"']\s*\)?\s*/", line):
                offenders.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not offenders, offenders


def test_docs_pip_lines_install_from_the_checkout():
    """tinyattn is not on PyPI: every pip line of README and docs installs it from the checkout (-e .) or git."""
    for path in DOCS:
        for line in re.findall(r"pip install[^\n`]*", path.read_text(encoding="utf-8")):
            bare = re.search(r"pip install\s+[\"']?tinyattn(\[[^\]]*\])?(?!\s*@)[\"']?(\s|$)", line)
            assert not bare, f"{path.name}: {line} (tinyattn is not on PyPI: -e . or tinyattn @ git+...)"


def test_vllm_install_lists_agree():
    """docs/vllm.md's install block and .ci/vllm.sh install the same packages, in the same order."""
    doc = (REPO / "docs" / "vllm.md").read_text(encoding="utf-8")
    block = re.search(r"## Install.*?```bash\n(.*?)```", doc, re.S).group(1)

    def installs(lines, prefix):
        out = []
        for line in lines:
            line = line.split("#", 1)[0].split("||", 1)[0].strip()
            m = re.match(prefix + r"\s+(install|uninstall)\s+(.*)", line)
            if m:
                words = [w for w in m.group(2).split() if w not in ("-q", "-y", "--upgrade")]
                if words != ["pip"]:
                    out.append((m.group(1), words))
        return out

    ci = (REPO / ".ci" / "vllm.sh").read_text(encoding="utf-8").splitlines()
    assert installs(block.splitlines(), r"\.venv-vllm/bin/pip") == installs(ci, r'"\$VENV/bin/python" -m pip')
