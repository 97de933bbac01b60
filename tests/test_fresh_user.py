"""What a new user meets first (issue 15): the shipped model and texts, every command with no path, and the
errors and labels they trip on. The fresh-clone install itself is `.ci/fresh_clone.sh` (run by .ci/run)."""

from __future__ import annotations

import fnmatch
import hashlib
import re
import stat
import struct
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

from tinyattn import assets

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tinyattn" / "data"
KNOWN_GOOD = REPO / "tests" / "known_good_stories260K.txt"


def run_main(args: list[str], capsys, prog: str = "tinyattn") -> tuple[int, str, str]:
    """``tinyattn ARGS`` in-process; generate / eval get ``--backend torch`` (conftest sets TRITON_INTERPRET=1)."""
    from tinyattn.cli import main

    if args and args[0] in ("generate", "eval", "finetune") and "--help" not in args:
        args = [*args, "--backend", "torch"]
    try:
        code = main(args, prog=prog)
    except SystemExit as exc:  # argparse errors and --help
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---------------------------------------------------------------------------------------------- shipped files
def test_shipped_files_match_the_data_readme():
    """Every file the data README lists is there, with its size and sha256, and assets finds it in the package."""
    readme = (DATA / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([^`]+)` \| ([\d,]+) \| ([0-9a-f]{64}) \|", readme, re.M)
    assert {name for name, _, _ in rows} == {"stories260K.bin", "tok512.bin", "tinystories_valid_excerpt.txt",
                                             "tinystories_sample.txt", "book_of_mormon_1nephi.txt"}
    for name, size, sha in rows:
        path = assets.data_path(name)
        assert path == DATA / name
        data = path.read_bytes()
        assert len(data) == int(size.replace(",", "")), name
        assert hashlib.sha256(data).hexdigest() == sha, name
    assert assets.default_model_path().name == "stories260K.bin"
    assert assets.default_tokenizer_path().name == "tok512.bin"
    assert assets.default_text_path().name == "tinystories_valid_excerpt.txt"
    assert assets.default_finetune_text_path().name == "tinystories_sample.txt"
    for licence in ("LICENSE-stories260K", "LICENSE-TinyStories"):
        assert assets.data_path(licence).is_file()
    assert "MIT License" in assets.data_path("LICENSE-stories260K").read_text()
    assert "CDLA-Sharing-1.0" in assets.data_path("LICENSE-TinyStories").read_text()
    assert "Eldan" in assets.data_path("LICENSE-TinyStories").read_text()


def test_package_data_covers_every_shipped_file():
    """pyproject's package-data globs match every file of tinyattn/data/ (the wheel check is in .ci/fresh_clone.sh)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]["tinyattn"]
    files = sorted(p.name for p in DATA.iterdir() if p.is_file())
    assert set(files) == set(assets.DATA_FILES)
    for name in files:
        assert any(fnmatch.fnmatch(f"data/{name}", g) for g in globs), name


def test_nothing_in_the_package_refers_to_shared():
    offenders = []
    for path in (REPO / "tinyattn").rglob("*.py"):
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"\.\./shared|[\"']shared[\"']\s*\)?\s*/", line):
                offenders.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not offenders, offenders


def test_docs_commands_use_no_shared_paths_and_a_working_install():
    """README and docs: no command or snippet reads ../shared; every pip line installs from the checkout."""
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            assert "../shared" not in block, f"{path.name}: {block}"
        for line in re.findall(r"pip install[^\n`]*", text):
            bare = re.search(r"pip install\s+[\"']?tinyattn(\[[^\]]*\])?(?!\s*@)[\"']?(\s|$)", line)
            assert not bare, f"{path.name}: {line} (tinyattn is not on PyPI: -e . or tinyattn @ git+...)"


def test_resolve_file_names_the_option(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^--model: file not found: no/such\.bin$"):
        assets.resolve_file("no/such.bin", "--model", assets.default_model_path)
    with pytest.raises(IsADirectoryError, match=r"^--data: not a file: "):
        assets.resolve_file(tmp_path, "--data")
    assert assets.resolve_file(None, "--model", assets.default_model_path) == assets.default_model_path()
    with pytest.raises(ValueError, match="--json is required"):
        assets.resolve_file(None, "--json")


# ---------------------------------------------------------------------------------------------- every command, no path
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


def test_finetune_runs_with_no_path(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(["finetune", "--chunk-size", "32", "--retention", "recency", "--kv-budget-pages", "4",
                               "--steps", "1", "--seq-len", "64", "--eval-sequences", "1", "--batch-size", "1",
                               "--page-size", "16", "--no-progress"], capsys)
    assert code == 0, err
    assert out.startswith("recency: train_loss ") and "->" not in out       # no --json: nothing written
    assert list(tmp_path.iterdir()) == []


def test_convert_runs_with_no_path_and_writes_readable_files(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    import os

    monkeypatch.chdir(tmp_path)
    old = os.umask(0o022)
    try:
        code, out, err = run_main(["convert"], capsys)
    finally:
        os.umask(old)
    assert code == 0, err
    out_dir = tmp_path / "out" / "stories260K-hf"
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (out_dir / name).is_file(), name
    # safetensors creates its file 0600; convert gives it the mode of the other files (0666 minus the umask)
    assert stat.S_IMODE((out_dir / "model.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE((out_dir / "config.json").stat().st_mode) == 0o644


def test_out_folders_are_git_ignored():
    ignore = (REPO / ".gitignore").read_text().split()
    assert "/out/" in ignore            # convert's default out/<model>-hf, bench's out/bench, finetune's out/...


# ---------------------------------------------------------------------------------------------- errors that name the fix
def test_convert_missing_file_names_the_option(tmp_path, capsys):
    pytest.importorskip("transformers", reason="convert needs the hf extra (without it: tested below)")
    code, _, err = run_main(["convert", "--model", "no/such.bin", "--out", str(tmp_path / "o")], capsys)
    assert code == 2
    assert "convert: error: --model: file not found: no/such.bin" in err
    assert "Errno" not in err
    code, _, err = run_main(["convert", "--tokenizer", "no/tok.bin", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "--tokenizer: file not found: no/tok.bin" in err


def test_convert_module_entry_point_errors_cleanly(tmp_path, capsys):
    pytest.importorskip("transformers", reason="convert needs the hf extra (without it: it says so)")
    from tinyattn.integrations.convert import main

    assert main(["--model", "no/such.bin", "--out", str(tmp_path)]) == 2
    assert "python -m tinyattn.integrations.convert: error: --model: file not found" in capsys.readouterr().err


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


def test_tokenizer_as_model_is_not_a_checkpoint(capsys):
    code, _, err = run_main(["generate", "--model", str(assets.default_tokenizer_path())], capsys)
    assert code == 2 and "tok512.bin' is not a llama2.c checkpoint" in err


def test_finetune_budget_error_names_the_flags(capsys):
    code, _, err = run_main(["finetune", "--chunk-size", "64", "--retention", "gradient", "--kv-budget-pages", "5",
                             "--steps", "1"], capsys)
    assert code == 2
    assert "capacity" not in err
    for flag in ("--kv-budget-pages (5)", "--sink-pages (1)", "--recent-pages (4, the default: one chunk)",
                 "--chunk-size 64", "= 9 pages"):
        assert flag in err, err
    code, _, err = run_main(["finetune", "--chunk-size", "64", "--retention", "recency", "--kv-budget-pages", "3",
                             "--sink-pages", "0", "--recent-pages", "0", "--steps", "1"], capsys)
    assert code == 2 and "--recent-pages (0) + the chunk being written" in err and "= 4 pages" in err


def test_finetune_budget_check_matches_the_memory(capsys):
    """The CLI's check accepts exactly what ChunkedKVMemory accepts (the smallest budget runs)."""
    from tinyattn.training.memory import ChunkedKVMemory
    from tinyattn.training.retention import make_policy

    with pytest.raises(ValueError):
        ChunkedKVMemory(1, 1, 8, batch=1, seq_len=512, chunk_size=64, page_size=16, capacity=8,
                        policy=make_policy("recency"), num_sink_pages=1)
    ChunkedKVMemory(1, 1, 8, batch=1, seq_len=512, chunk_size=64, page_size=16, capacity=9,
                    policy=make_policy("recency"), num_sink_pages=1)
    import argparse

    from tinyattn.training.finetune import check_budget

    args = argparse.Namespace(retention="recency", kv_budget_pages=9, seq_len=512, page_size=16, chunk_size=64,
                              sink_pages=1, recent_pages=None)
    check_budget(args)
    args.kv_budget_pages = 8
    with pytest.raises(ValueError, match="--kv-budget-pages"):
        check_budget(args)
    args.kv_budget_pages, args.seq_len = 2, 32      # the budget covers the whole sequence: full retention
    check_budget(args)


# ---------------------------------------------------------------------------------------------- past the training context
@pytest.fixture(scope="module")
def short_context_model(tmp_path_factory) -> Path:
    """stories260K with a 32-token training context (its header's seq_len and RoPE tables cut to 32)."""
    from tinyattn.models.llama2c import _prod, _tensor_shapes, read_llama2c_header

    src = assets.default_model_path()
    cfg = read_llama2c_header(src)
    raw = src.read_bytes()
    floats = {name: _prod(shape) for name, shape in _tensor_shapes(cfg)}
    head_dim_half = cfg.head_dim // 2
    weights_end = 28 + 4 * (sum(floats.values()) - floats["freq_cis_real"] - floats["freq_cis_imag"])
    real = raw[weights_end: weights_end + 4 * floats["freq_cis_real"]]
    imag = raw[weights_end + 4 * floats["freq_cis_real"]: weights_end + 8 * floats["freq_cis_real"]]
    keep = 4 * 32 * head_dim_half
    header = struct.pack("<7i", cfg.dim, cfg.hidden_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size, 32)
    path = tmp_path_factory.mktemp("short") / "short_context.bin"
    path.write_bytes(header + raw[28:weights_end] + real[:keep] + imag[:keep])
    assert read_llama2c_header(path).max_seq_len == 32
    return path


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


def test_evaluate_warns_like_generate(short_context_model):
    from tinyattn.models import LlamaModel, LlamaRuntime, Tokenizer, evaluate

    model = LlamaModel.from_llama2c(short_context_model)
    tok = Tokenizer(assets.default_tokenizer_path())
    with pytest.warns(UserWarning, match=r"sequences reach 40 tokens, past the model's training context "
                                         r"max_seq_len=32; quality will degrade") as eval_warnings:
        result = evaluate(model, tok, ["Once upon a time " * 20], page_budgets=[2], page_size=8, max_context=40,
                          repeat_probe=False, selection_metrics=False, progress=False, backend="torch")
    assert result.max_sequence_tokens == 40
    with pytest.warns(UserWarning) as gen_warnings:
        LlamaRuntime(model, page_size=8, backend="torch").generate([[1]], max_new_tokens=39)
    assert eval_warnings[0].message.args[0].split(";")[0] == gen_warnings[0].message.args[0].split(";")[0]


def test_generate_warns_past_the_context_with_no_stats_too(short_context_model, capsys):
    code, out, err = run_main(["generate", "--model", str(short_context_model), "--max-new-tokens", "40",
                               "--no-stats"], capsys)
    assert code == 0
    assert "warning: sequences reached 41 tokens, past the model's training context (32)" in err
    assert out.endswith("\n") and not out.endswith("\n\n") and "---" not in out


# ---------------------------------------------------------------------------------------------- names in usage lines
def test_usage_names_the_program(capsys):
    code, out, _ = run_main(["--help"], capsys)                    # the console script's default
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


# ---------------------------------------------------------------------------------------------- bench scripts
def _bench(name):
    import importlib.util

    bench = REPO / "bench"
    if str(bench) not in sys.path:
        sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", bench / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_bench_scripts_write_to_scratch_by_default():
    common = _bench("common")
    assert common.DEFAULT_OUT == REPO / "out" / "bench"
    for name in ("decode_attention", "kernel_breakdown", "e2e_decode"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = _bench(name).parse_args([])
        assert args.out == REPO / "out" / "bench", name
        assert _bench(name).parse_args(["--out", "docs/bench"]).out == Path("docs/bench")
    source = (REPO / "bench" / "profile_generate.py").read_text()
    assert "default=C.DEFAULT_OUT" in source and "shared" not in source
    run_cpu = (REPO / "bench" / "run_cpu.sh").read_text()
    assert 'OUT="${OUT:-out/bench}"' in run_cpu


def test_hf_perplexity_takes_comma_separated_budgets(capsys):
    hf_perplexity = _bench("hf_perplexity")
    assert hf_perplexity.parse_args(["--page-budgets", "2,4,8"]).page_budgets == [2, 4, 8]
    assert hf_perplexity.parse_args([]).page_budgets == [2, 4, 8]
    assert hf_perplexity.parse_args([]).text is None                 # the shipped stories
    with pytest.raises(SystemExit):
        hf_perplexity.parse_args(["--page-budgets", "2", "4"])
    assert "expected" in capsys.readouterr().err or True
