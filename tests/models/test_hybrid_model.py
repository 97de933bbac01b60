"""Hybrid models (sliding-window RoPE layers + full-attention NoPE layers) through every tinyattn path.

The expected logits come from a plain-torch full-sequence forward written here from the architecture's
definition (RMSNorm, interleaved RoPE on RoPE layers only, GQA attention with a causal mask that a sliding layer
narrows to ``i - sliding_window < j <= i``, SwiGLU), sharing nothing with the paged runtime but the weights.
"""

import math

import pytest
import torch

from tinyattn.engine import Engine, SamplingParams
from tinyattn.models import LlamaConfig, LlamaModel, LlamaRuntime
from tinyattn.training.chunked import chunk_forward
from tinyattn.training.memory import ChunkedKVMemory
from tinyattn.training.retention import FullRetention

WINDOW = 7


def hybrid_config(**kw) -> LlamaConfig:
    base = dict(dim=32, hidden_dim=48, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=61, max_seq_len=256,
                layer_types=("sliding_attention", "full_attention", "sliding_attention", "full_attention"),
                sliding_window=WINDOW, nope_layers=(1,))
    base.update(kw)
    return LlamaConfig(**base)


def random_model(cfg: LlamaConfig, seed: int = 0) -> LlamaModel:
    torch.manual_seed(seed)
    model = LlamaModel(cfg)
    with torch.no_grad():
        for p in model.parameters():        # larger than the default init: attention patterns far from uniform
            p.normal_(0.0, 0.5 if p.dim() == 2 else 0.2).add_(1.0 if p.dim() == 1 else 0.0)
    return model.eval()


# ----------------------------------------------------------------------------------- the independent forward
def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate(x, positions, theta):
    """Interleaved RoPE (pairs ``(2i, 2i+1)``) of ``x`` ``[T, H, D]`` at ``positions`` ``[T]``."""
    D = x.shape[-1]
    inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = positions.double()[:, None] * inv[None]                                      # [T, D/2]
    c, s = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
    x0, x1 = x[..., 0::2].double(), x[..., 1::2].double()
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), -1).flatten(-2)


def plain_forward(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    """Logits ``[T, V]`` (float64) of one sequence, the whole of it at once."""
    cfg = model.config
    T, hd, Hq, Hkv = len(tokens), cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    pos = torch.arange(T)
    x = model.tok_embeddings.weight.double()[torch.tensor(tokens)]
    i, j = pos[:, None], pos[None, :]
    for li, blk in enumerate(model.layers):
        h = rms_norm(x, blk.attention_norm.weight.double(), cfg.norm_eps)
        q = (h @ blk.wq.weight.double().T).view(T, Hq, hd)
        k = (h @ blk.wk.weight.double().T).view(T, Hkv, hd)
        v = (h @ blk.wv.weight.double().T).view(T, Hkv, hd)
        if li not in cfg.nope_layers:
            q, k = rotate(q, pos, cfg.rope_theta), rotate(k, pos, cfg.rope_theta)
        mask = j <= i
        if cfg.layer_types[li] == "sliding_attention":
            mask = mask & (i - cfg.sliding_window < j)
        k, v = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
        logits = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
        attn = torch.einsum("hts,shd->thd", torch.softmax(logits.masked_fill(~mask, -math.inf), -1), v)
        x = x + attn.reshape(T, -1) @ blk.wo.weight.double().T
        h = rms_norm(x, blk.ffn_norm.weight.double(), cfg.norm_eps)
        x = x + (torch.nn.functional.silu(h @ blk.w1.weight.double().T) * (h @ blk.w3.weight.double().T)) \
            @ blk.w2.weight.double().T
    return rms_norm(x, model.norm.weight.double(), cfg.norm_eps) @ model.output.weight.double().T


# ----------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def model():
    return random_model(hybrid_config())


def test_paged_prefill_and_decode_equal_the_plain_forward(model):
    """Two rows of different lengths: prefill (Tq > 1, crossing the window) then 30 decode steps, dense, page size 4;
    every position's logits equal the plain full-sequence forward's."""
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 61, (45,), generator=g).tolist(), torch.randint(0, 61, (38,), generator=g).tolist()]
    prompts = [11, 3]                                                    # a prompt shorter than the window, too
    cache = model.new_cache(page_size=4, num_pages=40)
    ids = [cache.add_sequence() for _ in seqs]
    got = [[] for _ in seqs]
    for b, (sid, n) in enumerate(zip(ids, prompts)):
        logits = model(torch.tensor([seqs[b][:n]]), cache, [sid], backend="torch")
        got[b].extend(logits[0])
    for t in range(30):
        toks = torch.tensor([[seqs[0][prompts[0] + t]], [seqs[1][prompts[1] + t]]])
        logits = model(toks, cache, ids, sparse=True, backend="torch", last_only=True)
        for b in range(2):
            got[b].append(logits[b])
    for b, seq in enumerate(seqs):
        n = prompts[b] + 30
        want = plain_forward(model, seq[:n])
        torch.testing.assert_close(torch.stack(got[b]).double(), want, atol=2e-4, rtol=1e-4)


