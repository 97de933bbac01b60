"""One copy of the recipe's ``gamma`` default: every recipe-level entry point (what users get from
:class:`tinyattn.SparsityConfig` and the runtimes, integrations, evaluations and commands built on it) takes its
default *from* :data:`tinyattn.layer.DEFAULT_GAMMA` (the same object, not an equal literal), so that changing the
recipe cannot miss one; the op level (``tinyattn.ops``, ``tinyattn.kernels``, the custom ops) keeps ``gamma = 1.0``,
Quest's upper bound (Quest §3.2), whatever the recipe says."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import pkgutil

import pytest
import torch

import tinyattn
from paths import REPO
from tinyattn.layer import DEFAULT_GAMMA

# (module, qualified name of a callable with a ``gamma`` parameter): the recipe's entry points
RECIPE_CALLABLES = [
    ("tinyattn.layer", "quest_settings"),
    ("tinyattn.models.llama", "LlamaRuntime.__init__"),
    ("tinyattn.engine.engine", "Engine.__init__"),
    ("tinyattn.engine.nll", "teacher_forced_nll"),
    ("tinyattn.integrations.hf", "TinyAttnCache.__init__"),
    ("tinyattn.models.evaluate", "evaluate"),
    ("tinyattn.retrieval.evaluate", "evaluate_tasks"),
]


def _resolve(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _gamma_default(fn):
    return inspect.signature(fn).parameters["gamma"].default


def test_the_recipe_default_is_the_box_estimate_measured_on_ruler():
    # 0.25: RULER niah_single_1 on SmolLM2-135M (docs/accuracy.md, issue 35); a change of recipe changes this line
    assert isinstance(DEFAULT_GAMMA, float) and DEFAULT_GAMMA == 0.25
    assert "DEFAULT_GAMMA" in tinyattn.layer.__all__


def test_sparsity_config_takes_the_recipe_default():
    field = {f.name: f for f in dataclasses.fields(tinyattn.layer.SparsityConfig)}["gamma"]
    assert field.default is DEFAULT_GAMMA
    assert tinyattn.SparsityConfig(page_budget=4).gamma == DEFAULT_GAMMA
    # a policy other than quest takes no gamma: the default is not "set", whatever its value
    assert tinyattn.SparsityConfig(page_budget=4, policy="h2o").gamma == DEFAULT_GAMMA
    # ... but any other value, Quest's bound included, is a setting the policy does not take
    with pytest.raises(ValueError, match="policy"):
        tinyattn.SparsityConfig(page_budget=4, policy="h2o", gamma=1.0)


@pytest.mark.parametrize("module, qualname", RECIPE_CALLABLES, ids=[q for _, q in RECIPE_CALLABLES])
def test_recipe_entry_point_default_is_the_constant(module, qualname):
    assert _gamma_default(_resolve(module, qualname)) is DEFAULT_GAMMA


def test_lm_eval_model_default_is_the_constant():
    # lm-eval itself first: the adapter raises a plain ImportError without it, which pytest >= 9's importorskip
    # does not swallow (it skips only ModuleNotFoundError)
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness, of the eval extra: pip install -e '.[eval]'")
    import tinyattn.integrations.lm_eval as lm_eval
    assert _gamma_default(lm_eval.TinyAttnLM.__init__) is DEFAULT_GAMMA


def test_hf_enable_falls_back_to_the_cache_default():
    hf = pytest.importorskip("tinyattn.integrations.hf", reason="the hf extra")
    assert "gamma" in hf.SETTINGS                 # enable(model) with no gamma: TinyAttnCache's default (above)
    assert "gamma" not in inspect.signature(hf.enable).parameters


def _gamma_actions(parser: argparse.ArgumentParser, path=()):
    for action in parser._actions:
        if action.dest == "gamma":
            yield " ".join(path), action
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _gamma_actions(sub, (*path, name))


def test_every_cli_gamma_option_defaults_to_the_constant():
    from tinyattn.cli import build_parser

    found = dict(_gamma_actions(build_parser()))
    assert {"generate", "eval", "serve-bench"} <= set(found), sorted(found)
    for command, action in found.items():
        assert action.default is DEFAULT_GAMMA, command
        assert f"(default: {DEFAULT_GAMMA:g}" in action.help, (command, action.help)


def test_serve_bench_selection_without_gamma_takes_the_constant():
    from tinyattn.engine import serve_bench

    assert serve_bench._selection("quest", argparse.Namespace())["gamma"] is DEFAULT_GAMMA


def test_vllm_setting_defaults_to_the_constant():
    from tinyattn.integrations import vllm

    assert vllm.ENV_VARS["TINYATTN_GAMMA"][1] is DEFAULT_GAMMA
    assert vllm.settings_from_env({}).gamma == DEFAULT_GAMMA
    assert vllm.settings_from_env({"TINYATTN_PAGE_BUDGET": "8"}).gamma == DEFAULT_GAMMA


# ------------------------------------------------------------------------------------------------ no literal left
# gamma parameters outside the ops that are not the recipe's: selection.py's box_logit_estimates is a primitive
# (Quest's bound at 1, like the ops), box_page_log_mass and QuestMassPolicy are the questmass policy's own gamma
NOT_THE_RECIPE = {("tinyattn/selection.py", "box_logit_estimates"), ("tinyattn/selection.py", "box_page_log_mass"),
                  ("tinyattn/selection.py", "__init__")}


def _literal_gamma_defaults(path):
    """(function name, value) of every ``gamma=<number>`` parameter default in the file's source."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            pairs = list(zip(a.args[len(a.args) - len(a.defaults):], a.defaults))
            pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            for arg, default in pairs:
                if arg.arg == "gamma" and isinstance(default, ast.Constant):
                    yield getattr(node, "name", "<lambda>"), default.value
        elif (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "gamma"
              and isinstance(node.value, ast.Constant)):              # a dataclass field
            yield "<field>", node.value.value


