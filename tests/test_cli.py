"""`python -m tinyattn` through a subprocess: help, generate, eval and the error paths."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO / ".." / "shared"
MODEL_DIR = SHARED / "models" / "stories260K"
from conftest import CKPT, KNOWN_GOOD, TOKENIZER, VALID, run_subprocess  # noqa: E402  (shipped; KNOWN_GOOD also used by .ci/run)

needs_model = pytest.mark.skipif(not CKPT.exists() or not TOKENIZER.exists(), reason=f"{CKPT} is missing")
needs_shared_readme = pytest.mark.skipif(  # a maintainer's check: the model's upstream card is not shipped
    not (MODEL_DIR / "README.md").exists(),
    reason="stories260K's upstream model card (the known-good text's source) is not part of the repository")


def run_cli(*args: str, cwd: Path = REPO, quiet_seconds: float = 30) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the torch backend on CPU
    env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return run_subprocess([sys.executable, "-m", "tinyattn", *args], quiet_seconds=quiet_seconds, cwd=cwd, env=env,
                          capture_output=True, text=True)


def model_args() -> list[str]:
    return ["--model", str(CKPT), "--tokenizer", str(TOKENIZER)]


def assert_clean_error(proc: subprocess.CompletedProcess, pattern: str) -> None:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert re.search(pattern, proc.stderr), proc.stderr


@pytest.mark.parametrize("command", [[], ["generate"], ["eval"]])
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


def test_no_command_is_a_usage_error():
    proc = run_cli()
    assert proc.returncode == 2 and "usage:" in proc.stderr


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
def test_generate_batch_with_stats():
    proc = run_cli("generate", *model_args(), "--prompt", "Tom had a dog", "--prompt", "Once upon a time",
                   "--max-new-tokens", "12", "--page-size", "4", "--page-budget", "2", "--backend", "torch",
                   "--temperature", "0.8", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "=== [0] ===\nTom had a dog" in out and "=== [1] ===\nOnce upon a time" in out
    for field in ("tokens/s", "pages read / step", "KV bytes / step", "KV cache", "page_budget=2"):
        assert field in out


@needs_model
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
def test_errors_through_a_subprocess(args, pattern):
    assert_clean_error(run_cli(*args), pattern)


@needs_model
def test_corrupt_model_through_a_subprocess(tmp_path):
    truncated = tmp_path / "model.bin"
    truncated.write_bytes(CKPT.read_bytes()[:5000])
    assert_clean_error(run_cli("generate", "--model", str(truncated), "--tokenizer", str(TOKENIZER)),
                       r"is not a llama2.c checkpoint, or a truncated one: file size 5,000 bytes does not match its "
                       r"header")


# the other error paths in-process (a subprocess costs a torch import each): same main(), same exit status
def run_main(args: list[str], capsys) -> tuple[int, str]:
    from tinyattn.cli import main

    try:
        code = main(args)
    except SystemExit as exc:  # argparse errors
        code = exc.code
    return code, capsys.readouterr().err


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
    code, err = run_main(args, capsys)
    assert code == 2 and re.search(pattern, err), err


@needs_model
def test_runtime_errors(tmp_path, capsys):
    code, err = run_main(["generate", *model_args(), "--page-budget", "1", "--num-sink-pages", "1"], capsys)
    assert code == 2 and ("page_budget: expected at least num_sink_pages + max(num_recent_pages, 1) = 1 + 1 = 2"
                          in err), err
    code, err = run_main(["eval", *model_args(), "--data", str(VALID), "--dense-layers", "9"], capsys)
    assert code == 2 and "--dense-layers (9) exceeds" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    code, err = run_main(["eval", *model_args(), "--data", str(empty)], capsys)
    assert code == 2 and "no stories" in err
    code, err = run_main(["generate", "--model", str(TOKENIZER), "--tokenizer", str(TOKENIZER)], capsys)
    assert code == 2 and "tok512.bin' is not a llama2.c checkpoint" in err and "head_dim" not in err
