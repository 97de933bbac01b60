"""llama2.c -> Hugging Face converter, on the real stories260K checkpoint (the copy shipped in tinyattn/data)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
hf = pytest.importorskip("tinyattn.integrations.hf")
from tinyattn.integrations import convert as C  # noqa: E402


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from conftest import CKPT

    out = tmp_path_factory.mktemp("stories260K-hf")
    assert C.main(["--model", str(CKPT), "--tokenizer", str(CKPT.parent / "tok512.bin"), "--out", str(out)]) == 0
    return CKPT.parent, out


def known_good(model_dir) -> str:
    from conftest import KNOWN_GOOD

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

    from conftest import VALID

    ref = Tokenizer(model_dir / "tok512.bin")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    texts = load_stories(VALID)[:3] + ["Hello  wörld! 💥\n x"]
    for text in texts:
        ids = tok(text)["input_ids"]
        assert ids == ref.encode(text)
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids)


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
