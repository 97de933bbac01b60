"""The command line (tinyattn/cli.py): ``python -m tinyattn`` through a subprocess (help, generate, eval), then
in-process: every command with no path (the shipped model and texts), usage lines that name the program, the
OpenMP setting made before torch loads, the plots extra left optional, and errors that name the option."""

from __future__ import annotations

import os
import re
import struct
import sys

import pytest
import torch

from paths import CKPT, KNOWN_GOOD, REPO, TOKENIZER, VALID  # the shipped model and texts
from commands import assert_clean_error, model_args, run_cli, run_main, run_subprocess
from model_fixtures import short_context_model  # noqa: F401  (fixture)

MODEL_DIR = REPO.parent / "shared" / "models" / "stories260K"

needs_model = pytest.mark.skipif(not CKPT.exists() or not TOKENIZER.exists(), reason=f"{CKPT} is missing")
needs_shared_readme = pytest.mark.skipif(  # a maintainer's check: the model's upstream card is not shipped
    not (MODEL_DIR / "README.md").exists(),
    reason="stories260K's upstream model card (the known-good text's source) is not part of the repository")


@pytest.mark.parametrize("command", [[], ["generate"], ["eval"]])
@pytest.mark.slow
def test_help(command):
    proc = run_cli(*command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: python -m tinyattn" in proc.stdout and "example" in proc.stdout
    if command == ["generate"]:
        for opt in ("--model", "--tokenizer", "--prompt", "--max-new-tokens", "--temperature", "--seed",
                    "--page-size", "--page-budget", "--num-sink-pages", "--num-recent-pages", "--dense-layers",
                    "--backend"):
            assert opt in proc.stdout
    if command == ["eval"]:
        for opt in ("--data", "--page-budgets", "--max-stories", "--backend"):
            assert opt in proc.stdout


@pytest.mark.slow
def test_no_command_is_a_usage_error():
    proc = run_cli()
    assert proc.returncode == 2 and "usage:" in proc.stderr


@pytest.mark.slow
def test_generate_known_good_text_with_the_shipped_model(tmp_path):
    """No path at all, from a directory with no ../shared beside it: the shipped stories260K gives the known-good
    greedy text (200 tokens from BOS), and --no-stats output ends with exactly one newline."""
    assert not (tmp_path.parent / "shared").exists()
    proc = run_cli("generate", "--max-new-tokens", "200", "--temperature", "0", "--page-size", "16",
                   "--page-budget", "64", "--backend", "torch", "--no-stats", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == KNOWN_GOOD.read_text(encoding="utf-8")
    assert proc.stdout.endswith("she\n") and not proc.stdout.endswith("\n\n")


@needs_shared_readme
def test_known_good_file_is_the_model_readmes_text():
    readme = (MODEL_DIR / "README.md").read_text(encoding="utf-8")
    expected = re.search(r"## Known-good output.*?```\n(.*?)```", readme, re.S).group(1)
    assert KNOWN_GOOD.read_text(encoding="utf-8") == expected


@needs_model
@pytest.mark.slow
def test_generate_batch_with_stats():
    proc = run_cli("generate", *model_args(), "--prompt", "Tom had a dog", "--prompt", "Once upon a time",
                   "--max-new-tokens", "12", "--page-size", "4", "--page-budget", "2", "--backend", "torch",
                   "--temperature", "0.8", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "=== [0] ===\nTom had a dog" in out and "=== [1] ===\nOnce upon a time" in out
    # quest's gamma named even at its default: the default differs between versions (issue 35)
    for field in ("tokens/s", "pages read / step", "KV bytes / step", "KV cache", "page_budget=2",
                  "policy=quest, gamma=0.25"):
        assert field in out


@needs_model
@pytest.mark.slow
def test_eval_small():
    proc = run_cli("eval", *model_args(), "--data", str(VALID), "--max-stories", "2", "--max-context", "48",
                   "--page-size", "4", "--page-budgets", "2,4", "--backend", "torch", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| page_budget | token budget | mean NLL | ppl | top-1 agreement | KL")
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["dense", "2", "4"]
    assert [r.split("|")[2].strip() for r in rows[1:]] == ["all", "8", "16"]
    assert "2 stories, 94 target tokens" in proc.stdout


@pytest.mark.parametrize("args, pattern", [
    (["generate", "--model", "no/such/model.bin"], r"--model: file not found: no/such/model.bin"),
    (["eval", "--page-budgets", "2,x"], r"--page-budgets: expected an integer >= 1, got 'x'"),
])
@pytest.mark.slow
def test_errors_through_a_subprocess(args, pattern):
    assert_clean_error(run_cli(*args), pattern)


@needs_model
@pytest.mark.slow
def test_corrupt_model_through_a_subprocess(tmp_path):
    truncated = tmp_path / "model.bin"
    truncated.write_bytes(CKPT.read_bytes()[:5000])
    assert_clean_error(run_cli("generate", "--model", str(truncated), "--tokenizer", str(TOKENIZER)),
                       r"is not a llama2.c checkpoint, or a truncated one: file size 5,000 bytes does not match its "
                       r"header")


# the other paths in-process (a subprocess costs a torch import each): same main(), same exit status

@pytest.mark.parametrize("args, pattern", [
    (["generate", "--tokenizer", "no/such/tok.bin"], r"--tokenizer: file not found"),
    (["eval", "--data", "no/such/data.txt"], r"--data: file not found"),
    (["generate", "--page-budget", "0"], r"--page-budget: expected an integer >= 1, got 0"),
    (["eval", "--page-budgets", ","], r"--page-budgets: expected a comma-separated list"),
    (["generate", "--page-size", "-3"], r"--page-size: expected an integer >= 1"),
    (["generate", "--temperature", "-1"], r"--temperature: expected a finite number >= 0"),
    (["generate", "--backend", "cuda"], r"invalid choice"),
    (["generate", "--model", str(REPO)], r"--model: not a file"),
])
def test_argument_errors(args, pattern, capsys):
    code, _, err = run_main(args, capsys)
    assert code == 2 and re.search(pattern, err), err


@needs_model
def test_runtime_errors(tmp_path, capsys):
    code, _, err = run_main(["generate", *model_args(), "--page-budget", "1", "--num-sink-pages", "1"], capsys)
    assert code == 2 and ("page_budget: expected at least num_sink_pages + max(num_recent_pages, 1) = 1 + 1 = 2"
                          in err), err
    code, _, err = run_main(["eval", *model_args(), "--data", str(VALID), "--dense-layers", "9"], capsys)
    assert code == 2 and "--dense-layers (9) exceeds" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    code, _, err = run_main(["eval", *model_args(), "--data", str(empty)], capsys)
    assert code == 2 and "no stories" in err
    code, _, err = run_main(["generate", "--model", str(TOKENIZER), "--tokenizer", str(TOKENIZER)], capsys)
    assert code == 2 and "tok512.bin' is not a llama2.c checkpoint" in err and "head_dim" not in err


def test_misspelt_option_gives_the_commands_usage_and_a_suggestion(capsys):
    code, out, err = run_main(["generate", "--page-budjet", "4"], capsys)
    assert code == 2
    assert "usage: tinyattn generate" in err
    assert "unrecognized arguments: --page-budjet 4 (did you mean --page-budget?)" in err
    code, _, err = run_main(["eval", "--zzz"], capsys)
    assert code == 2 and "usage: tinyattn eval" in err and "did you mean" not in err


@pytest.mark.parametrize("content, reason", [
    (b"# tinyattn\n\nQuery-aware sparse paged attention, as text\n", r"dim must be a multiple of n_heads"),
    (b"\xff" * 64, r"every field must be positive"),
    (b"short", r"5 bytes, the header alone needs 28"),
    (struct.pack("<7i", 64, 172, 5, 8, 4, 512, 512) + b"\0" * 100, r"or a truncated one: file size 128 bytes"),
])
def test_not_a_checkpoint(tmp_path, capsys, content, reason):
    bad = tmp_path / "model.bin"
    bad.write_bytes(content)
    code, _, err = run_main(["generate", "--model", str(bad)], capsys)
    assert code == 2
    assert re.search(rf"model\.bin' is not a llama2\.c checkpoint.*{reason}", err), err
    assert "head_dim=" not in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------- no path at all
def test_generate_and_eval_run_with_no_path(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(["generate", "--max-new-tokens", "8", "--no-stats"], capsys)
    assert code == 0, err
    assert out == KNOWN_GOOD.read_text()[: len(out) - 1] + "\n"
    code, out, err = run_main(["eval", "--max-stories", "1", "--max-context", "40", "--page-size", "8",
                               "--page-budgets", "2", "--no-progress", "--no-repeat-probe"], capsys)
    assert code == 0, err
    assert "data: tinystories_valid_excerpt.txt (shipped with tinyattn)" in out
    assert "1 stories, 39 target tokens" in out
    assert "warning" not in err


def test_generate_refuses_sparse_options_without_a_budget(capsys):
    """``--gamma 1`` or ``--top-p`` without ``--page-budget`` would decode densely and pass for the sparse run
    asked for: a usage error naming them; with a budget, or at their defaults, the run goes ahead."""
    base = ["generate", "--max-new-tokens", "2", "--no-stats"]
    code, out, err = run_main([*base, "--gamma", "1", "--top-p", "0.9", "--dense-layers", "1"], capsys)
    assert code == 2 and out == ""
    assert err.startswith("tinyattn generate: error: --gamma, --top-p, --dense-layers: settings of sparse decode, "
                          "which needs --page-budget (without it every decode step is dense)")
    code, _, err = run_main([*base, "--policy", "h2o"], capsys)
    assert code == 2 and "error: --policy: a setting of sparse decode, which needs --page-budget" in err, err
    for args in ([*base, "--gamma", "1", "--page-budget", "4"], [*base, "--num-recent-pages", "1"], base):
        code, _, err = run_main(args, capsys)
        assert code == 0 and "error" not in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA graphs run on a GPU: no warning")
@pytest.mark.parametrize("command", [["generate", "--max-new-tokens", "2", "--no-stats"],
                                     ["serve-bench", "--num-requests", "1", "--output-len", "2", "--configs", "quest",
                                      "--no-progress", "--backend", "torch"]])
def test_warnings_print_as_one_line(command, capsys):
    code, _, err = run_main([*command, "--cuda-graphs"], capsys)
    assert code == 0, err
    assert "warning: cuda_graphs=True: the model is on cpu, CUDA graphs need a CUDA device" in err
    assert "UserWarning" not in err and "Runtime(" not in err and "Engine(" not in err


def test_finetune_runs_with_no_path(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(["finetune", "--chunk-size", "32", "--retention", "recency", "--kv-budget-pages", "4",
                               "--steps", "1", "--seq-len", "64", "--eval-sequences", "1", "--batch-size", "1",
                               "--page-size", "16", "--no-progress"], capsys)
    assert code == 0, err
    assert out.startswith("recency: train_loss ") and "->" not in out       # no --json: nothing written
    assert list(tmp_path.iterdir()) == []


def test_version_and_no_command(capsys):
    import tinyattn

    code, out, _ = run_main(["--version"], capsys)
    assert code == 0 and out == f"tinyattn {tinyattn.__version__}\n"
    code, out, err = run_main([], capsys)             # a first try with no command lists the commands
    assert code == 2 and out == "" and err.startswith("usage: tinyattn [-h] [--version] COMMAND")
    for command in ("generate", "eval", "convert", "finetune", "serve-bench", "train-retrieval"):
        assert f"\n    {command}" in err, command


def test_usage_names_the_program(capsys):
    code, out, _ = run_main(["--help"], capsys)                    # main()'s default: the console script
    assert code == 0 and out.startswith("usage: tinyattn ")
    assert "  tinyattn generate --max-new-tokens 200 --temperature 0" in out
    assert "python -m tinyattn" not in out and "../shared" not in out
    code, out, _ = run_main(["convert", "--help"], capsys, prog="python -m tinyattn")
    assert code == 0 and out.startswith("usage: python -m tinyattn convert ")
    for command in ("generate", "eval", "convert", "finetune"):
        code, out, _ = run_main([command, "--help"], capsys)
        assert code == 0 and out.startswith(f"usage: tinyattn {command} ")
        assert "python -m tinyattn" not in out and "../shared" not in out, command
    code, _, err = run_main(["generate", "--model", "no/such.bin"], capsys)
    assert err.startswith("tinyattn generate: error: --model: file not found: no/such.bin")


# ---------------------------------------------------------------------------------------------- the process
@pytest.mark.parametrize("argv0, expected", [("-m", "PASSIVE"), ("/venv/bin/tinyattn", "PASSIVE"),
                                             ("script.py", "None")])
@pytest.mark.slow
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


@pytest.mark.slow
def test_eval_plot_dir_without_matplotlib_writes_csv_json_and_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # as if not installed: import fails
    plots = tmp_path / "plots"
    code, out, err = run_main(["eval", "--max-stories", "1", "--max-context", "40", "--page-size", "8",
                               "--page-budgets", "2,4", "--backend", "torch", "--no-progress",
                               "--plot-dir", str(plots)], capsys)
    assert code == 0, err
    assert 'pip install -e ".[plots]"' in err
    assert (plots / "results.csv").exists() and (plots / "results.json").exists()
    assert not list(plots.glob("*.png"))


# ------------------------------------------------------------------------------------ past the training context
def test_eval_warns_past_the_training_context(short_context_model, capsys):
    code, out, err = run_main(["eval", "--model", str(short_context_model), "--max-stories", "1", "--max-context",
                               "40", "--page-size", "8", "--page-budgets", "2", "--no-progress", "--no-repeat-probe",
                               "--no-selection-metrics"], capsys)
    assert code == 0, err
    assert "warning: sequences reached 40 tokens, past the model's training context (32); quality will degrade" in err
    assert "UserWarning" not in err
    code, out, err = run_main(["eval", "--model", str(short_context_model), "--max-stories", "1", "--max-context",
                               "32", "--page-size", "8", "--page-budgets", "2", "--no-progress", "--no-repeat-probe",
                               "--no-selection-metrics"], capsys)
    assert code == 0 and "warning" not in err


def test_generate_warns_past_the_context_with_no_stats_too(short_context_model, capsys):
    code, out, err = run_main(["generate", "--model", str(short_context_model), "--max-new-tokens", "40",
                               "--no-stats"], capsys)
    assert code == 0
    assert "warning: sequences reached 41 tokens, past the model's training context (32)" in err
    assert out.endswith("\n") and not out.endswith("\n\n") and "---" not in out
