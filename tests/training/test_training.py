"""Chunked fine-tuning with a paged KV memory: model equivalence, gradients into the memory, retention policies,
and the finetune command."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from tinyattn.models import LlamaConfig, LlamaModel, apply_rope, rope_tables
from tinyattn.training import (ChunkedKVMemory, FullRetention, GradientRetention, RecencyRetention, chunk_forward,
                               make_policy, run_sequences)
from tinyattn.training.retention import page_taylor_scores
from tinyattn.training import finetune as ft

BACKENDS = ["torch", "triton"]


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(dim=16, hidden_dim=24, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40, max_seq_len=64)
    model = LlamaModel(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model


def reference_forward(model, tokens, memory_kv=None):
    """Dense causal forward of ``tokens`` [B, n] after ``memory_kv`` (per layer (k, v) [B, m, Hkv, hd] leaves)."""
    cfg = model.config
    B, n = tokens.shape
    hd, Hq, Hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    m = 0 if memory_kv is None else memory_kv[0][0].shape[1]
    cos, sin = rope_tables(hd, m + n)
    cos, sin = cos[m:].expand(B, n, -1), sin[m:].expand(B, n, -1)
    x = model.tok_embeddings(tokens)
    kvs = []
    for li, layer in enumerate(model.layers):
        h = layer.attention_norm(x)
        q = apply_rope(layer.wq(h).view(B, n, Hq, hd), cos, sin)
        k = apply_rope(layer.wk(h).view(B, n, Hkv, hd), cos, sin)
        v = layer.wv(h).view(B, n, Hkv, hd)
        kvs.append((k, v))
        if memory_kv is not None:
            k = torch.cat([memory_kv[li][0], k], 1)
            v = torch.cat([memory_kv[li][1], v], 1)
        mask = torch.ones(n, m + n, dtype=torch.bool).tril(m)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(Hq // Hkv, 1),
                                             v.transpose(1, 2).repeat_interleave(Hq // Hkv, 1), attn_mask=mask)
        x = x + layer.wo(att.transpose(1, 2).reshape(B, n, Hq * hd))
        x = x + layer.ffn(layer.ffn_norm(x))
    return model.output(model.norm(x)).float(), kvs


# ---- the chunked forward is the model ------------------------------------------------------------------
def test_full_retention_chunks_equal_one_dense_pass_of_the_real_model():
    from paths import CKPT

    model = LlamaModel.from_llama2c(CKPT)
    tokens = torch.randint(3, 512, (2, 97), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(page_size=16, num_pages=16)
    want = model(tokens[:, :-1], cache, [cache.add_sequence(), cache.add_sequence()], backend="torch")
    memory = ChunkedKVMemory(5, 4, 8, batch=2, seq_len=96, chunk_size=32, page_size=16, capacity=None,
                             policy=FullRetention())
    got = []
    for start in range(0, 96, 32):
        memory.begin_chunk(32)
        with torch.no_grad():
            got.append(chunk_forward(model, tokens[:, start:start + 32], memory, backend="torch"))
        memory.commit()
    torch.testing.assert_close(torch.cat(got, 1), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_reach_the_weights_and_the_memory_pages(backend):
    """Chunk 2 of a row: weight gradients and the memory's page gradients equal dense autograd with memory leaves."""
    model = tiny_model()
    tokens = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(1))
    memory = ChunkedKVMemory(2, 2, 4, batch=2, seq_len=16, chunk_size=8, page_size=4, capacity=None,
                             policy=FullRetention())
    memory.begin_chunk(8)
    with torch.no_grad():
        chunk_forward(model, tokens[:, :8], memory, backend=backend)
    memory.commit()
    memory.begin_chunk(8)
    logits = chunk_forward(model, tokens[:, 8:], memory, backend=backend, track_gradients=True)
    pools = list(memory._pools)
    logits.square().mean().backward()
    got_w = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    with torch.no_grad():
        _, first = reference_forward(model, tokens[:, :8])
    leaves = [(k.clone().requires_grad_(), v.clone().requires_grad_()) for k, v in first]
    want, _ = reference_forward(model, tokens[:, 8:], leaves)
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
    want.square().mean().backward()
    for g, p in zip(got_w, model.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-4)
    for layer, (k_leaf, v_leaf) in enumerate(leaves):
        k_pool, v_pool = pools[layer]
        for b in range(2):
            pages = memory.phys[layer][b, :2]                                  # logical pages 0, 1 = chunk 1
            torch.testing.assert_close(k_pool.grad[pages].reshape(8, 2, 4), k_leaf.grad[b], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(v_pool.grad[pages].reshape(8, 2, 4), v_leaf.grad[b], atol=1e-5, rtol=1e-4)


def test_evicted_pages_get_no_gradient_and_positions_do_not_shift():
    model = tiny_model()
    tokens = torch.randint(0, 40, (1, 25), generator=torch.Generator().manual_seed(2))
    policy = RecencyRetention()
    memory = ChunkedKVMemory(2, 2, 4, batch=1, seq_len=24, chunk_size=4, page_size=2, capacity=5, policy=policy,
                             num_sink_pages=1, num_recent_pages=1)
    for start in range(0, 24, 4):
        memory.begin_chunk(4)
        logits = chunk_forward(model, tokens[:, start:start + 4], memory, backend="torch", track_gradients=True)
        logits.sum().backward()
        held = memory.held(0)[0]
        k_pool = memory._pools[0][0]
        used = set(memory.phys[0][0, held].tolist())
        for page in range(k_pool.shape[0]):
            if page not in used:
                assert torch.equal(k_pool.grad[page], torch.zeros_like(k_pool.grad[page]))
        memory.commit()
    # recency: sink page 0, then the newest pages; 12 logical pages of 2 tokens, capacity 5
    assert memory.held(0)[0].nonzero().squeeze(1).tolist() == [0, 8, 9, 10, 11]
    # the same tokens through a dense pass that only sees the kept positions: RoPE and causality unchanged
    assert memory.peak_pages == 5 and memory.evicted == 2 * 7


# ---- retention bookkeeping -----------------------------------------------------------------------------
class ScriptedPolicy(GradientRetention):
    """Gradient policy whose observations are replaced by fixed page scores."""

    def __init__(self, page_scores, **options):
        super().__init__(decay=0.0, **options)
        self.page_scores = page_scores

    def observe(self, layer, norms, held):
        super().observe(layer, self.page_scores.expand_as(norms) * held, held)


def test_gradient_policy_frees_the_lowest_scores_but_never_sinks_or_recent_pages():
    model = tiny_model()
    scores = torch.tensor([0.0, 5.0, 1.0, 9.0, 0.5, 7.0, 3.0, 8.0, 2.0, 6.0, 4.0, 1.5])
    policy = ScriptedPolicy(scores)
    memory = ChunkedKVMemory(2, 2, 4, batch=2, seq_len=24, chunk_size=4, page_size=2, capacity=6, policy=policy,
                             num_sink_pages=1, num_recent_pages=2)
    tokens = torch.randint(0, 40, (2, 25), generator=torch.Generator().manual_seed(3))
    for start in range(0, 24, 4):
        memory.begin_chunk(4)
        held = memory.held(1)
        assert int(held.sum(1).max()) <= 6
        assert held[:, 0].all()                                     # the sink
        newest = math.ceil((start + 4) / 2)
        assert held[:, newest - 4:newest].all()                     # recent pages + the chunk's pages
        logits = chunk_forward(model, tokens[:, start:start + 4], memory, backend="torch", track_gradients=True)
        logits.sum().backward()
        memory.observe_gradients()
        memory.commit()
    kept = memory.held(1)[0].nonzero().squeeze(1).tolist()
    # the end: sink 0, recent 8, 9, chunk 10, 11, and one more chosen by score among the pages still held
    assert kept[0] == 0 and kept[-4:] == [8, 9, 10, 11] and len(kept) == 6
    assert kept[1] in (3, 7)                                        # the highest scores survive
    # physical pages are reused: never more than capacity * batch in the pool
    assert memory.k[1].shape[0] == 12


def test_gradient_policy_recent_pages_ranks_the_newest_held_pages_above_the_score():
    p = GradientRetention(decay=0.0, recent_pages=2)
    p.reset(1, 2, 6)
    p.ema[0] = torch.tensor([[3.0, -1.0, 8.0, 0.5, 2.0, 0.0], [1.0, 4.0, 0.0, 0.0, 0.0, 0.0]])
    held = torch.tensor([[True, True, True, False, True, False], [True, True, False, False, False, False]])
    s = p.scores(0, held)
    # row 0: the 2 newest held pages are 2 and 4 (3 is not held): max held ema 8 + 1 + position
    assert s[0, [0, 1, 4, 2]].tolist() == [3.0, -1.0, 13.0, 11.0]
    # row 1: both held pages are "recent"; max held ema 4 + 1 + position, still in recency order
    assert s[1, [0, 1]].tolist() == [5.0, 6.0]
    plain = GradientRetention(decay=0.0)
    plain.reset(1, 2, 6)
    plain.ema[0] = p.ema[0].clone()
    assert torch.equal(plain.scores(0, held), p.ema[0])                         # default: the score alone
    with pytest.raises(ValueError, match="recent_pages"):
        GradientRetention(recent_pages=-1)


@pytest.mark.parametrize("recent, expected", [(0, [0, 3, 5, 7, 8, 9, 10, 11]), (4, [0, 3, 6, 7, 8, 9, 10, 11])])
def test_gradient_policy_recent_pages_in_the_memory(recent, expected):
    """Capacity 8 pages of 2 tokens, chunks of 2 pages, 1 sink, 2 protected recent pages; traced by hand:
    R=0 frees pages 4, 2 then 6, 1 (lowest scores); R=4 keeps the 4 newest held pages and frees 2, 1 then 4, 5."""
    model = tiny_model()
    scores = torch.tensor([0.0, 5.0, 1.0, 9.0, 0.5, 7.0, 3.0, 8.0, 2.0, 6.0, 4.0, 1.5])
    memory = ChunkedKVMemory(2, 2, 4, batch=2, seq_len=24, chunk_size=4, page_size=2, capacity=8,
                             policy=ScriptedPolicy(scores, recent_pages=recent), num_sink_pages=1, num_recent_pages=2)
    tokens = torch.randint(0, 40, (2, 25), generator=torch.Generator().manual_seed(3))
    for start in range(0, 24, 4):
        memory.begin_chunk(4)
        logits = chunk_forward(model, tokens[:, start:start + 4], memory, backend="torch", track_gradients=True)
        logits.sum().backward()
        memory.observe_gradients()
        memory.commit()
    for layer in range(2):
        for row in range(2):
            assert memory.held(layer)[row].nonzero().squeeze(1).tolist() == expected


def test_gradient_policy_ema():
    p = GradientRetention(decay=0.5)
    p.reset(1, 1, 3)
    held = torch.tensor([[True, True, False]])
    p.observe(0, torch.tensor([[4.0, 2.0, 9.0]]), held)
    assert p.ema[0].tolist() == [[4.0, 2.0, 0.0]]                    # first observation: the value itself
    p.observe(0, torch.tensor([[0.0, 6.0, 1.0]]), torch.tensor([[True, True, True]]))
    assert p.ema[0].tolist() == [[2.0, 4.0, 1.0]]


def test_taylor_score_is_the_loss_change_of_zeroing_a_page_for_a_linear_loss():
    """For a loss linear in K/V the first-order estimate is exact: compare with zeroing each page and re-evaluating."""
    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(3, 2, 1, 4, generator=gen), torch.randn(3, 2, 1, 4, generator=gen)
    wk, wv = torch.randn(3, 2, 1, 4, generator=gen), torch.randn(3, 2, 1, 4, generator=gen)

    def loss(k, v):
        return (wk * k).sum() + (wv * v).sum() + 7.0

    k_pool, v_pool = k.clone().requires_grad_(), v.clone().requires_grad_()
    loss(k_pool, v_pool).backward()
    want = []
    for p in range(3):
        k0, v0 = k.clone(), v.clone()
        k0[p] = 0
        v0[p] = 0
        want.append(float(loss(k0, v0) - loss(k, v)))
    torch.testing.assert_close(page_taylor_scores(k_pool, v_pool), torch.tensor(want), atol=1e-5, rtol=1e-5)
    # a hand-computed case: one page, one slot, k = [1, 2], v = [3, -1], dk = [0.5, 0], dv = [1, 2]
    kp = torch.tensor([1.0, 2.0]).view(1, 1, 1, 2).requires_grad_()
    vp = torch.tensor([3.0, -1.0]).view(1, 1, 1, 2).requires_grad_()
    ((torch.tensor([0.5, 0.0]).view_as(kp) * kp).sum() + (torch.tensor([1.0, 2.0]).view_as(vp) * vp).sum()).backward()
    assert page_taylor_scores(kp, vp).tolist() == [-(0.5 * 1 + 0 * 2 + 1 * 3 + 2 * -1)]      # -1.5


def test_gradient_policy_observes_the_taylor_score_of_each_memory_page():
    """The per-page score the memory hands the policy: -sum(dk*k + dv*v) from dense autograd with memory leaves."""
    model = tiny_model()
    tokens = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(6))
    policy = GradientRetention(decay=0.0)
    seen = {}
    policy.observe = lambda layer, g, held: seen.__setitem__(layer, (g.clone(), held.clone()))
    memory = ChunkedKVMemory(2, 2, 4, batch=2, seq_len=16, chunk_size=8, page_size=4, capacity=None, policy=policy)
    memory.begin_chunk(8)
    with torch.no_grad():
        chunk_forward(model, tokens[:, :8], memory, backend="torch")
    memory.commit()
    memory.begin_chunk(8)
    chunk_forward(model, tokens[:, 8:], memory, backend="torch", track_gradients=True).square().mean().backward()
    memory.observe_gradients()

    with torch.no_grad():
        _, first = reference_forward(model, tokens[:, :8])
    leaves = [(k.clone().requires_grad_(), v.clone().requires_grad_()) for k, v in first]
    want, _ = reference_forward(model, tokens[:, 8:], leaves)
    want.square().mean().backward()
    for layer, (k_leaf, v_leaf) in enumerate(leaves):
        g, held = seen[layer]
        assert held.all()
        for b in range(2):
            for j in range(2):                                              # memory pages 0, 1 (chunk 1)
                sl = slice(4 * j, 4 * j + 4)
                kk, vv = k_leaf.detach()[b, sl], v_leaf.detach()[b, sl]
                expected = -float((k_leaf.grad[b, sl] * kk).sum() + (v_leaf.grad[b, sl] * vv).sum())
                assert abs(float(g[b, j]) - expected) <= 1e-5 + 1e-4 * abs(expected)


