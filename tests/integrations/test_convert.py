"""llama2.c -> Hugging Face converter, on the real stories260K checkpoint (the copy shipped in tinyattn/data)."""

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
hf = pytest.importorskip("tinyattn.integrations.hf")
from tinyattn.integrations import convert as C  # noqa: E402


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from paths import CKPT

    out = tmp_path_factory.mktemp("stories260K-hf")
    assert C.main(["--model", str(CKPT), "--tokenizer", str(CKPT.parent / "tok512.bin"), "--out", str(out)]) == 0
    return CKPT.parent, out


def known_good(model_dir) -> str:
    from paths import KNOWN_GOOD

    return KNOWN_GOOD.read_text(encoding="utf-8").strip("\n")


def test_permute_rope_turns_interleaved_into_rotate_half():
    from tinyattn.models import apply_rope, rope_tables

    torch.manual_seed(0)
    H, D, dim, T = 3, 8, 5, 7
    w = torch.randn(H * D, dim)
    x = torch.randn(1, T, dim)
    cos, sin = rope_tables(D, T)
    inter = apply_rope((x @ w.T).view(1, T, H, D), cos[None], sin[None])         # llama2.c layout
    y = (x @ C.permute_rope(w, H).T).view(1, T, H, D)
    c2, s2 = torch.cat([cos, cos], -1)[None, :, None], torch.cat([sin, sin], -1)[None, :, None]
    half = torch.cat([-y[..., D // 2:], y[..., : D // 2]], -1)
    rot = y * c2 + half * s2                                                      # transformers layout
    perm = torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)])
    assert torch.allclose(rot, inter[..., perm], atol=1e-6)


def test_files_and_config(converted):
    _, out = converted
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (out / name).exists(), name
    cfg = transformers.AutoConfig.from_pretrained(out)
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size) == ("llama", 64, 5, 8, 4, 512)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True


def test_logits_match_tinyattn_runtime(converted):
    model_dir, out = converted
    assert C.check(model_dir / "stories260K.bin", out) < 1e-4


def test_tokenizer_matches_llama2c(converted):
    model_dir, out = converted
    from tinyattn.models import Tokenizer, load_stories

    from paths import VALID

    ref = Tokenizer(model_dir / "tok512.bin")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    texts = load_stories(VALID)[:3] + ["Hello  wörld! 💥\n x"]
    for text in texts:
        ids = tok(text)["input_ids"]
        assert ids == ref.encode(text)
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids)


@pytest.mark.slow
def test_known_good_greedy_text_stock_and_tinyattn(converted):
    model_dir, out = converted
    tok = transformers.AutoTokenizer.from_pretrained(out)
    stock = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tiny = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="tinyattn").eval()
    bos = torch.tensor([[1]])
    kw = dict(max_new_tokens=200, do_sample=False, max_length=None)
    ref = stock.generate(bos, **kw)
    assert tok.decode(ref[0], skip_special_tokens=True) == known_good(model_dir)
    # budget covering the whole context (201 tokens = 13 pages of 16): the same tokens
    full = tiny.generate(bos, cache=hf.TinyAttnCache(tiny.config, page_size=16, page_budget=13, backend="torch"), **kw)
    assert torch.equal(full, ref)
    # a small budget (4 pages = 64 tokens of 201) still produces text: the story opening is unchanged
    small = tiny.generate(bos, cache=hf.TinyAttnCache(tiny.config, page_size=16, page_budget=4, backend="torch"), **kw)
    text = tok.decode(small[0], skip_special_tokens=True)
    assert small.shape == ref.shape and text.startswith(known_good(model_dir)[:150])


# ---------------------------------------------------------------------------- hybrid models (sliding + NoPE layers)
HYBRID = dict(dim=32, hidden_dim=48, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=64,
              layer_types=("sliding_attention", "full_attention", "sliding_attention", "sliding_attention"),
              sliding_window=5, nope_layers=(1,))


