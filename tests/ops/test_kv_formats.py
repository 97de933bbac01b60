"""KV formats (``kv_cache_dtype``) through every op: int8 / fp8 e4m3 pools with per-(page, KV head) scales,
fp16 / bf16 pools.

The quantized ops are checked against dequantize-then-reference on ragged, poisoned problems (hypothesis),
the cache's scale upkeep against its worst case (a page whose first token is tiny and a later one huge), and
the boxes against the dequantized keys (the Quest bound must hold for what attention reads).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyattn
from tinyattn.cache import PagedKVCache
from tinyattn.models import LlamaRuntime
from tinyattn.ops import quant
from tinyattn import reference

from model_fixtures import model, tok  # noqa: F401  (module-scoped fixtures)
from paged_problems import QUANTIZED, dequantize, dequantized_args, make_problem, problems, quantize_problem


FORMATS = QUANTIZED                       # int8 / fp8 e4m3 pools, quantized and dequantized without tinyattn
TOL = dict(atol=3e-5, rtol=3e-5)


@settings(max_examples=30, deadline=None)
@given(problems(dtypes=("fp32", "bf16"), max_query_tokens=3), st.sampled_from(sorted(FORMATS)))
def test_dense_quantized_matches_dequantize_then_reference(p, fmt):
    kq, vq, ks, vs = quantize_problem(p, fmt)
    args = (p.q, kq, vq, p.block_table, p.seq_lens)
    out, lse = tinyattn.paged_attention(*args, k_scale=ks, v_scale=vs, return_lse=True, backend="torch")
    ref, ref_lse = reference.paged_attention(*args, k_scale=ks, v_scale=vs, return_lse=True)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    tol = TOL if p.q.dtype == torch.float32 else dict(atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    if p.q.dtype == torch.float32:       # the reference's twin is exactly dequantize-then-reference
        want = reference.paged_attention(*dequantized_args(p, kq, vq, ks, vs))
        torch.testing.assert_close(ref, want, atol=1e-6, rtol=1e-6)
        fast = tinyattn.paged_attention(*args, k_scale=ks, v_scale=vs, backend="torch")   # the no-lse hot path
        torch.testing.assert_close(fast, ref, **TOL)


@settings(max_examples=30, deadline=None)
@given(problems(max_query_tokens=2), st.sampled_from(sorted(FORMATS)), st.integers(1, 4))
def test_sparse_quantized_matches_dequantize_then_reference(p, fmt, budget):
    kq, vq, ks, vs = quantize_problem(p, fmt)
    fargs = dequantized_args(p, kq, vq, ks, vs)
    k_min = torch.zeros(kq.shape[0], kq.shape[2], kq.shape[3])
    k_max = torch.zeros_like(k_min)
    reference.update_page_metadata(fargs[1], p.block_table, p.seq_lens, k_min, k_max)   # boxes of what is read
    Tq = p.q.shape[1]
    needed = max([-(-int(n) // p.page_size) - max(int(n) - Tq, 0) // p.page_size for n in p.seq_lens] + [1])
    budget = max(budget, needed)
    args = (p.q, kq, vq, p.block_table, p.seq_lens)
    kw = dict(k_min=k_min, k_max=k_max, page_budget=budget)
    out = tinyattn.sparse_paged_attention(*args, **kw, k_scale=ks, v_scale=vs, backend="torch")
    out2, lse = tinyattn.sparse_paged_attention(*args, **kw, k_scale=ks, v_scale=vs, backend="torch",
                                                return_lse=True)
    ref, ref_lse = reference.sparse_paged_attention(*args, **kw, k_scale=ks, v_scale=vs, return_lse=True)
    want = reference.sparse_paged_attention(*fargs, **kw)
    for got in (out, out2, ref):
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    pages = reference.select_pages(reference.page_scores(p.q, k_min, k_max, p.block_table, p.seq_lens,
                                                         page_size=p.page_size),
                                   p.seq_lens, page_size=p.page_size, page_budget=budget, num_query_tokens=Tq)
    listed = tinyattn.sparse_paged_attention(*args, page_indices=pages, k_scale=ks, v_scale=vs, backend="torch")
    torch.testing.assert_close(listed, want, **TOL)


def test_quantized_gradient_reaches_q():
    p = make_problem(3, batch=2, seq_lens=[7, 12], page_size=4, num_kv_heads=2, group=2, head_dim=8,
                     dtype=torch.float64)
    kq, vq, ks, vs = quantize_problem(p, "int8", poison_scales=False)
    fargs = dequantized_args(p, kq, vq, ks, vs)
    q = p.q.clone().requires_grad_(True)
    out = tinyattn.paged_attention(q, kq, vq, p.block_table, p.seq_lens, k_scale=ks, v_scale=vs, backend="torch")
    (dq,) = torch.autograd.grad(out.square().sum(), q)
    q2 = p.q.clone().requires_grad_(True)
    want = reference.paged_attention(q2, *fargs[1:])
    (dq2,) = torch.autograd.grad(want.square().sum(), q2)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(dq, dq2)


# ------------------------------------------------------------------------------------------ validation
def _small(fmt="int8"):
    c = PagedKVCache(1, 2, 8, page_size=4, num_pages=6, kv_cache_dtype=fmt)
    s = c.add_sequence()
    c.write(0, c.extend([s], 6), torch.randn(6, 2, 8), torch.randn(6, 2, 8))
    q = torch.randn(1, 4, 8)
    return c, (q, c.k_cache[0], c.v_cache[0], c.block_table([s]), c.seq_lens([s]))


@pytest.mark.parametrize("op", ["dense", "sparse", "reference"])
def test_quantized_pool_errors_name_the_argument(op):
    c, args = _small()
    run = {"dense": lambda *a, **k: tinyattn.paged_attention(*a, backend="torch", **k),
           "sparse": lambda *a, **k: tinyattn.sparse_paged_attention(*a, backend="torch", k_min=c.k_min[0],
                                                                    k_max=c.k_max[0], page_budget=1, **k),
           "reference": reference.paged_attention}[op]
    with pytest.raises(ValueError, match=r"k_scale: expected a float32 \[num_pages, Hkv\] = \(6, 2\).*got None"):
        run(*args)
    with pytest.raises(ValueError, match=r"v_scale: .*got None"):
        run(*args, k_scale=c.k_scale[0])
    with pytest.raises(ValueError, match=r"k_scale: expected shape \(6, 2\) \[num_pages, Hkv\], got \(6,\)"):
        run(*args, k_scale=c.k_scale[0][:, 0], v_scale=c.v_scale[0])
    with pytest.raises(TypeError, match=r"v_scale: expected dtype in \(float32\), got float16"):
        run(*args, k_scale=c.k_scale[0], v_scale=c.v_scale[0].half())
    q, k, v, bt, sl = args
    with pytest.raises(TypeError, match=r"v_cache: expected dtype int8 \(that of k_cache\), got float8_e4m3fn"):
        run(q, k, v.view(torch.float8_e4m3fn), bt, sl, k_scale=c.k_scale[0], v_scale=c.v_scale[0])
    with pytest.raises(TypeError, match=r"k_cache: expected dtype float32 \(that of q\), or int8 / float8_e4m3fn"):
        run(q, k.to(torch.int16), v, bt, sl, k_scale=c.k_scale[0], v_scale=c.v_scale[0])
    with pytest.raises(ValueError, match=r"k_scale: expected None for a float32 pool"):
        run(q, k.float(), v.float(), bt, sl, k_scale=c.k_scale[0], v_scale=c.v_scale[0])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("qdtype", [torch.float32, pytest.param(torch.float16, marks=pytest.mark.slow),
                                    pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_triton_kernel_dequantizes_in_registers(fmt, qdtype):
    """The Triton attention kernel (interpreter) on int8 / fp8 pools: dense, sparse and split-K against the
    reference's dequantize-then-attend."""
    torch.manual_seed(2)
    c = PagedKVCache(1, 2, 16, page_size=4, num_pages=16, kv_cache_dtype=fmt)
    ids = [c.add_sequence() for _ in range(3)]
    for i, n in zip(ids, [0, 9, 23]):
        c.write(0, c.extend([i], n), torch.randn(n, 2, 16), torch.randn(n, 2, 16))
    q = torch.randn(3, 4, 16).to(qdtype)
    args = (q, c.k_cache[0], c.v_cache[0], c.block_table(ids), c.seq_lens(ids))
    kw = dict(k_scale=c.k_scale[0], v_scale=c.v_scale[0])
    tol = {torch.float32: TOL, torch.float16: dict(atol=2e-3, rtol=2e-3),
           torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}[qdtype]
    out, lse = tinyattn.paged_attention(*args, **kw, backend="triton", return_lse=True)
    ref, ref_lse = reference.paged_attention(*args, **kw, return_lse=True)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    sparse = dict(k_min=c.k_min[0], k_max=c.k_max[0], page_budget=2)
    out = tinyattn.sparse_paged_attention(*args, **kw, **sparse, backend="triton")
    ref = reference.sparse_paged_attention(*args, **kw, **sparse)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    from tinyattn.ops.attention import triton_impl as kernel

    q4 = q.unsqueeze(1)
    o, l = torch.empty_like(q4), torch.empty(3, 1, 4)
    kernel.paged_attention(q4, *args[1:], page_indices=None, scale=16 ** -0.5, out=o, lse=l, num_splits=3, **kw)
    torch.testing.assert_close(o.squeeze(1).float(), reference.paged_attention(*args, **kw).float(), **tol)