def test_memory_and_policy_validation():
    with pytest.raises(ValueError, match="chunk_size: expected a multiple of page_size=4"):
        ChunkedKVMemory(1, 1, 4, batch=1, seq_len=16, chunk_size=6, page_size=4, capacity=4, policy=FullRetention())
    with pytest.raises(ValueError, match=r"capacity: expected at least .* = 4 pages, got 3"):
        ChunkedKVMemory(1, 1, 4, batch=1, seq_len=32, chunk_size=8, page_size=4, capacity=3,
                        policy=RecencyRetention(), num_sink_pages=1, num_recent_pages=1)
    with pytest.raises(ValueError, match="retention: expected one of"):
        make_policy("lru")
    with pytest.raises(ValueError, match="decay"):
        GradientRetention(decay=1.0)
    with pytest.raises(ValueError, match="signal: expected one of"):
        GradientRetention(signal="hessian")


@pytest.mark.parametrize("name", ["full", "recency", "gradient"])
def test_run_sequences_trains_and_holds_the_budget(name):
    model = tiny_model()
    tokens = torch.randint(0, 40, (2, 33), generator=torch.Generator().manual_seed(4))
    stats = run_sequences(model, tokens, make_policy(name), chunk_size=8, page_size=4, capacity=5, num_sink_pages=1,
                          num_recent_pages=1, train=True, backend="torch")
    assert stats.num_tokens == 64 and math.isfinite(stats.nll)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    page_bytes = 2 * 4 * 2 * 4 * 4                                  # K+V, page_size 4, Hkv 2, hd 4, fp32
    pages = 8 if name == "full" else 5
    assert stats.peak_kv_bytes == 2 * 2 * pages * page_bytes           # layers * rows * pages
    assert (stats.evicted_pages > 0) == (name != "full")