def hybrid_model(**overrides):
    """A random tiny hybrid LlamaModel; weights of std 0.3 so that attention is peaked and a window matters."""
    from tinyattn.models import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(**{**HYBRID, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return model.eval()


def reference_logits(cfg, sd, tokens):
    """Independent plain-torch forward of a LLaMA with per-layer options, fp64, in llama2.c's layout: interleaved
    RoPE pairs (2i, 2i+1) at positions 0..T-1 except in ``nope_layers``, GQA, and in sliding layers query t sees
    keys j with t - sliding_window < j <= t."""
    sd = {k: v.double() for k, v in sd.items()}
    T, H, Hkv, D = len(tokens), cfg.n_heads, cfg.n_kv_heads, cfg.dim // cfg.n_heads

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * w

    def rope(x):                                             # [T, heads, D] -> rotated pairs, as complex numbers
        ang = torch.arange(T, dtype=torch.float64)[:, None] * cfg.rope_theta ** (-torch.arange(0, D, 2) / D)
        z = torch.view_as_complex(x.reshape(T, -1, D // 2, 2).contiguous())
        return torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)[:, None]).reshape(x.shape)

    t = torch.arange(T)
    x = sd["tok_embeddings.weight"][tokens]
    for i in range(cfg.n_layers):
        w = {k.split(".", 2)[2]: v for k, v in sd.items() if k.startswith(f"layers.{i}.")}
        h = rms(x, w["attention_norm.weight"])
        q, k, v = (h @ w[n + ".weight"].T for n in ("wq", "wk", "wv"))
        q, k, v = q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
        if i not in cfg.nope_layers:
            q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        visible = t[None, :] <= t[:, None]
        if cfg.is_sliding(i):
            visible &= t[None, :] > t[:, None] - cfg.sliding_window
        s = torch.einsum("thd,jhd->htj", q, k) / D ** 0.5
        p = s.masked_fill(~visible, float("-inf")).softmax(-1)
        x = x + torch.einsum("htj,jhd->thd", p, v).reshape(T, H * D) @ w["wo.weight"].T
        h = rms(x, w["ffn_norm.weight"])
        x = x + (torch.nn.functional.silu(h @ w["w1.weight"].T) * (h @ w["w3.weight"].T)) @ w["w2.weight"].T
    return rms(x, sd["norm.weight"]) @ sd["output.weight"].T


def test_hybrid_model_converts_to_smollm3_with_its_per_layer_options(tmp_path):
    model = hybrid_model()
    out = C.save_pretrained(model, tmp_path / "hf")
    cfg = transformers.AutoConfig.from_pretrained(out)
    assert cfg.model_type == "smollm3" and cfg.architectures == ["SmolLM3ForCausalLM"]
    assert cfg.layer_types == list(HYBRID["layer_types"]) and cfg.sliding_window == 5 and cfg.use_sliding_window
    assert cfg.no_rope_layers == [1, 0, 1, 1]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert [layer.self_attn.sliding_window for layer in hf_model.model.layers] == [5, None, 5, 5]
    assert [bool(layer.self_attn.use_rope) for layer in hf_model.model.layers] == [True, False, True, True]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hybrid_hf_logits_equal_an_independent_reference(tmp_path, attn):
    model = hybrid_model()
    out = C.save_pretrained(model, tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation=attn).eval()
    tokens = torch.randint(0, HYBRID["vocab_size"], (23,), generator=torch.Generator().manual_seed(1))
    want = reference_logits(model.config, model.state_dict(), tokens)
    with torch.no_grad():
        got = hf_model(tokens[None]).logits[0].double()
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 1e-5 * scale
    # and tinyattn's own paged runtime on the same model
    cache = model.new_cache(page_size=4, num_pages=8)
    runtime = model(tokens[None], cache, [cache.add_sequence()], backend="torch")[0].double()
    assert (runtime - want).abs().max().item() < 1e-5 * scale
    # the test can tell: the same model without its window, or with RoPE in every layer, is far off
    from tinyattn.models import LlamaConfig

    for change in (dict(layer_types=None, sliding_window=None), dict(nope_layers=())):
        other = reference_logits(LlamaConfig(**{**HYBRID, **change}), model.state_dict(), tokens)
        assert (other - want).abs().max().item() > 1e-2 * scale


def test_hybrid_round_trip_config_and_weights(tmp_path):
    model = hybrid_model(shared_classifier=False, rope_theta=500.0)
    out = C.save_pretrained(model, tmp_path / "hf")
    cfg, sd = C.load_hf(out)
    assert cfg == model.config
    want = model.state_dict()
    assert set(sd) == set(want) and all(torch.equal(sd[k], want[k]) for k in want)
    assert C.llama_config_from_hf(transformers.AutoConfig.from_pretrained(out)) == model.config
    # a plain model stays a LlamaForCausalLM, and reads back as plain
    plain = hybrid_model(layer_types=None, sliding_window=None, nope_layers=())
    out = C.save_pretrained(plain, tmp_path / "plain")
    assert transformers.AutoConfig.from_pretrained(out).model_type == "llama"
    assert C.load_hf(out)[0] == plain.config


def test_unpermute_rope_inverts_permute_rope():
    w = torch.randn(3 * 8, 5)
    assert torch.equal(C.unpermute_rope(C.permute_rope(w, 3), 3), w)


def test_cli_per_layer_options(tmp_path, capsys):
    from paths import CKPT

    out = tmp_path / "hyb"
    types = "sliding_attention,full_attention,sliding_attention,sliding_attention,full_attention"
    assert C.main(["--model", str(CKPT), "--out", str(out), "--layer-types", types, "--sliding-window", "8",
                   "--nope-layers", "1,4"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["layer_types"], cfg["sliding_window"], cfg["no_rope_layers"]) == \
        ("smollm3", types.split(","), 8, [1, 0, 1, 1, 0])
    # --check: the converted SmolLM3 against tinyattn's runtime running the same hybrid config (33 tokens > 8)
    assert C.check(CKPT, out) < 1e-4
    assert C.main(["--model", str(CKPT), "--out", str(out), "--layer-types", "sliding_attention"]) == 2
    assert "layer_types: expected 5 entries (n_layers), got 1" in capsys.readouterr().err
    assert C.main(["--model", str(CKPT), "--out", str(out), "--layer-types", types]) == 2
    assert "sliding_window: expected an int >= 1" in capsys.readouterr().err


def test_llama_config_from_hf_refuses_what_the_runtime_does_not_model():
    cfg = C.hf_config_dict(hybrid_model().config)
    with pytest.raises(ValueError, match="model_type 'llama' or 'smollm3', got 'gpt2'"):
        C.llama_config_from_hf({**cfg, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="attention_bias must be False"):
        C.llama_config_from_hf({**cfg, "attention_bias": True})


def test_retrieval_checkpoint_converts_with_its_character_tokenizer(tmp_path, capsys):
    """A train-retrieval checkpoint directory (hybrid config inside, character tokenizer): convert --check writes
    SmolLM3 + a Hugging Face tokenizer that encodes and decodes like the CharTokenizer."""
    from tinyattn.retrieval.model import save_retrieval_model
    from tinyattn.retrieval.tokenizer import CharTokenizer

    ct = CharTokenizer(unknown="unk")
    model = hybrid_model(vocab_size=ct.vocab_size)
    ckpt = save_retrieval_model(model, CharTokenizer(), tmp_path / "ckpt")
    out = tmp_path / "hf"
    assert C.main(["--model", str(ckpt), "--out", str(out), "--check"]) == 0
    printed = capsys.readouterr().out
    assert "tokenizer.json" in printed
    assert re.search(r"check passed: max \|logit difference\| vs tinyattn runtime = \S+ \(limit 0\.0001\)", printed)
    assert C.load_hf(out)[0] == model.config
    tok = transformers.AutoTokenizer.from_pretrained(out)
    for text in ["The pass key is 7f3a.\n  What is the pass key? 7f3a", "naïve <s> é", " x"]:
        ids = tok(text)["input_ids"]
        assert ids == ct.encode(text)
        assert tok.decode(ids, skip_special_tokens=True) == ct.decode(ids)
    assert C.main(["--model", str(ckpt), "--out", str(out), "--nope-layers", "0"]) == 2
    assert "--nope-layers: not used with a retrieval checkpoint" in capsys.readouterr().err
    assert C.main(["--model", str(tmp_path), "--out", str(out)]) == 2
    assert "is a directory but not a tinyattn retrieval checkpoint" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- tinyattn convert
def test_convert_runs_with_no_path_and_writes_readable_files(tmp_path, capsys, monkeypatch):
    import os
    import stat

    from commands import run_main

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


def test_convert_missing_file_names_the_option(tmp_path, capsys):
    from commands import run_main

    code, _, err = run_main(["convert", "--model", "no/such.bin", "--out", str(tmp_path / "o")], capsys)
    assert code == 2
    assert "convert: error: --model: file not found: no/such.bin" in err
    assert "Errno" not in err
    code, _, err = run_main(["convert", "--tokenizer", "no/tok.bin", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "--tokenizer: file not found: no/tok.bin" in err


def test_convert_module_entry_point_errors_cleanly(tmp_path, capsys):
    assert C.main(["--model", "no/such.bin", "--out", str(tmp_path)]) == 2
    assert "python -m tinyattn.integrations.convert: error: --model: file not found" in capsys.readouterr().err