def test_no_recipe_module_spells_the_default_as_a_literal():
    pkg = REPO / "tinyattn"
    files = [p for p in sorted(pkg.rglob("*.py")) if p.relative_to(pkg).parts[0] not in ("ops", "kernels")]
    assert len(files) > 20
    found = [(str(p.relative_to(REPO)), name, value) for p in files for name, value in _literal_gamma_defaults(p)
             if (str(p.relative_to(REPO)), name) not in NOT_THE_RECIPE]
    assert found == [], "take the default from tinyattn.layer.DEFAULT_GAMMA"


# ------------------------------------------------------------------------------------------------ the op level
def _op_modules():
    for package in (tinyattn.ops, importlib.import_module("tinyattn.kernels")):
        yield package
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            yield importlib.import_module(info.name)


def _op_gamma_defaults():
    """(qualified name, default) of every ``gamma`` parameter with a default defined in tinyattn.ops / kernels."""
    for mod in _op_modules():
        for name, obj in vars(mod).items():
            if getattr(obj, "__module__", None) != mod.__name__:
                continue
            members = [(name, obj)]
            if inspect.isclass(obj):
                members += [(f"{name}.{n}", m) for n, m in vars(obj).items() if inspect.isfunction(m)]
                if dataclasses.is_dataclass(obj):
                    members += [(f"{name}.{f.name}", f.default) for f in dataclasses.fields(obj) if f.name == "gamma"]
                if "gamma" in getattr(obj, "_field_defaults", {}):            # a NamedTuple
                    members.append((f"{name}.gamma", obj._field_defaults["gamma"]))
            for qual, member in members:
                if not inspect.isfunction(member):
                    if qual.endswith(".gamma"):
                        yield f"{mod.__name__}.{qual}", member
                    continue
                p = inspect.signature(member).parameters.get("gamma")
                if p is not None and p.default is not inspect.Parameter.empty:
                    yield f"{mod.__name__}.{qual}", p.default


def test_the_ops_keep_quests_bound():
    found = dict(_op_gamma_defaults())
    for expected in ("tinyattn.ops.api.sparse_paged_attention", "tinyattn.ops.api.page_scores",
                     "tinyattn.ops.plan.PagedAttentionPlan.plan", "tinyattn.kernels.launches.Shape.gamma"):
        assert any(name.startswith(expected) for name in found), (expected, sorted(found))
    assert {name: d for name, d in found.items() if d != 1.0} == {}
    # the public names, and the registered custom ops' schemas
    assert _gamma_default(tinyattn.sparse_paged_attention) == 1.0
    assert _gamma_default(tinyattn.page_scores) == 1.0
    assert _gamma_default(tinyattn.PagedAttentionPlan.plan) == 1.0
    importlib.import_module("tinyattn.ops.custom_ops")          # registers torch.ops.tinyattn

    for op in ("page_scores", "select_pages_planned"):
        (arg,) = [a for a in getattr(torch.ops.tinyattn, op).default._schema.arguments if a.name == "gamma"]
        assert arg.default_value == 1.0, op