def test_fp8_on_an_older_gpu_is_a_value_error_naming_the_formats(monkeypatch):
    from types import SimpleNamespace

    from tinyattn.ops import validation

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    cuda = torch.device("cuda", 0)
    assert validation.kv_formats_supported("triton", cuda) == ("auto", "fp16", "bf16", "int8")
    assert "fp8_e4m3" in validation.kv_formats_supported("torch", cuda)
    validation.check_kv_backend(SimpleNamespace(dtype=torch.int8, device=cuda), "triton")
    with pytest.raises(ValueError, match=r"kv_cache_dtype: the triton backend on cuda:0 supports \('auto', 'fp16', "
                                         r"'bf16', 'int8'\), got 'fp8_e4m3'"):
        validation.check_kv_backend(SimpleNamespace(dtype=torch.float8_e4m3fn, device=cuda), "triton")


def test_plan_run_checks_the_format():
    c, (q, k, v, bt, sl) = _small()
    plan = tinyattn.PagedAttentionPlan(backend="torch").plan(bt, sl, num_q_heads=4, num_kv_heads=2, head_dim=8,
                                                             page_size=4)
    with pytest.raises(ValueError, match="k_scale: expected a float32"):
        plan.run(q, k, v)
    got = plan.run(q, k, v, k_scale=c.k_scale[0], v_scale=c.v_scale[0])
    want = reference.paged_attention(q, k, v, bt, sl, k_scale=c.k_scale[0], v_scale=c.v_scale[0])
    torch.testing.assert_close(got, want, **TOL)


