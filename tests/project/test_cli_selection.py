"""``--gamma`` and ``--top-p`` (issue 35) on every command that takes ``--page-budget`` (generate, serve-bench):
explained in ``--help``, bad values refused by argparse naming the option, ``--top-p 1`` with a covering budget
generates dense's text, and ``--top-p`` below 1 is reported in generate's statistics (pages attended)."""

from __future__ import annotations

import re

import pytest

from commands import model_args, run_main
from paths import CKPT, TOKENIZER

needs_model = pytest.mark.skipif(not CKPT.exists() or not TOKENIZER.exists(), reason=f"{CKPT} is missing")


@pytest.mark.parametrize("command", ["generate", "serve-bench"])
def test_help_explains_both(command, capsys):
    code, out, _ = run_main([command, "--help"], capsys)
    text = " ".join(out.split())
    assert code == 0
    assert "--gamma G page estimate of the quest selection, in [0, 1]" in text
    assert "--top-p P adaptive budget of the quest selection, in (0, 1]" in text


@pytest.mark.parametrize("command", ["generate", "serve-bench"])
@pytest.mark.parametrize("args, pattern", [
    (["--gamma", "1.5"], r"argument --gamma: expected a number in \[0, 1\], got 1.5"),
    (["--gamma", "-0.1"], r"argument --gamma: expected a number in \[0, 1\], got -0.1"),
    (["--gamma", "nan"], r"argument --gamma: expected a number in \[0, 1\], got nan"),
    (["--top-p", "0"], r"argument --top-p: expected a number in \(0, 1\], got 0"),
    (["--top-p", "1.01"], r"argument --top-p: expected a number in \(0, 1\], got 1.01"),
    (["--top-p", "most"], r"argument --top-p: expected a number in \(0, 1\], got 'most'"),
])
def test_bad_values_are_argparse_errors_naming_the_option(command, args, pattern, capsys):
    code, _, err = run_main([command, *args], capsys)
    assert code == 2 and re.search(pattern, err), err


@needs_model
def test_generate_top_p_one_covering_is_dense_and_top_p_is_reported(capsys):
    common = ["generate", *model_args(), "--prompt", "Once upon a time", "--max-new-tokens", "40", "--page-size", "8"]
    code, dense, err = run_main([*common, "--no-stats"], capsys)
    assert code == 0, err
    code, full, err = run_main([*common, "--no-stats", "--page-budget", "16", "--num-sink-pages", "0",
                                "--gamma", "0.25", "--top-p", "1"], capsys)
    assert code == 0 and full == dense, err
    code, out, err = run_main([*common, "--page-budget", "4", "--num-sink-pages", "0", "--gamma", "0.5",
                               "--top-p", "0.5"], capsys)
    assert code == 0, err
    assert "gamma=0.5, top_p=0.5" in out
    line = next(x for x in out.splitlines() if x.startswith("pages attended:"))
    mean = float(re.search(r"([0-9.]+) pages", line).group(1))
    assert 1 <= mean < 4 and re.search(r"max [1-4]\b", line), line
    code, _, err = run_main([*common, "--page-budget", "4", "--policy", "h2o", "--top-p", "0.5"], capsys)
    assert code == 2 and "policy" in err and "top_p" in err, err


@pytest.mark.parametrize("command", ["generate", "eval", "serve-bench"])
def test_candidates_without_the_rerank_is_refused(command, capsys):
    """``--candidates`` only feeds the re-rank: without ``--rerank`` (or, for generate, without a budget) the run
    would silently ignore it."""
    code, _, err = run_main([command, "--page-budgets" if command == "eval" else "--page-budget", "4",
                             "--candidates", "2"], capsys)
    assert code == 2 and "--candidates 2: only the re-rank reads" in err and "--rerank int4" in err, err
    if command == "generate":
        code, _, err = run_main([command, "--candidates", "2"], capsys)
        assert code == 2 and "--candidates" in err and "needs --page-budget" in err, err
