"""docs/layout.md's "Where each rule lives" held against the code: every rule has exactly three implementations
(reference, torch form, Triton form), each named function exists where the table says, and the packages that
use the ops (the cache, integrations, models, engine, training) keep no copy of a window, box, lse or bound
formula.
"""

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tinyattn"
LAYOUT = ROOT / "docs" / "layout.md"


def _rule_table() -> list[tuple[str, list[list[str]]]]:
    """The rows of the table under "Where each rule lives": (rule, [cell names of reference, torch, Triton])."""
    text = LAYOUT.read_text(encoding="utf-8")
    section = text.split("## Where each rule lives", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("rule", "---") or set(cells[0]) <= {"-"}:
            continue
        rows.append((cells[0], [re.findall(r"`([^`]+)`", c) for c in cells[1:]]))
    return rows


def _defined(path: Path, name: str) -> bool:
    """Whether ``name`` is a function, class or ``@triton.jit`` kernel defined at any depth of ``path``."""
    return re.search(rf"^\s*(def|class)\s+{re.escape(name)}\b", path.read_text(encoding="utf-8"), re.M) is not None


def test_every_rule_has_a_reference_a_torch_form_and_a_triton_form_that_exist():
    rows = _rule_table()
    assert len(rows) >= 10, "the rule table of docs/layout.md was not found"
    for rule, cells in rows:
        for column, names in zip(("reference", "torch form", "Triton form"), cells):
            assert names, f"{rule}: no {column}"
            module = None
            for name in names:
                if "::" in name:                              # a new file: `path::function`
                    file, name = name.split("::")
                    module = PACKAGE / file
                    assert module.exists(), f"{rule}: {column} {file} does not exist"
                name = name.split(" ")[0]
                assert module is not None and _defined(module, name), f"{rule}: {column} {name} not in {module}"
        reference, torch_form, triton_form = (cell[0].split("::")[0] for cell in cells)
        assert "reference.py" in reference and "torch_impl.py" in torch_form and triton_form.startswith("kernels/"), \
            f"{rule}: the three forms live in reference.py, torch_impl.py and kernels/"


def test_each_ops_family_holds_its_three_forms_side_by_side():
    for family in ("kv_cache", "selection", "attention"):
        folder = PACKAGE / "ops" / family
        assert {p.name for p in folder.glob("*.py")} == {"__init__.py", "reference.py", "torch_impl.py",
                                                         "triton_impl.py"}, family
        launchers = (folder / "triton_impl.py").read_text(encoding="utf-8")
        assert "@triton.jit" not in launchers, f"{family}: kernels stay in tinyattn/kernels/"
    for kernel in (PACKAGE / "kernels").glob("*.py"):
        text = kernel.read_text(encoding="utf-8")
        assert not re.search(r"^def \w+\(.*\bout: torch\.Tensor", text, re.M), \
            f"{kernel.name}: launchers live in tinyattn/ops/<family>/triton_impl.py"


# a formula of a rule, as the torch forms write it; none may appear outside tinyattn/ops and tinyattn/kernels
FORMULAS = {
    "page box (min / max of keys)": r"(index_reduce_\(|k_m(in|ax)\b.*\.am(in|ax)\(|\.am(in|ax)\(.*k_m(in|ax)\b)",
    "sliding window start": r"-\s*window_left\b(?!\s*=)",
    "softmax lse": r"logsumexp|torch\.log\(\s*denom|\blse\s*=\s*.*\blog\(",
    "attention (SDPA / masked softmax of logits)":
        r"scaled_dot_product_attention\(|masked_fill\(.*-inf.*\)\s*\n.*softmax",
    "Quest bound": r"clamp\(m(in|ax)=0\).*k_m(in|ax)|torch\.maximum\(.*k_min.*k_max",
}
USERS = ["cache.py", "integrations", "models", "engine", "training"]


def _code(file: Path) -> str:
    """The source of ``file`` with its strings and comments blanked (docstrings describe rules; code computes them),
    line numbers kept."""
    lines = file.read_text(encoding="utf-8").splitlines(keepends=True)
    for tok in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT):
            (r0, c0), (r1, c1) = tok.start, tok.end
            for r in range(r0, r1 + 1):
                line = lines[r - 1]
                a = c0 if r == r0 else 0
                b = c1 if r == r1 else len(line.rstrip("\n"))
                lines[r - 1] = line[:a] + " " * (b - a) + line[b:]
    return "".join(lines)


@pytest.mark.parametrize("where", USERS)
def test_no_rule_formula_outside_the_ops(where):
    path = PACKAGE / where
    files = [path] if path.is_file() else sorted(path.rglob("*.py"))
    found = []
    for file in files:
        text = _code(file)
        for rule, pattern in FORMULAS.items():
            for m in re.finditer(pattern, text):
                line = text[: m.start()].count("\n") + 1
                found.append(f"{file.relative_to(ROOT)}:{line}: {rule}: {m.group(0).strip()[:60]}")
    assert not found, "a rule's formula outside tinyattn/ops (call the ops' form instead):\n" + "\n".join(found)
