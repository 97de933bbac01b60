"""Repository hygiene: what docs/api.md documents is importable from ``tinyattn``, ``import tinyattn`` stays
light, no dead helpers or duplicated constants come back, the model modules import in one direction and nothing
below the command line imports it, and output folders are git-ignored."""

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from paths import REPO as ROOT
from commands import run_subprocess

import tinyattn

API_MD = ROOT / "docs" / "api.md"


def _resolve(dotted: str):
    """``a.b.c`` below ``tinyattn`` by attribute access, importing a submodule when an attribute is missing."""
    obj, path = tinyattn, "tinyattn"
    for part in dotted.split("."):
        path = f"{path}.{part}"
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(path)
    return obj


def _documented_names():
    text = API_MD.read_text()
    dotted = set(re.findall(r"\btinyattn\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)", text))
    imported = {}
    for module, names in re.findall(r"^from (tinyattn(?:\.\w+)*) import ([\w, ]+)$", text, flags=re.M):
        for name in names.split(","):
            imported[name.strip()] = module
    return dotted, imported


def test_api_md_names_are_found():
    dotted, imported = _documented_names()
    # the parse itself: the names the issue lists, and the ops, must be among them
    assert {"paged_attention", "sparse_paged_attention", "page_grad_norms"} <= dotted
    assert {"PagedKVCache", "CacheFullError", "LlamaRuntime", "LlamaModel", "Tokenizer"} <= set(imported)


@pytest.mark.parametrize("dotted", sorted(_documented_names()[0]))
def test_every_tinyattn_dotted_name_in_api_md_exists(dotted):
    if dotted.startswith(("integrations.hf", "integrations.convert")):
        pytest.importorskip("transformers", reason="the hf extra")
    assert _resolve(dotted) is not None


@pytest.mark.parametrize("name,module", sorted(_documented_names()[1].items()))
def test_every_name_api_md_imports_is_also_a_tinyattn_attribute(name, module):
    assert getattr(tinyattn, name) is getattr(importlib.import_module(module), name)
    assert name in dir(tinyattn)


@pytest.mark.slow
def test_import_tinyattn_is_light_and_loads_the_rest_on_demand():
    code = ("import sys, tinyattn\n"
            "heavy = [m for m in ('triton', 'tinyattn.models', 'tinyattn.cache', 'tinyattn.training', 'tinyattn.cli',"
            " 'transformers', 'matplotlib') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "assert tinyattn.CacheFullError.__module__ == 'tinyattn.cache'\n"
            "assert 'tinyattn.cache' in sys.modules and 'tinyattn.models' not in sys.modules\n"
            "assert tinyattn.metrics.ideal_speedup(32768, 128, 16, 128) == 8.0\n"
            "try:\n    tinyattn.no_such_name\nexcept AttributeError as e:\n    assert 'no_such_name' in str(e)\n"
            "else:\n    raise SystemExit('no AttributeError')\n")
    env_code = run_subprocess([sys.executable, "-c", code], quiet_seconds=10, cwd=ROOT, capture_output=True, text=True)
    assert env_code.returncode == 0, env_code.stderr[-3000:]


def test_dead_code_stays_removed():
    from tinyattn.cache import PagedKVCache
    from tinyattn.ops import custom_ops, validation
    from tinyattn.selection import SelectionMetrics

    assert not hasattr(custom_ops, "_kernels")
    assert not hasattr(validation.PagedShapes, "group_size")
    assert not hasattr(PagedKVCache, "used_kv_bytes")
    assert not hasattr(SelectionMetrics, "per_layer")
    assert not (ROOT / "bench" / "_shim").exists() and not (ROOT / "bench" / "gpu_tests.py").exists()
    # no GPU test whose only outcome is a skip
    assert "def test_autotuned_kernels_run" not in (ROOT / "tests" / "gpu" / "test_gpu_kernels.py").read_text()


def test_log2e_is_written_once():
    from tinyattn.kernels import attention

    hits = [(p.name, line) for p in (ROOT / "tinyattn").rglob("*.py")
            for line in p.read_text().splitlines() if "1.4426950" in line]
    assert len(hits) == 1 and hits[0][0] == "attention.py" and hits[0][1].startswith("LOG2E = ")
    assert attention.LOG2E == 1.4426950408889634 and attention._LOG2E.value == attention.LOG2E


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            out.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_llama2c_does_not_import_the_model_module():
    models = ROOT / "tinyattn" / "models"
    imports = _imports(models / "llama2c.py") | _imports(models / "config.py")
    assert not {".llama", "tinyattn.models.llama", "tinyattn.models"} & imports
    from tinyattn.models import LlamaConfig, config, llama, llama2c
    assert llama.LlamaConfig is llama2c.LlamaConfig is config.LlamaConfig is LlamaConfig


