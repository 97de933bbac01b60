"""``python -m tinyattn eval --task ...``: help, errors, and an end-to-end run on a tiny random retrieval
checkpoint (the real task generators, JSON / CSV / PNG outputs)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tinyattn.cli import main
from tinyattn.retrieval.tasks import min_context_tokens

MIN_PASSKEY = min_context_tokens("passkey")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tinyattn.models import LlamaConfig, LlamaModel
    from tinyattn.retrieval import CharTokenizer, save_retrieval_model

    torch.manual_seed(0)
    tok = CharTokenizer()
    model = LlamaModel(LlamaConfig(dim=16, hidden_dim=32, n_layers=2, n_heads=2, n_kv_heads=1,
                                   vocab_size=tok.vocab_size, max_seq_len=512))
    return save_retrieval_model(model, tok, tmp_path_factory.mktemp("ckpt"))


def run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow
def test_end_to_end(checkpoint, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the PNGs need the plots extra")
    argv = ["eval", "--task", "passkey,multikey", "--model", str(checkpoint), "--contexts", "256,320",
            "--depths", "0,100%", "--budgets", "1/2,1/4", "--page-sizes", "8", "--policies", "dense,quest,h2o",
            "--samples", "1", "--backend", "torch", "--no-progress", "--json", str(tmp_path / "r.json"),
            "--csv", str(tmp_path / "r.csv"), "--plot-dir", str(tmp_path / "plots")]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    assert "passkey, page_size=8" in out and "| context | budget | page_budget (tokens) | quest | h2o | dense |" in out
    data = json.loads((tmp_path / "r.json").read_text())
    rows = data["rows"]
    assert len(rows) == 2 * 2 * 2 * (1 + 2 * 2)        # tasks x contexts x depths x (dense + 2 policies x 2 budgets)
    assert {r["task"] for r in rows} == {"passkey", "multikey"} and {r["depth"] for r in rows} == {0.0, 1.0}
    assert {(r["context"], r["budget_fraction"], r["page_budget"]) for r in rows if r["policy"] == "quest"} == {
        (256, 0.5, 16), (256, 0.25, 8), (320, 0.5, 20), (320, 0.25, 10)}   # 32 and 40 pages of 8 tokens
    assert data["meta"]["decode_prompt_tokens"] == "question" and data["meta"]["model_path"] == str(checkpoint)
    assert (tmp_path / "r.csv").read_text().splitlines()[0] == (
        "task,policy,context,depth,page_size,page_budget,budget_fraction,token_budget,accuracy,token_accuracy,samples")
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "budget_multikey_ps8.png", "budget_passkey_ps8.png", "heatmap_multikey_ps8.png", "heatmap_passkey_ps8.png"]
    # the same command again: the same rows (deterministic)
    code, _, err = run(argv[:-6] + ["--json", str(tmp_path / "again.json")], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "again.json").read_text())["rows"] == rows


def test_gamma_and_top_p_reach_the_quest_configs(checkpoint, tmp_path, capsys):
    """--gamma / --top-p on the retrieval harness: recorded, taken by quest (a covering capacity with p = 1 answers
    as dense on every sample), and the other policies run as they are (no error for streaming)."""
    argv = ["eval", "--task", "passkey", "--model", str(checkpoint), "--contexts", str(MIN_PASSKEY + 32),
            "--depths", "0,1", "--budgets", "1,1/2", "--page-sizes", "8", "--policies", "dense,quest,streaming",
            "--samples", "2", "--backend", "torch", "--no-progress", "--gamma", "0.5", "--top-p", "1.0",
            "--json", str(tmp_path / "r.json")]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["meta"]["gamma"] == 0.5 and data["meta"]["top_p"] == 1.0          # not the default (0.25)
    rows = data["rows"]
    dense = {r["depth"]: r for r in rows if r["policy"] == "dense"}
    full = {r["depth"]: r for r in rows if r["policy"] == "quest" and r["budget_fraction"] == 1.0}
    assert dense.keys() == full.keys() == {0.0, 1.0}
    for depth in dense:
        assert (full[depth]["accuracy"], full[depth]["token_accuracy"]) == (dense[depth]["accuracy"],
                                                                             dense[depth]["token_accuracy"])
    assert {r["budget_fraction"] for r in rows if r["policy"] == "streaming"} == {1.0, 0.5}


def test_help_explains_every_task_option(capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for option, default in [("--task", None), ("--contexts", "1024,2048,4096,8192"), ("--depths", "0,0.25,0.5,0.75,1"),
                            ("--budgets", "1/8,1/16,1/32,1/64,1/128"), ("--samples", "4"), ("--seed", "0"),
                            ("--decode-prompt-tokens", "question"), ("--page-sizes", None), ("--policies", None),
                            ("--json", None), ("--csv", None), ("--plot-dir", None), ("--backend", None)]:
        assert option in text
        if default is not None:
            assert re.search(re.escape(option) + r" .*?\(default: " + re.escape(default) + r"\)", text), option
    assert "passkey, multikey, multihop, decoy" in text


def test_cli_defaults_are_the_harness_defaults():
    from tinyattn.retrieval import eval_command, evaluate

    assert eval_command._context_list(eval_command._CONTEXTS) == list(evaluate.DEFAULT_CONTEXTS)
    assert eval_command._depth_list(eval_command._DEPTHS) == list(evaluate.DEFAULT_DEPTHS)
    assert [evaluate.parse_fraction(b) for b in eval_command._budget_list(eval_command._BUDGETS)] == list(
        evaluate.DEFAULT_BUDGETS)
    assert eval_command._POLICIES == evaluate.DEFAULT_POLICIES


@pytest.mark.parametrize("args,pattern", [
    (["--task", "needle"], r"argument --task: expected a comma-separated list of passkey, multikey, multihop, decoy "
                           r"\(or all\), got 'needle'"),
    (["--task", "passkey", "--budgets", "1/16,2"], r"argument --budgets: expected .*fractions of the context in "
                                                   r"\(0, 1\].*\('2' is not one\)"),
    (["--task", "passkey", "--budgets", "x"], r"argument --budgets: .*got 'x'"),
    (["--task", "passkey", "--depths", "0.5,1.5"], r"argument --depths: expected .*depths in \[0, 1\].*got '0.5,1.5'"),
    (["--task", "passkey", "--contexts", "1"], r"argument --contexts: expected prompt lengths in tokens >= 2, got '1'"),
    (["--task", "passkey", "--policies", "lru"], r"argument --policies: expected .*dense, quest.*got 'lru'"),
    (["--task", "passkey", "--decode-prompt-tokens", "-2"], r"argument --decode-prompt-tokens: expected 'question' or "
                                                           r"an integer >= 0, got '-2'"),
    (["--task", "passkey", "--samples", "0"], r"argument --samples: expected an integer >= 1, got 0"),
])
def test_argument_errors(args, pattern, capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", *args])
    assert e.value.code == 2
    assert re.search(pattern, capsys.readouterr().err)


@pytest.mark.parametrize("args,pattern", [
    (["--page-budgets", "2,4"], r"--page-budgets applies to the NLL evaluation, not to --task; give --budgets"),
    (["--tokenizer", "tok.bin"], r"--tokenizer applies to the NLL evaluation, not to --task; the retrieval "
                                 r"checkpoint brings its character tokenizer"),
    (["--max-context", "512"], r"--max-context applies .*; give --contexts"),
    (["--contexts", str(MIN_PASSKEY - 1)], rf"contexts: the passkey task needs prompts of at least {MIN_PASSKEY} "
                                           rf"tokens \(its needles and question\), got {MIN_PASSKEY - 1}"),
    (["--num-sink-pages", "2", "--num-recent-pages", "0", "--budgets", "1/128"], None),
])
def test_run_errors(checkpoint, args, pattern, capsys):
    code, _, err = run(["eval", "--task", "passkey", "--model", str(checkpoint), "--no-progress", "--samples", "1",
                        "--depths", "0.5", "--contexts", "160", "--policies", "dense", "--backend", "torch", *args],
                       capsys)
    if pattern is None:                       # a legal corner: runs
        assert code == 0, err
        return
    assert code == 2, err
    assert "Traceback" not in err
    assert re.search(r"tinyattn eval: error: " + pattern, err), err


def test_missing_checkpoint(tmp_path, capsys):
    code, _, err = run(["eval", "--task", "passkey", "--model", str(tmp_path / "nope")], capsys)
    assert code == 2
    assert re.search(r"tinyattn eval: error: path: the retrieval checkpoint .*nope' has no config.json", err), err


def test_task_all():
    from tinyattn.retrieval import TASKS
    from tinyattn.retrieval.eval_command import _task_list

    assert _task_list("all") == list(TASKS)
    assert _task_list(" Passkey , decoy,passkey") == ["passkey", "decoy"]