def test_the_call_memo_tells_scales_apart():
    """The public ops remember the last validated call: a call without scales after one with them must fail."""
    c, args = _small()
    tinyattn.paged_attention(*args, k_scale=c.k_scale[0], v_scale=c.v_scale[0], backend="torch")
    with pytest.raises(ValueError, match="k_scale"):
        tinyattn.paged_attention(*args, backend="torch")
    with pytest.raises(ValueError, match="k_scale"):
        tinyattn.paged_attention(*args, k_scale=c.k_scale[0][:2], v_scale=c.v_scale[0], backend="torch")


# ------------------------------------------------------------------------------------------ the cache
def test_unknown_format_is_a_value_error_naming_the_set():
    with pytest.raises(ValueError, match=r"kv_cache_dtype: expected one of \('auto', 'fp16', 'bf16', 'int8', "
                                         r"'fp8_e4m3'\), got 'int4'"):
        PagedKVCache(1, 1, 8, page_size=4, num_pages=2, kv_cache_dtype="int4")


@pytest.mark.parametrize("fmt,dtype", [("auto", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16),
                                       ("int8", torch.int8), ("fp8_e4m3", torch.float8_e4m3fn)])
def test_formats_store_their_dtype_and_count_their_bytes(fmt, dtype):
    c = PagedKVCache(3, 2, 64, page_size=16, num_pages=10, kv_cache_dtype=fmt)
    assert c.dtype == dtype and c.k_cache[0].dtype == dtype and c.kv_cache_dtype == fmt
    quantized = fmt in FORMATS
    assert len(c.k_scale) == len(c.v_scale) == (3 if quantized else 0)
    if quantized:
        assert c.k_scale[0].shape == (10, 2) and c.k_scale[0].dtype == torch.float32
        assert c.k_min[0].dtype == torch.float32
    per_layer = 2 * 10 * 16 * 2 * 64 * dtype.itemsize + 2 * 10 * 2 * 64 * c.k_min[0].element_size() \
        + (2 * 10 * 2 * 4 if quantized else 0)
    assert c.kv_bytes == 3 * per_layer
    fp32 = PagedKVCache(3, 2, 64, page_size=16, num_pages=10).kv_bytes
    limit = {"auto": 1.0, "fp16": 0.55, "bf16": 0.55, "int8": 0.4, "fp8_e4m3": 0.4}[fmt]
    assert c.kv_bytes <= limit * fp32