def test_loss_mask_counts_only_the_masked_targets_and_their_gradient():
    """Full retention: the masked NLL is the mean NLL over the masked targets of the independent dense reference
    run chunk by chunk (earlier chunks' K/V detached, as the memory holds them), and so is its weight gradient."""
    model = tiny_model()
    tokens = torch.randint(0, 40, (2, 33), generator=torch.Generator().manual_seed(5))
    mask = torch.zeros(2, 32, dtype=torch.bool)
    mask[0, 30:] = True                       # the last chunk only in row 0
    mask[1, [3, 17]] = True                   # two chunks of row 1; chunk 8..15 counts nothing
    model.requires_grad_(True)
    total, memory_kv = 0.0, None
    for start in range(0, 32, 8):
        logits, kvs = reference_forward(model, tokens[:, start:start + 8], memory_kv)
        nll = F.cross_entropy(logits.reshape(-1, 40), tokens[:, start + 1:start + 9].reshape(-1), reduction="none")
        total = total + nll[mask[:, start:start + 8].reshape(-1)].sum()
        kvs = [(k.detach(), v.detach()) for k, v in kvs]
        memory_kv = kvs if memory_kv is None else [(torch.cat([a, k], 1), torch.cat([b, v], 1))
                                                   for (a, b), (k, v) in zip(memory_kv, kvs)]
    want = total / 4
    want.backward()
    want_grad = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    stats = run_sequences(model, tokens, make_policy("full"), chunk_size=8, page_size=4, capacity=None,
                          train=True, backend="torch", loss_mask=mask)
    assert stats.num_tokens == 4
    assert stats.nll == pytest.approx(float(want.detach()), rel=1e-5)
    for p, g in zip(model.parameters(), want_grad):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="loss_mask: expected a bool tensor of shape"):
        run_sequences(model, tokens, make_policy("full"), chunk_size=8, page_size=4, capacity=None, train=False,
                      loss_mask=mask.float())