def test_a_sliding_only_model_ignores_the_page_budget():
    """Every layer slides: sparse decode with a tiny budget and any policy generates exactly the dense tokens."""
    cfg = hybrid_config(layer_types=("sliding_attention",) * 4, nope_layers=())
    m = random_model(cfg, seed=3)
    prompt = torch.randint(0, 61, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    dense = LlamaRuntime(m, page_size=4, backend="torch").generate([prompt], max_new_tokens=25, eos_id=None)
    for policy in ("quest", "h2o"):
        sparse = LlamaRuntime(m, page_size=4, page_budget=2, policy=policy, backend="torch").generate(
            [prompt], max_new_tokens=25, eos_id=None)
        assert sparse.tokens == dense.tokens
        assert sparse.stats.pages_read == sparse.stats.pages_dense        # a window is read whole


def test_sparse_decode_of_a_hybrid_runs_and_counts_windows(model):
    """Budget 2 pages: the full layers select (they read fewer pages than dense), the sliding layers read their
    window; the output is a valid continuation."""
    prompt = torch.randint(0, 61, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    rt = LlamaRuntime(model, page_size=4, page_budget=2, backend="torch")
    out = rt.generate([prompt], max_new_tokens=12, eos_id=None)
    assert len(out.tokens[0]) == 12 and all(0 <= t < 61 for t in out.tokens[0])
    s = out.stats
    # per step, per KV head: sliding layers <= 3 pages (a window of 7 over pages of 4), full layers 2 pages
    assert s.pages_read <= s.decode_steps * 2 * (2 * 3 + 2 * 2)
    assert s.pages_read < s.pages_dense


def test_engine_greedy_equals_the_runtime(model):
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 61, (n,), generator=g).tolist() for n in (5, 17, 30)]
    for budget in (None, 2):
        rt = LlamaRuntime(model, page_size=4, page_budget=budget, backend="torch")
        expected = [rt.generate([p], max_new_tokens=15, eos_id=None).tokens[0] for p in prompts]
        engine = Engine(model, page_size=4, num_pages=64, page_budget=budget, backend="torch")
        assert engine.generate(prompts, SamplingParams(15, ignore_eos=True)) == expected


def test_chunked_training_forward_equals_the_plain_forward(model):
    """The differentiable chunked forward (all pages held) in chunks of 8 equals the plain forward."""
    tokens = torch.randint(0, 61, (1, 25), generator=torch.Generator().manual_seed(7))
    cfg = model.config
    memory = ChunkedKVMemory(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, batch=1, seq_len=25, chunk_size=8,
                             page_size=4, capacity=None, policy=FullRetention(),
                             dtype=torch.float32, device=tokens.device)
    logits = []
    for start in range(0, 25, 8):
        n = min(8, 25 - start)
        memory.begin_chunk(n)
        logits.append(chunk_forward(model, tokens[:, start:start + n], memory, backend="torch")[0])
        memory.commit()
    torch.testing.assert_close(torch.cat(logits).double(), plain_forward(model, tokens[0].tolist()),
                               atol=2e-4, rtol=1e-4)


def test_triton_backend_prefill_and_decode_equal_the_plain_forward(model):
    """The same hybrid on the Triton kernels (interpreted on the CPU): a prefill past the window, then decode."""
    seq = torch.randint(0, 61, (14,), generator=torch.Generator().manual_seed(8)).tolist()
    cache = model.new_cache(page_size=4, num_pages=8)
    sid = cache.add_sequence()
    got = list(model(torch.tensor([seq[:10]]), cache, [sid], backend="triton")[0])
    for t in seq[10:]:
        got.append(model(torch.tensor([[t]]), cache, [sid], sparse=True, backend="triton", last_only=True)[0])
    torch.testing.assert_close(torch.stack(got).double(), plain_forward(model, seq), atol=2e-4, rtol=1e-4)


def test_long_prefill_in_query_blocks_equals_the_plain_forward(model):
    """A 560-token prompt (the torch plan cuts sliding layers' queries into blocks) and two decode steps."""
    seq = torch.randint(0, 61, (562,), generator=torch.Generator().manual_seed(9)).tolist()
    cache = model.new_cache(page_size=4, num_pages=141)
    sid = cache.add_sequence()
    got = list(model(torch.tensor([seq[:560]]), cache, [sid], backend="torch")[0])
    for t in seq[560:]:
        got.append(model(torch.tensor([[t]]), cache, [sid], sparse=True, backend="torch", last_only=True)[0])
    torch.testing.assert_close(torch.stack(got).double(), plain_forward(model, seq), atol=5e-4, rtol=1e-4)