def _dequantized_keys(c, seq, layer=0):
    n = c.length(seq)
    rows = [dequantize(c.k_cache[layer][p][None], c.k_scale[layer][p][None])[0] for p in c.pages(seq)]
    return torch.cat(rows)[:n]                                                          # [n, Hkv, D]


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(sorted(FORMATS)), st.lists(st.integers(1, 9), min_size=1, max_size=6),
       st.integers(0, 2**31 - 1))
def test_boxes_bound_every_dequantized_logit(fmt, chunks, seed):
    """Written in chunks of growing magnitude: boxes equal the dequantized keys' min/max, so the Quest bound is
    an upper bound of every q.k attention reads, and attention equals dequantize-then-reference."""
    g = torch.Generator().manual_seed(seed)
    page_size, Hkv, D = 4, 2, 8
    c = PagedKVCache(1, Hkv, D, page_size=page_size, num_pages=20, kv_cache_dtype=fmt)
    seq = c.add_sequence()
    for i, n in enumerate(chunks):
        scale = float(10 ** (i % 4 - 2))
        c.write(0, c.extend([seq], n), torch.randn(n, Hkv, D, generator=g) * scale,
                torch.randn(n, Hkv, D, generator=g) * scale)
    keys = _dequantized_keys(c, seq)
    q = torch.randn(1, 2 * Hkv, D, generator=g)
    bt, sl = c.block_table([seq]), c.seq_lens([seq])
    ub = reference.page_scores(q, c.k_min[0], c.k_max[0], bt, sl, page_size=page_size)        # [1, Hkv, P]
    for j, p in enumerate(c.pages(seq)):
        page_keys = keys[j * page_size:(j + 1) * page_size]
        assert torch.equal(c.k_min[0][p], page_keys.amin(0)) and torch.equal(c.k_max[0][p], page_keys.amax(0))
        logits = torch.einsum("hgd,thd->hgt", q[0].view(Hkv, 2, D), page_keys)       # [Hkv, G, t]
        bound = ub[0, :, j]
        assert (logits.amax(dim=(1, 2)) <= bound + 1e-5 * bound.abs() + 1e-5).all()
    out = tinyattn.sparse_paged_attention(q, c.k_cache[0], c.v_cache[0], bt, sl, k_min=c.k_min[0],
                                          k_max=c.k_max[0], page_budget=2, k_scale=c.k_scale[0],
                                          v_scale=c.v_scale[0], backend="torch")
    ref = reference.sparse_paged_attention(q, c.k_cache[0], c.v_cache[0], bt, sl, k_min=c.k_min[0],
                                           k_max=c.k_max[0], page_budget=2, k_scale=c.k_scale[0],
                                           v_scale=c.v_scale[0])
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_page_operations_keep_scales(fmt):
    """fork, truncate, resize and a reused page keep the scales and exact boxes of a quantized cache."""
    torch.manual_seed(1)
    page_size = 4
    c = PagedKVCache(1, 1, 8, page_size=page_size, num_pages=8, kv_cache_dtype=fmt)
    a = c.add_sequence()
    c.write(0, c.extend([a], 10), torch.randn(10, 1, 8) * 5, torch.randn(10, 1, 8))
    b = c.fork(a, 6)                                   # ends inside page 1: its box refit from 2 keys
    assert torch.equal(_dequantized_keys(c, b)[:4], _dequantized_keys(c, a)[:4])
    # the cut page: its scale refit to the 2 kept keys (issue 28; int8 re-rounds them once, fp8 is exact), so
    # equal to a's within half a step of a's scale (tests/test_cache.py checks the exact values)
    half_step = c.k_scale[0][c.pages(a)[1]] * (0.5 if fmt == "int8" else 0.0)
    torch.testing.assert_close(_dequantized_keys(c, b)[4:], _dequantized_keys(c, a)[4:6], rtol=0,
                               atol=float(half_step.max()) * 1.0001)
    pb = c.pages(b)[1]
    keys = _dequantized_keys(c, b)[4:6]
    assert torch.equal(c.k_min[0][pb], keys.amin(0)) and torch.equal(c.k_max[0][pb], keys.amax(0))
    c.write(0, c.extend([b], 1), torch.full((1, 1, 8), 100.0), torch.ones(1, 1, 8))   # grows page pb's scale
    keys = _dequantized_keys(c, b)[4:7]
    assert torch.equal(c.k_max[0][pb], keys.amax(0)) and torch.equal(c.k_min[0][pb], keys.amin(0))
    c.truncate(a, 5)
    pa = c.pages(a)[1]
    keys = _dequantized_keys(c, a)[4:5]
    assert torch.equal(c.k_min[0][pa], keys.amin(0))
    before = _dequantized_keys(c, a), _dequantized_keys(c, b)
    c.resize(12)
    assert c.k_scale[0].shape == (12, 1)
    assert torch.equal(_dequantized_keys(c, a), before[0]) and torch.equal(_dequantized_keys(c, b), before[1])
    assert torch.equal(before[0][:4], before[1][:4])          # the fork's untouched page: the same codes
    c.free(a)
    d = c.add_sequence()                               # reuses freed pages: stale scales and codes must not leak
    c.write(0, c.extend([d], 3), torch.full((3, 1, 8), 1e-3), torch.full((3, 1, 8), 1e-3))
    torch.testing.assert_close(_dequantized_keys(c, d), torch.full((3, 1, 8), 1e-3), atol=1e-5, rtol=1e-2)
    assert torch.equal(c.k_max[0][c.pages(d)[0]], _dequantized_keys(c, d).amax(0))


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_half_formats_of_an_fp32_model(fmt):
    c = PagedKVCache(1, 2, 8, page_size=4, num_pages=4, dtype=torch.float32, kv_cache_dtype=fmt)
    s = c.add_sequence()
    k = torch.randn(5, 2, 8)
    c.write(0, c.extend([s], 5), k, k)
    assert c.k_cache[0].dtype == quant.storage_dtype(fmt, torch.float32) and c.k_min[0].dtype == c.dtype
    assert torch.equal(c.k_max[0][c.pages(s)[0]], k[:4].to(c.dtype).amax(0))