# ---- the command -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_finetune_command_writes_the_json(tmp_path):
    from paths import CKPT, VALID as data

    model_dir = CKPT.parent
    results = {}
    for retention in ("full", "recency", "gradient"):
        out = tmp_path / f"{retention}.json"
        status = ft.main(["--model", str(model_dir / "stories260K.bin"), "--tokenizer", str(model_dir / "tok512.bin"),
                          "--data", str(data), "--seq-len", "64", "--chunk-size", "16", "--page-size", "8",
                          "--retention", retention, "--kv-budget-pages", "5", "--steps", "2", "--batch-size", "2",
                          "--eval-sequences", "2", "--json", str(out), "--no-progress", "--backend", "torch"])
        assert status == 0
        results[retention] = json.loads(out.read_text())
    for r in results.values():
        assert {"retention", "peak_kv_bytes", "peak_memory_bytes", "train_loss", "eval_nll"} <= set(r)
        assert math.isfinite(r["train_loss"]) and math.isfinite(r["eval_nll"])
    assert results["full"]["peak_kv_bytes"] == 5 * 2 * 8 * (2 * 8 * 4 * 8 * 4)    # layers, rows, pages, page bytes
    assert results["recency"]["peak_kv_bytes"] == results["gradient"]["peak_kv_bytes"]
    assert results["gradient"]["peak_kv_bytes"] * 8 == results["full"]["peak_kv_bytes"] * 5


