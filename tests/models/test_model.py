"""The paged LLaMA runtime on the real stories260K model.

The reference is a plain dense PyTorch implementation of the same model written here (full causal
attention over the whole sequence, no cache, complex-number RoPE as in llama2.c's model.py), so the
runtime's logits are checked independently of tinyattn's ops and cache.
"""

from __future__ import annotations

import os
import struct

import pytest
import torch

from tinyattn.models import (LlamaModel, LlamaRuntime, SparsityConfig, evaluate, load_llama2c,
                             load_stories, rope_tables)
from tinyattn.models.llama import apply_rope

from model_fixtures import model, tok  # noqa: F401  (fixtures)

from paths import CKPT, KNOWN_GOOD, VALID  # noqa: E402  (the shipped model and texts)


TORCH = "torch"  # conftest sets TRITON_INTERPRET=1, which would make backend=None pick the slow interpreter


@pytest.fixture(scope="module")
def weights():
    return load_llama2c(CKPT)


def known_good_text() -> str:
    return KNOWN_GOOD.read_text(encoding="utf-8")[:-1]   # the model README's block (test_cli checks the copy)


# ------------------------------------------------------------------------------------ plain dense reference
def plain_dense_logits(weights, tokens: list[int]) -> torch.Tensor:
    """Logits [T, V] of a whole sequence: llama2.c model.py math, full causal attention, no cache."""
    cfg, sd = weights
    T, hd, H, Hkv = len(tokens), cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    freqs = 1.0 / (10000.0 ** (torch.arange(0, hd, 2)[: hd // 2].float() / hd))
    freqs_cis = torch.polar(torch.ones(T, hd // 2), torch.outer(torch.arange(T).float(), freqs))  # [T, hd/2]

    def rope(x):  # [T, h, hd], pairs (2i, 2i+1) as complex numbers
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs_cis[:, None, :]).flatten(-2)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    x = sd["tok_embeddings.weight"][torch.tensor(tokens)]
    mask = torch.full((T, T), float("-inf")).triu(1)
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        h = rms(x, sd[p + "attention_norm.weight"])
        q = rope((h @ sd[p + "wq.weight"].T).view(T, H, hd))
        k = rope((h @ sd[p + "wk.weight"].T).view(T, Hkv, hd)).repeat_interleave(H // Hkv, dim=1)
        v = (h @ sd[p + "wv.weight"].T).view(T, Hkv, hd).repeat_interleave(H // Hkv, dim=1)
        att = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5 + mask
        o = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(T, H * hd)
        x = x + o @ sd[p + "wo.weight"].T
        h = rms(x, sd[p + "ffn_norm.weight"])
        x = x + (torch.nn.functional.silu(h @ sd[p + "w1.weight"].T) * (h @ sd[p + "w3.weight"].T)) @ sd[p + "w2.weight"].T
    return rms(x, sd["norm.weight"]) @ sd["output.weight"].T


def teacher_forced_logits(rt: LlamaRuntime, tokens: list[int], prefill_len: int) -> torch.Tensor:
    """Runtime logits [T, V]: dense prefill of ``prefill_len`` tokens, then one decode step per token."""
    cache = rt.new_cache([len(tokens)])
    sid = cache.add_sequence()
    out = [rt.prefill(cache, sid, tokens[:prefill_len], last_only=False)]
    for t in tokens[prefill_len:]:
        out.append(rt.decode(cache, [sid], [t]))
    return torch.cat(out)


@pytest.fixture(scope="module")
def story_tokens(tok) -> list[int]:
    return tok.encode(load_stories(VALID)[0], bos=True)


# ------------------------------------------------------------------------------------ loader
def test_header_and_config(model):
    cfg = model.config
    assert (cfg.dim, cfg.hidden_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size, cfg.max_seq_len) == (
        64, 172, 5, 8, 4, 512, 512)
    assert cfg.head_dim == 8 and cfg.shared_classifier
    assert model.output.weight is model.tok_embeddings.weight


def test_rope_tables_equal_the_stored_ones(model):
    cfg = model.config
    data = CKPT.read_bytes()
    n = cfg.max_seq_len * cfg.head_dim // 2
    end = len(data)
    imag = torch.frombuffer(bytearray(data[end - 4 * n : end]), dtype=torch.float32).view(cfg.max_seq_len, -1)
    real = torch.frombuffer(bytearray(data[end - 8 * n : end - 4 * n]), dtype=torch.float32).view(cfg.max_seq_len, -1)
    cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len)
    torch.testing.assert_close(cos, real, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, imag, atol=1e-6, rtol=0)


def test_truncated_or_foreign_checkpoint_is_a_clear_error(tmp_path):
    data = CKPT.read_bytes()
    bad = tmp_path / "truncated.bin"
    bad.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"file size 1,056,440 bytes does not match its header.*1,056,540"):
        LlamaModel.from_llama2c(bad)
    bad.write_bytes(data[:20])
    with pytest.raises(ValueError, match="header alone needs 28"):
        load_llama2c(bad)
    bad.write_bytes(struct.pack("<7i", 64, 172, 5, 0, 4, 512, 512) + b"\0" * 64)
    with pytest.raises(ValueError, match="n_heads=0"):
        load_llama2c(bad)


def test_unshared_classifier(tmp_path, weights):
    cfg, sd = weights
    data = bytearray(CKPT.read_bytes())
    struct.pack_into("<i", data, 20, -cfg.vocab_size)  # negative vocab: a separate wcls follows
    wcls = torch.randn(cfg.vocab_size, cfg.dim, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "unshared.bin"
    path.write_bytes(bytes(data) + wcls.numpy().tobytes())
    m = LlamaModel.from_llama2c(path)
    assert not m.config.shared_classifier
    torch.testing.assert_close(m.output.weight, wcls)
    torch.testing.assert_close(m.tok_embeddings.weight, sd["tok_embeddings.weight"])


# ------------------------------------------------------------------------------------ correctness vs plain dense
def test_prefill_logits_equal_plain_dense(model, weights, story_tokens):
    tokens = story_tokens[:70]
    rt = LlamaRuntime(model, page_size=16, backend=TORCH)
    cache = rt.new_cache([len(tokens)])
    got = rt.prefill(cache, cache.add_sequence(), tokens, last_only=False)
    torch.testing.assert_close(got, plain_dense_logits(weights, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("page_budget", [None, 64])
def test_decode_logits_equal_plain_dense(model, weights, story_tokens, page_budget):
    """Dense decode, and sparse decode whose budget covers every page, equal the plain model."""
    tokens = story_tokens[:60]
    rt = LlamaRuntime(model, page_size=4, page_budget=page_budget, backend=TORCH)
    got = teacher_forced_logits(rt, tokens, prefill_len=1)
    torch.testing.assert_close(got, plain_dense_logits(weights, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("prompt_len", [7, 8, 9])  # P - 1, P, P + 1 with P = 8
def test_page_boundaries(model, weights, story_tokens, prompt_len):
    P = 8
    tokens = story_tokens[: prompt_len + 2 * P + 1]
    rt = LlamaRuntime(model, page_size=P, backend=TORCH)
    got = teacher_forced_logits(rt, tokens, prefill_len=prompt_len)
    torch.testing.assert_close(got, plain_dense_logits(weights, tokens), atol=1e-4, rtol=0)
    # greedy generation crossing the boundary equals the plain model's greedy loop
    seq = list(story_tokens[:prompt_len])
    for _ in range(P + 2):
        seq.append(int(plain_dense_logits(weights, seq)[-1].argmax()))
    out = rt.generate([story_tokens[:prompt_len]], max_new_tokens=P + 2, eos_id=None)
    assert out.tokens[0] == seq[prompt_len:]


def test_chunked_prefill_uses_absolute_positions(model, weights, story_tokens):
    """Prefill in three chunks (Tq > 1 with earlier context: bottom-right causal) == one pass."""
    tokens = story_tokens[:30]
    rt = LlamaRuntime(model, page_size=4, backend=TORCH)
    cache = rt.new_cache([len(tokens)])
    sid = cache.add_sequence()
    parts = [rt.prefill(cache, sid, chunk, last_only=False) for chunk in (tokens[:5], tokens[5:18], tokens[18:])]
    torch.testing.assert_close(torch.cat(parts), plain_dense_logits(weights, tokens), atol=1e-4, rtol=0)


def test_rope_uses_absolute_positions_in_the_cache(model, story_tokens):
    """Keys are stored rotated at their absolute position, for prefill and for decode tokens."""
    tokens = story_tokens[:11]
    rt = LlamaRuntime(model, page_size=4, backend=TORCH)
    cache = rt.new_cache([len(tokens)])
    sid = cache.add_sequence()
    rt.prefill(cache, sid, tokens[:6])
    for t in tokens[6:]:
        rt.decode(cache, [sid], [t])
    layer = model.layers[0]
    raw_k = layer.wk(layer.attention_norm(model.tok_embeddings(torch.tensor(tokens)))).view(len(tokens), 4, 8)
    cos, sin = rope_tables(8, len(tokens))
    expected = apply_rope(raw_k[None], cos[None], sin[None])[0]  # position p rotates token p
    pages = cache.pages(sid)
    stored = torch.stack([cache.k_cache[0][pages[p // 4], p % 4] for p in range(len(tokens))])
    torch.testing.assert_close(stored, expected, atol=1e-5, rtol=1e-5)
    # and the rotation is not the identity (position 0 is): a wrong position would show
    assert not torch.allclose(stored[1:], raw_k[1:], atol=1e-3)


def test_rope_pairs_are_interleaved():
    x = torch.zeros(1, 1, 1, 4)
    x[..., 0] = 1.0  # (x0, x1) = (1, 0) rotates into (cos, sin); channels 2, 3 stay zero
    cos, sin = rope_tables(4, 3)
    y = apply_rope(x, cos[None, 2:3], sin[None, 2:3])
    torch.testing.assert_close(y[0, 0, 0], torch.tensor([cos[2, 0], sin[2, 0], 0.0, 0.0]))


# ------------------------------------------------------------------------------------ generation
def test_known_good_greedy_text_prefix(model, tok):
    """The README's greedy text from BOS (first 60 tokens here; tests/project/test_cli.py checks all 200)."""
    rt = LlamaRuntime(model, page_size=16, page_budget=64, backend=TORCH)
    out = rt.generate([[tok.bos_id]], max_new_tokens=60)
    assert known_good_text().startswith(tok.decode([tok.bos_id] + out.tokens[0]))


def test_batch_of_different_lengths_equals_each_alone(model, tok):
    texts = ["Tom", "Once upon a time, there was a big dog.", "The sun was hot and Lily wanted to swim in the"]
    prompts = [tok.encode(t) for t in texts]
    assert len({len(p) for p in prompts}) == 3
    rt = LlamaRuntime(model, page_size=4, page_budget=3, backend=TORCH)  # selection active within a few steps
    batch = rt.generate(prompts, max_new_tokens=24)
    for p, got in zip(prompts, batch.tokens):
        assert rt.generate([p], max_new_tokens=24).tokens[0] == got
    assert batch.stats.pages_read < batch.stats.pages_dense


def test_sparse_decode_really_selects(model, tok):
    prompt = tok.encode("Once upon a time, there was a little girl named Lily. She loved to play outside.")
    dense = LlamaRuntime(model, page_size=4, backend=TORCH).generate([prompt], max_new_tokens=30)
    sparse = LlamaRuntime(model, page_size=4, page_budget=2, backend=TORCH).generate([prompt], max_new_tokens=30)
    s, d = sparse.stats, dense.stats
    assert d.pages_read == d.pages_dense and d.kv_bytes_read == d.kv_bytes_dense
    assert s.pages_dense == d.pages_dense
    assert s.pages_read == 2 * 4 * 5 * s.decode_steps  # budget x KV heads x layers, every step past 2 pages
    assert s.kv_bytes_read < s.kv_bytes_dense
    assert s.generated_tokens == 30 and s.decode_steps == 29
    assert "pages read / step" in s.format()


def test_dense_layers_stay_dense(model, tok):
    prompt = tok.encode("Once upon a time, there was a little girl named Lily.")
    rt = LlamaRuntime(model, page_size=4, page_budget=2, dense_layers=2, backend=TORCH)
    s = rt.generate([prompt], max_new_tokens=10).stats
    dense_per_layer = s.pages_dense // 5
    assert s.pages_read == 2 * dense_per_layer + 3 * (2 * 4 * s.decode_steps)


def test_stops_at_eos(model, tok):
    rt = LlamaRuntime(model, page_size=16, backend=TORCH)
    free = rt.generate([[1]], max_new_tokens=12, eos_id=None).tokens[0]
    stop = free[5]
    i = free.index(stop)
    out = rt.generate([[1], tok.encode("Tom")], max_new_tokens=12, eos_id=stop)
    assert out.tokens[0] == free[: i + 1] and out.stopped_on_eos[0]
    assert len(out.tokens[1]) <= 12


def test_temperature_sampling_is_seeded(model, tok):
    rt = LlamaRuntime(model, page_size=8, page_budget=2, backend=TORCH)
    prompts = [[1], tok.encode("Tom had")]
    a = rt.generate(prompts, max_new_tokens=20, temperature=1.0, seed=123).tokens
    b = rt.generate(prompts, max_new_tokens=20, temperature=1.0, seed=123).tokens
    c = rt.generate(prompts, max_new_tokens=20, temperature=1.0, seed=7).tokens
    assert a == b and a != c
    greedy = rt.generate(prompts, max_new_tokens=20).tokens
    assert rt.generate(prompts, max_new_tokens=20, temperature=1e-6, seed=1).tokens == greedy


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_weights(dtype, weights, story_tokens):
    m = LlamaModel.from_llama2c(CKPT, dtype=dtype)
    assert m.dtype == dtype
    tokens = story_tokens[:40]
    rt = LlamaRuntime(m, page_size=8, page_budget=2, backend=TORCH)
    got = teacher_forced_logits(rt, tokens, prefill_len=20)
    ref = plain_dense_logits(weights, tokens)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean()
    assert agree > 0.8


def test_option_validation(model):
    with pytest.raises(ValueError, match="page_budget"):
        LlamaRuntime(model, page_budget=0)
    with pytest.raises(ValueError, match="page_size"):
        LlamaRuntime(model, page_size=0)
    with pytest.raises(ValueError, match="num_sink_pages"):
        SparsityConfig(page_budget=2, num_sink_pages=2, num_recent_pages=1)
    with pytest.raises(ValueError, match="dense_layers"):
        LlamaRuntime(model, dense_layers=6)
    with pytest.raises(ValueError, match="backend"):
        LlamaRuntime(model, backend="cuda")
    rt = LlamaRuntime(model, backend=TORCH)
    with pytest.raises(ValueError, match="non-empty"):
        rt.generate([[]], max_new_tokens=1)
    with pytest.raises(ValueError, match="token ids"):
        rt.generate([[1, 999]], max_new_tokens=1)


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.slow
def test_triton_backend_generates_the_same_tokens(model, tok):
    """Prefill + sparse decode through the Triton kernels (interpreter on CPU) == the torch backend.

    page_size 4, budget 4: the 16-token prompt fills 4 pages, so from the first decode step on the
    scorer really has to choose."""
    prompt = tok.encode("Once upon a time, there was a little girl named Lily.")
    assert len(prompt) == 16
    kw = dict(page_size=4, page_budget=4, num_recent_pages=1)
    ref = LlamaRuntime(model, backend=TORCH, **kw).generate([prompt], max_new_tokens=20)
    got = LlamaRuntime(model, backend="triton", **kw).generate([prompt], max_new_tokens=20)
    assert got.tokens == ref.tokens
    assert got.stats.pages_read < got.stats.pages_dense


# ------------------------------------------------------------------------------------ evaluation
def test_eval_dense_nll_matches_the_readme(model, tok):
    result = evaluate(model, tok, load_stories(VALID), page_size=16, page_budgets=[], backend=TORCH, progress=False)
    assert result.num_stories == 7
    assert abs(result.dense.nll - 1.14) < 0.01


def test_eval_small(model, tok):
    stories = load_stories(VALID)[:2]
    result = evaluate(model, tok, stories, page_size=4, page_budgets=[2, 64], backend=TORCH, max_context=48,
                      progress=False)
    dense, small, full = result.rows
    assert dense.page_budget is None and result.num_tokens == 2 * 47
    # a budget covering every page is dense: same NLL, full agreement, zero KL
    assert abs(full.nll - dense.nll) < 1e-4 and full.top1_agreement == 1.0 and full.kl < 1e-6
    assert full.pages_read_fraction == 1.0
    assert small.pages_read_fraction < 0.5 and small.kl > 0 and small.token_budget == 8


def test_load_stories(tmp_path):
    assert len(load_stories(VALID)) == 7
    f = tmp_path / "s.txt"
    f.write_text("a b\nc\n\n\nd e\n  \nf\n")
    assert load_stories(f) == ["a b\nc", "d e", "f"]
    f.write_text("x\n\ny<|endoftext|>\nz\n<|endoftext|>\n")
    assert load_stories(f) == ["x\n\ny", "z"]


def test_stats_rates_are_labelled_and_consistent(model, tok):
    """Decode tokens/s counts generated tokens over decode time; end to end adds the prefill time to the same
    numerator, so it can never exceed the decode rate (it used to count prompt tokens too)."""
    rt = LlamaRuntime(model, page_size=8, page_budget=2, backend=TORCH)
    out = rt.generate([tok.encode("Tom had a red ball"), tok.encode("Once upon a time")], max_new_tokens=12,
                      eos_id=None)
    s = out.stats
    assert s.generated_tokens == 24
    assert s.end_to_end_tokens_per_s <= s.tokens_per_s
    assert s.tokens_per_s == pytest.approx(s.generated_tokens / s.decode_s)
    assert s.prefill_tokens_per_s == pytest.approx(s.prompt_tokens / s.prefill_s)
    text = s.format()
    assert "generated tokens/s (all 2 rows together)" in text and "end to end:" in text
    assert "incl. prefill" not in text


def test_stats_count_one_in_the_singular(model, tok):
    """The default command decodes one row from BOS: its stats read "1 prompt token", not "1 prompt tokens"."""
    rt = LlamaRuntime(model, page_size=8, backend=TORCH)
    text = rt.generate([[tok.bos_id]], max_new_tokens=2, eos_id=None, stop_token_ids=()).stats.format()
    # 1 BOS token; 2 new tokens = the prefill's + 1 decode step; 3 tokens in one page of 8
    assert "sequences:          1 (1 prompt token, 2 generated, 1 decode step)" in text
    assert ", 1 prompt token (" in text and ", 1 step, " in text and "tokens/s (one row)" in text
    assert "1 page of 8 tokens in use" in text


def test_fused_weights_follow_weight_updates(model, tok):
    """The runtime's stacked wq|wk|wv and w1|w3 (RMSNorm weights folded in) are rebuilt when a weight changes in
    place."""
    import copy
    m = copy.deepcopy(model)
    rt = LlamaRuntime(m, page_size=8, backend=TORCH)
    prompt = [tok.encode("Once upon a time")]
    rt.generate(prompt, max_new_tokens=5, eos_id=None)                   # builds the stacked weights
    with torch.no_grad():
        m.layers[0].wk.weight.mul_(-3.0)
    after = rt.generate(prompt, max_new_tokens=5, eos_id=None).tokens
    fresh = LlamaRuntime(copy.deepcopy(m), page_size=8, backend=TORCH).generate(prompt, max_new_tokens=5, eos_id=None).tokens
    assert after == fresh
    cfg = m.config
    w_qkv = m.layers[0].fused_weights().qkv                               # [dim, out] for x @ W
    wk_cols = slice(cfg.n_heads * cfg.head_dim, (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim)
    want = (m.layers[0].wk.weight * m.layers[0].attention_norm.weight).t()   # diag(g) Wk^T
    torch.testing.assert_close(w_qkv[:, wk_cols], want, rtol=1e-6, atol=0)



def test_frozen_weights_check_once_and_follow_changes_after_the_block(model):
    """Inside frozen_weights() every step takes the weights checked on entry; on exit the next step sees an in-place
    change made inside the block (generate runs in one block, so weights changed between calls are used)."""
    import copy
    m = copy.deepcopy(model)
    with m.frozen_weights():
        first = m._weights()
        with torch.no_grad():
            m.layers[0].wk.weight.mul_(-3.0)
        assert m._weights() is first                                     # no per-step check inside the block
    after = m._weights()[0].qkv
    cfg = m.config
    wk_cols = slice(cfg.n_heads * cfg.head_dim, (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim)
    want = (m.layers[0].wk.weight * m.layers[0].attention_norm.weight).t()
    torch.testing.assert_close(after[:, wk_cols], want, rtol=1e-6, atol=0)

@pytest.mark.slow
def test_generation_can_stop_at_bos(model, tok):
    """llama2.c models end a story where the next one's BOS would come: stop_token_ids=(BOS,) stops there (the
    CLI's default, like run.c), the same tokens as an unstopped run up to and including that BOS."""
    rt = LlamaRuntime(model, page_size=16, page_budget=4, backend=TORCH)
    prompt = [tok.encode("Tom had a red ball")]
    free = rt.generate(prompt, max_new_tokens=300, eos_id=None).tokens[0]
    assert tok.bos_id in free                                     # this story ends within 300 tokens
    stopped = rt.generate(prompt, max_new_tokens=300, eos_id=None, stop_token_ids=(tok.bos_id,)).tokens[0]
    cut = free.index(tok.bos_id) + 1
    assert stopped == free[:cut]


def test_runtime_decodes_with_bf16_boxes_and_counts_their_bytes(model, tok):
    from tinyattn.models import LlamaRuntime

    prompt = tok.encode("Once upon a time, there was a little girl named Lily. She liked to play", bos=True)
    runs = {}
    for box in ("auto", "bf16"):
        rt = LlamaRuntime(model, page_size=4, page_budget=3, backend="torch", box_dtype=box)
        runs[box] = rt.generate([prompt], max_new_tokens=12)
    assert len(runs["bf16"].tokens[0]) == 12
    cfg = model.config
    # decode steps see lengths len(prompt) + 1 ... len(prompt) + 11 (the first token comes from the prefill);
    # each sparse layer and KV head scores every page's two boxes: 2 bytes less per element with bf16
    lens = range(len(prompt) + 1, len(prompt) + 12)
    saved = sum(-(-n // 4) for n in lens) * 2 * cfg.head_dim * 2 * cfg.n_kv_heads * cfg.n_layers
    got = runs["auto"].stats.kv_bytes_read - runs["bf16"].stats.kv_bytes_read
    assert got == saved