# ------------------------------------------------------------------------------------------ runtime and CLI


def _teacher_forced_logits(rt, tokens):
    cache = rt.new_cache([len(tokens)])
    sid = cache.add_sequence()
    rt.prefill(cache, sid, tokens[:20])
    return torch.stack([rt.decode(cache, [sid], [t])[0] for t in tokens[20:]]), cache


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp16", "bf16", "int8", "fp8_e4m3"])
def test_runtime_formats_track_the_fp32_cache(model, tok, fmt):  # noqa: F811
    """Teacher-forced decode: each format's next-token distribution stays near the fp32 cache's (dense decode:
    the quantization error alone; quest with 2 pages of 4 tokens: also the selections it flips)."""
    tokens = tok.encode("Once upon a time, there was a little girl named Lily. She loved to play outside in the "
                        "park with her friends. One day, she saw a big red ball under a tree.", bos=True)
    for budget, limit, agree in ((None, {"fp16": 1e-5, "bf16": 2e-4, "int8": 5e-3, "fp8_e4m3": 2e-2}, 0.95),
                                 (2, {"fp16": 1e-5, "bf16": 2e-2, "int8": 5e-2, "fp8_e4m3": 0.3}, 0.7)):
        # gamma=1.0: the limits were set with Quest's bound. With the recipe's default box estimate (0.25) fp16's
        # rounding changes a selection of this text at budget 2 (KL 8e-7 -> 1e-3; bf16 / int8 / fp8 come out lower)
        base, _ = _teacher_forced_logits(LlamaRuntime(model, page_size=4, page_budget=budget, backend="torch",
                                                      gamma=1.0), tokens)
        rt = LlamaRuntime(model, page_size=4, page_budget=budget, backend="torch", kv_cache_dtype=fmt, gamma=1.0)
        got, cache = _teacher_forced_logits(rt, tokens)
        assert cache.kv_cache_dtype == fmt and cache.k_cache[0].dtype == quant.storage_dtype(fmt, model.dtype)
        assert torch.isfinite(got).all()
        lp, lq = base.log_softmax(-1), got.log_softmax(-1)
        kl = (lp.exp() * (lp - lq)).sum(-1).mean()                             # KL(fp32 cache || format)
        assert kl < limit[fmt], (budget, float(kl))
        assert (got.argmax(-1) == base.argmax(-1)).float().mean() >= agree
    assert "kv_cache_dtype='%s'" % fmt in repr(rt)