def test_nothing_below_the_cli_imports_it():
    """Only the entry points import ``tinyattn.cli``; the engine's serve-bench loads models through
    ``tinyattn.models.loading`` (no import cycle through the command line)."""
    offenders = []
    for path in (ROOT / "tinyattn").rglob("*.py"):
        if path.name == "__main__.py" or path.name == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                if any(re.fullmatch(r"(tinyattn\.)?cli(\..*)?|\.+cli", n) or n == "tinyattn.cli" for n in names) \
                        or (node.level and node.module == "cli") or (node.level and node.module is None and any(
                            a.name == "cli" for a in node.names)):
                    offenders.append(str(path.relative_to(ROOT)))
            elif isinstance(node, ast.Import) and any(a.name == "tinyattn.cli" for a in node.names):
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders


def test_no_test_names_a_fixed_folder_under_tmp_or_home():
    """Tests write below their tmp_path (tests/conftest.py moves the libraries' caches there too); a literal
    ``/tmp/...`` or ``~/...`` path in a test would outlive the run and collide with parallel runs."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.match(r"(/tmp|~|/root|/home)/",
                                                                                            node.value):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:60]}")
    assert not offenders


def test_out_folders_are_git_ignored():
    ignore = (ROOT / ".gitignore").read_text().split()
    assert "/out/" in ignore            # convert's default out/<model>-hf, bench's out/bench, finetune's out/...


def _download_packages(text: str) -> set[str]:
    """Package names of the ``pip download ... -d .whl`` command in ``text`` (continuation lines joined)."""
    joined = re.sub(r"\\\n[#\s]*", " ", text)
    cmd = re.search(r"pip download ([^\n]*)", joined).group(1)
    words = cmd.split()
    names, skip = set(), False
    for w in words:
        if skip:
            skip = False
        elif w in ("-d", "--platform", "--python-version", "--dest"):
            skip = True
        elif not w.startswith("-"):
            names.add(w)
    return names


def test_gpu_script_runs_real_pytest_with_carried_wheels():
    script = (ROOT / "bench" / "gpu.sh").read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu.sh")]).returncode == 0
    assert "_shim" not in script and "gpu_tests.py" not in script
    assert any("python -m pytest" in line and line.rstrip().split()[-2:] == ["tests/gpu", "-rs"]
               for line in script.splitlines() if line.startswith("step gpu_tests"))
    assert "--no-index --find-links .whl" in script
    assert "/.whl/" in (ROOT / ".gitignore").read_text().split()
    wheels = _download_packages(script)
    assert {"einops", "pytest", "hypothesis", "pytest-xdist", "tqdm", "pygments"} <= wheels
    # docs/benchmarks.md documents the same download
    assert _download_packages((ROOT / "docs" / "benchmarks.md").read_text()) == wheels


def test_one_glossary_and_no_ambiguous_size_letters():
    text = (ROOT / "docs" / "layout.md").read_text()
    glossary = text[text.index("## Names"):text.index("## The page pool")]
    for name in ("`B`", "`Tq`", "`Hq`, `Hkv`", "`G`", "`D`", "`page_size`", "`num_pages`", "`max_pages_per_seq`",
                 "`page_budget`", "`num_splits`", "`num_valid_pages`"):
        assert f"| {name}" in glossary, name
    # torch-side modules follow it: no size called P (pool pages? table width?) or S (page size? splits?)
    torch_side = ["ops/custom_ops.py", "ops/layout.py", "ops/plan_torch.py", "ops/plan_triton.py", "ops/api.py",
                  "ops/kv_cache/torch_impl.py", "ops/selection/torch_impl.py", "ops/attention/torch_impl.py"]
    for rel in ("cache.py", "selection.py", "profiler.py", "metrics.py", "training/memory.py", *torch_side):
        tree = ast.parse((ROOT / "tinyattn" / rel).read_text())
        stored = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        assert not stored & {"P", "S"}, (rel, stored & {"P", "S"})
