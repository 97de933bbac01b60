"""What a new user and a busy machine tripped on (issue 28, items 3, 4, 5 and 7): the plots extra, the loader below
the CLI, the command line's OpenMP setting, clear errors for a CUDA-less torch and a misspelt option, and docs that
agree with the repository."""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_subprocess

REPO = Path(__file__).resolve().parents[1]


def _run_main(args, capsys):
    from tinyattn.cli import main

    try:
        code = main(args)
    except SystemExit as exc:          # argparse errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


# ---- item 3: matplotlib is an extra ----------------------------------------------------------------------------
def test_core_dependencies_leave_matplotlib_to_the_plots_extra():
    tomllib = pytest.importorskip("tomllib")           # Python >= 3.11
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert not [d for d in project["dependencies"] if d.startswith("matplotlib")]
    assert any(d.startswith("matplotlib") for d in project["optional-dependencies"]["plots"])


def test_eval_plot_dir_without_matplotlib_writes_csv_json_and_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # as if not installed: import fails
    plots = tmp_path / "plots"
    code, out, err = _run_main(["eval", "--max-stories", "1", "--max-context", "40", "--page-size", "8",
                                "--page-budgets", "2,4", "--backend", "torch", "--no-progress",
                                "--plot-dir", str(plots)], capsys)
    assert code == 0, err
    assert 'pip install "tinyattn[plots]"' in err
    assert (plots / "results.csv").exists() and (plots / "results.json").exists()
    assert not list(plots.glob("*.png"))


def test_import_tinyattn_stays_light():
    """``import tinyattn`` loads the ops and torch, not matplotlib, triton, transformers or the model code."""
    code = ("import sys, tinyattn\n"
            "heavy = [m for m in ('matplotlib', 'triton', 'transformers', 'tinyattn.models', 'tinyattn.cli')"
            " if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    proc = run_subprocess([sys.executable, "-c", code], quiet_seconds=10, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


# ---- item 4: no import cycle through the CLI -------------------------------------------------------------------
def test_nothing_below_the_cli_imports_it():
    """Only the entry points import ``tinyattn.cli``; the engine's serve-bench loads models through
    ``tinyattn.models.loading`` (it used to import the CLI's private ``_load``)."""
    offenders = []
    for path in (REPO / "tinyattn").rglob("*.py"):
        if path.name == "__main__.py" or path.name == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                if any(re.fullmatch(r"(tinyattn\.)?cli(\..*)?|\.+cli", n) or n == "tinyattn.cli" for n in names) \
                        or (node.level and node.module == "cli") or (node.level and node.module is None and any(
                            a.name == "cli" for a in node.names)):
                    offenders.append(str(path.relative_to(REPO)))
            elif isinstance(node, ast.Import) and any(a.name == "tinyattn.cli" for a in node.names):
                offenders.append(str(path.relative_to(REPO)))
    assert not offenders


# ---- item 5: OpenMP's wait policy, set by the command line before torch loads -----------------------------------
@pytest.mark.parametrize("argv0, expected", [("-m", "PASSIVE"), ("/venv/bin/tinyattn", "PASSIVE"),
                                             ("script.py", "None")])
def test_command_line_sets_omp_wait_policy_before_torch(argv0, expected):
    """``python -m tinyattn`` (argv[0] is ``-m`` while the package loads) and the ``tinyattn`` script get
    ``OMP_WAIT_POLICY=PASSIVE`` before torch is imported; a library user's process is left alone."""
    code = (f"import sys; sys.argv[0] = {argv0!r}\n"
            "import os, tinyattn\n"
            "print(os.environ.get('OMP_WAIT_POLICY'))\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    proc = run_subprocess([sys.executable, "-c", code], quiet_seconds=10, cwd=REPO, env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == expected
    env["OMP_WAIT_POLICY"] = "ACTIVE"                    # a value the user set is kept
    proc = run_subprocess([sys.executable, "-c", code], quiet_seconds=10, cwd=REPO, env=env, capture_output=True,
                          text=True)
    assert proc.stdout.strip() == "ACTIVE"


# ---- item 7: errors a newcomer meets ---------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a torch without CUDA")
def test_paged_kv_cache_on_cuda_without_cuda_is_a_clear_value_error():
    from tinyattn.cache import PagedKVCache

    with pytest.raises(ValueError, match=r"device: .*'cuda'.*no CUDA device.*device='cpu'"):
        PagedKVCache(1, 2, 8, page_size=4, num_pages=2, device="cuda")


def test_misspelt_option_gives_the_commands_usage_and_a_suggestion(capsys):
    code, out, err = _run_main(["generate", "--page-budjet", "4"], capsys)
    assert code == 2
    assert "usage: tinyattn generate" in err
    assert "unrecognized arguments: --page-budjet 4 (did you mean --page-budget?)" in err
    code, _, err = _run_main(["eval", "--zzz"], capsys)
    assert code == 2 and "usage: tinyattn eval" in err and "did you mean" not in err


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


def test_docs_cite_pages_that_exist():
    """The design card the code and docs cite as DESIGN.md is in the repository; no doc points outside it."""
    assert (REPO / "docs" / "DESIGN.md").exists()
    for path in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        text = path.read_text(encoding="utf-8")
        assert "../shared" not in text and "git+<" not in text, path.name
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if not target.startswith(("http://", "https://")):
                assert (path.parent / target).exists(), f"{path.name}: {target}"