@pytest.mark.parametrize("policy", ["oracle", "h2o"])
def test_quantized_cache_with_other_policies_and_metrics(model, tok, policy):  # noqa: F811
    rt = LlamaRuntime(model, page_size=4, page_budget=2, backend="torch", policy=policy, selection_metrics=True,
                      kv_cache_dtype="int8")
    out = rt.generate([tok.encode("Once upon a time", bos=True)], max_new_tokens=16)
    assert len(out.tokens[0]) >= 1 and out.stats.selection is not None
    assert 0.0 <= out.stats.selection.hit_rate <= 1.0


def test_runtime_rejects_unknown_and_unsupported_formats(model):  # noqa: F811
    with pytest.raises(ValueError, match=r"kv_cache_dtype: expected one of \('auto', 'fp16', 'bf16', 'int8', "
                                         r"'fp8_e4m3'\), got 'fp8'"):
        LlamaRuntime(model, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of"):
        model.new_cache(page_size=4, num_pages=2, kv_cache_dtype="float16")
    cache = model.new_cache(page_size=4, num_pages=2, kv_cache_dtype="fp8_e4m3")
    assert cache.k_scale[0].shape == (2, model.config.n_kv_heads)


@pytest.mark.slow
def test_cli_kv_cache_dtype():
    from commands import assert_clean_error, model_args, run_cli

    proc = run_cli("generate", "--help")
    assert "--kv-cache-dtype {auto,fp16,bf16,int8,fp8_e4m3}" in proc.stdout and "per (page, KV head)" in proc.stdout
    assert "--kv-cache-dtype" in run_cli("eval", "--help").stdout
    proc = run_cli("generate", *model_args(), "--prompt", "Once upon a time", "--max-new-tokens", "12",
                   "--page-size", "4", "--page-budget", "2", "--kv-cache-dtype", "int8", "--backend", "torch")
    assert proc.returncode == 0, proc.stderr
    assert "kv_cache_dtype=int8" in proc.stdout
    assert_clean_error(run_cli("generate", "--kv-cache-dtype", "int4"), r"--kv-cache-dtype: invalid choice: 'int4'")


def test_published_kv_format_table_meets_the_issue():
    """docs/accuracy.md's KV-format rows (docs/accuracy/kv_formats/*.json): the must-show figures of issue 13."""
    import json
    from paths import REPO

    root = REPO / "docs" / "accuracy" / "kv_formats"
    rows = {f: json.loads((root / f"{f}.json").read_text()) for f in ("auto", "fp16", "bf16", "int8", "fp8_e4m3")}

    def nll(fmt, budget):
        return next(r["nll"] for r in rows[fmt]["rows"] if r["page_budget"] == budget)

    assert nll("int8", 8) <= 1.005 * nll("auto", 8)
    assert nll("fp8_e4m3", 8) <= 1.02 * nll("auto", 8)
    per_token = {f: r["meta"]["kv_bytes_per_token"] for f, r in rows.items()}
    assert per_token["int8"] <= 0.4 * per_token["auto"] and per_token["bf16"] <= 0.55 * per_token["auto"]
    for f, r in rows.items():
        assert r["meta"]["kv_cache_dtype"] == f and r["meta"]["page_sizes"] == [16]
    from paths import CKPT
    from tinyattn.models import LlamaModel

    m = LlamaModel.from_llama2c(CKPT)
    for f, b in per_token.items():          # the recorded bytes are what the cache counts today
        cache = m.new_cache(page_size=16, num_pages=2, kv_cache_dtype=f)
        assert cache.kv_bytes == 2 * 16 * b


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_update_page_metadata_of_quantized_pools(fmt, backend):
    """update_page_metadata(k_scale=) on every backend: the boxes the cache keeps (those of the dequantized
    keys), exactly; a quantized pool without scales is a ValueError."""
    torch.manual_seed(4)
    c = PagedKVCache(1, 2, 16, page_size=4, num_pages=12, kv_cache_dtype=fmt)
    ids = [c.add_sequence() for _ in range(3)]
    for i, n in zip(ids, [5, 0, 14]):
        c.write(0, c.extend([i], n), torch.randn(n, 2, 16) * 3, torch.randn(n, 2, 16))
    bt, sl = c.block_table(ids), c.seq_lens(ids)
    got = [torch.full_like(c.k_min[0], 7.0) for _ in range(2)]
    want = [t.clone() for t in got]
    tinyattn.update_page_metadata(c.k_cache[0], bt, sl, *got, k_scale=c.k_scale[0], backend=backend)
    reference.update_page_metadata(c.k_cache[0], bt, sl, *want, k_scale=c.k_scale[0])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    used = [p for i in ids for p in c.pages(i)]
    assert torch.equal(got[0][used], c.k_min[0][used]) and torch.equal(got[1][used], c.k_max[0][used])
    with pytest.raises(ValueError, match=r"k_scale: expected a float32 \[num_pages, Hkv\]"):
        tinyattn.update_page_metadata(c.k_cache[0], bt, sl, *got, backend=backend)


def test_torch_compile_fullgraph_with_a_quantized_pool():
    """Under torch.compile the ops dequantize the pool, then run the custom op: same result as the reference."""
    torch.manual_seed(5)
    c = PagedKVCache(1, 2, 8, page_size=4, num_pages=8, kv_cache_dtype="int8")
    s = c.add_sequence()
    c.write(0, c.extend([s], 11), torch.randn(11, 2, 8), torch.randn(11, 2, 8))
    bt, sl = c.block_table([s]), c.seq_lens([s])
    kw = dict(k_min=c.k_min[0], k_max=c.k_max[0], page_budget=2)

    def step(q, k, v, ks, vs):
        return tinyattn.sparse_paged_attention(q, k, v, bt, sl, k_scale=ks, v_scale=vs, backend="torch", **kw)

    q = torch.randn(1, 4, 8)
    args = (q, c.k_cache[0], c.v_cache[0], c.k_scale[0], c.v_scale[0])
    got = torch.compile(step, fullgraph=True, backend="eager")(*args)
    want = reference.sparse_paged_attention(q, c.k_cache[0], c.v_cache[0], bt, sl, k_scale=c.k_scale[0],
                                            v_scale=c.v_scale[0], **kw)
    torch.testing.assert_close(got, want, **TOL)