def test_finetune_command_errors(tmp_path, capsys):
    from paths import CKPT, VALID

    model_dir = CKPT.parent
    args = ["--model", str(model_dir / "stories260K.bin"), "--tokenizer", str(model_dir / "tok512.bin"),
            "--data", str(VALID), "--steps", "1",
            "--json", str(tmp_path / "x.json"), "--retention", "gradient"]
    assert ft.main(args + ["--chunk-size", "12", "--kv-budget-pages", "8"]) == 2
    assert "--chunk-size (12) must be a multiple of --page-size (16)" in capsys.readouterr().err
    assert ft.main(args + ["--chunk-size", "16"]) == 2
    assert "--kv-budget-pages is required" in capsys.readouterr().err



def test_finetune_budget_error_names_the_flags(capsys):
    """``tinyattn finetune``: a budget too small for the sink, recent and chunk pages names each flag and the sum."""
    from commands import run_main

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


def test_finetune_budget_check_matches_the_memory():
    """The command's check accepts exactly what ChunkedKVMemory accepts (the smallest budget runs)."""
    import argparse

    with pytest.raises(ValueError):
        ChunkedKVMemory(1, 1, 8, batch=1, seq_len=512, chunk_size=64, page_size=16, capacity=8,
                        policy=make_policy("recency"), num_sink_pages=1)
    ChunkedKVMemory(1, 1, 8, batch=1, seq_len=512, chunk_size=64, page_size=16, capacity=9,
                    policy=make_policy("recency"), num_sink_pages=1)
    args = argparse.Namespace(retention="recency", kv_budget_pages=9, seq_len=512, page_size=16, chunk_size=64,
                              sink_pages=1, recent_pages=None)
    ft.check_budget(args)
    args.kv_budget_pages = 8
    with pytest.raises(ValueError, match="--kv-budget-pages"):
        ft.check_budget(args)
    args.kv_budget_pages, args.seq_len = 2, 32      # the budget covers the whole sequence: full retention
    ft.check_budget(args)

def test_story_splitting():
    text = "Once upon a time A.\n\nThen B.\n\nOnce there was C.\n\n  \n\nOnce, D."
    assert ft.split_stories(text) == ["Once upon a time A.\n\nThen B.", "Once there was C.", "Once, D."]
    assert ft.split_stories("a<|endoftext|> b <|endoftext|>") == ["a", "b"]
