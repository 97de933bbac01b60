"""GPU-only checks of the compiled Triton kernels (skipped without CUDA; run by ``bench/gpu.sh``).

What the CPU tiers (interpreter, compile-only) cannot check: the numerics of the real bf16 / fp16
tensor-core paths and TF32 fp32 dots, long contexts with large shuffled pools (64-bit offsets on the
device), the split-K merge at 32K tokens, and the backward kernels on the device. (The kernels pick
block sizes by heuristics, not ``@triton.autotune``: there is no tuner to exercise.)

Run with ``TRITON_INTERPRET=0 python -m pytest -q tests/gpu`` (tests/conftest.py turns the interpreter
on by default, for the CPU suites). Tolerance (STYLE.md, flash-attention's rule): the kernel's error
against an fp32 reference is at most 2x that of the same attention computed by PyTorch in the input
dtype, plus a small floor.
"""
import os

import pytest
import torch
from paged_problems import make_problem

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="TRITON_INTERPRET=1: run with TRITON_INTERPRET=0 to test the compiled kernels"),
]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
FLOOR = {torch.float32: 2e-3, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}   # fp32 allows TF32 dots


def _problem(*, batch, lens, page_size, hkv, group, head_dim, dtype, tq=1, extra_pages=64, seed=0):
    """Random paged problem on the GPU (``paged_problems.make_problem``): shuffled pool larger than needed,
    NaN in unowned slots, garbage table entries past each row's end."""
    p = make_problem(seed, batch=batch, seq_lens=lens, page_size=page_size, num_kv_heads=hkv, group=group,
                     head_dim=head_dim, num_query_tokens=tq, dtype=dtype, extra_pages=extra_pages, spare_columns=2)
    q = p.q[:, 0] if tq == 1 else p.q
    return tuple(t.to("cuda") for t in (q, p.k_cache, p.v_cache, p.block_table, p.seq_lens))


def _bounds(k, table, lens):
    import tinyattn

    shape = (k.shape[0], k.shape[2], k.shape[3])
    k_min = torch.zeros(shape, dtype=torch.float32, device=k.device)
    k_max = torch.zeros(shape, dtype=torch.float32, device=k.device)
    tinyattn.update_page_metadata(k, table, lens, k_min, k_max, backend="torch")
    return k_min, k_max


def _check_close(got, want_fp32, same_dtype_torch, dtype):
    """flash-attention's rule: error <= 2x torch's own error in the input dtype, plus a floor."""
    assert torch.isfinite(got).all()
    err = (got.float() - want_fp32).abs().max().item()
    torch_err = (same_dtype_torch.float() - want_fp32).abs().max().item()
    assert err <= 2 * torch_err + FLOOR[dtype], f"max error {err:.3g} vs torch's {torch_err:.3g} in {dtype}"


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("head_dim,page_size,group", [(128, 16, 4), (64, 32, 8), (80, 16, 1)])
def test_dense_and_sparse_match_torch_backend(dtype, head_dim, page_size, group):
    import tinyattn

    dt = DTYPES[dtype]
    q, k, v, table, lens = _problem(batch=3, lens=[5000, 1, 2 * page_size * 37 + 3], page_size=page_size, hkv=2,
                                    group=group, head_dim=head_dim, dtype=dt)
    want = tinyattn.paged_attention(q.float(), k.float(), v.float(), table, lens, backend="torch")
    same = tinyattn.paged_attention(q, k, v, table, lens, backend="torch")
    got = tinyattn.paged_attention(q, k, v, table, lens, backend="triton")
    _check_close(got, want, same, dt)

    k_min, k_max = _bounds(k, table, lens)
    opts = dict(k_min=k_min, k_max=k_max, page_budget=8, num_sink_pages=1, num_recent_pages=2)
    sel = tinyattn.select_pages(tinyattn.page_scores(q.float(), k_min, k_max, table, lens, page_size=page_size,
                                                     backend="torch"),
                                lens, page_size=page_size, page_budget=8, num_sink_pages=1, num_recent_pages=2,
                                backend="torch")
    want = tinyattn.sparse_paged_attention(q.float(), k.float(), v.float(), table, lens, page_indices=sel,
                                           backend="torch")
    same = tinyattn.sparse_paged_attention(q, k, v, table, lens, page_indices=sel, backend="torch")
    got = tinyattn.sparse_paged_attention(q, k, v, table, lens, page_indices=sel, backend="triton")
    _check_close(got, want, same, dt)
    fused = tinyattn.sparse_paged_attention(q, k, v, table, lens, backend="triton", **opts)
    assert torch.isfinite(fused).all()


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_scores_and_selection_match_torch_backend(dtype):
    import tinyattn

    dt = DTYPES[dtype]
    q, k, v, table, lens = _problem(batch=2, lens=[32768, 3001], page_size=16, hkv=8, group=4, head_dim=128,
                                    dtype=dt)
    k_min, k_max = _bounds(k, table, lens)
    got = tinyattn.page_scores(q, k_min, k_max, table, lens, page_size=16, backend="triton")
    want = tinyattn.page_scores(q, k_min, k_max, table, lens, page_size=16, backend="torch")
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    torch.testing.assert_close(got[finite], want[finite], atol=5e-2, rtol=2e-2)   # TF32 / half dots
    opts = dict(page_size=16, page_budget=128, num_sink_pages=2, num_recent_pages=3)
    assert torch.equal(tinyattn.select_pages(want, lens, **opts, backend="triton"),
                       tinyattn.select_pages(want, lens, **opts, backend="torch"))


@pytest.mark.parametrize("lens,budget,sinks", [([32768], 128, 2), ([131072], 128, 0), ([32768, 3001], 8, 1)])
def test_two_stage_selection_matches_one_stage(lens, budget, sinks):
    """The two-stage selection (kernels/chunk_topk.py) with the GPU's own chunk sizes, against page_scores +
    select_pages: the same pages, except (if the compiler summed some bound in another order) pages whose
    one-stage bound is within float rounding of the last kept bound."""
    import tinyattn
    from tinyattn.kernels import chunk_topk as C
    from tinyattn.ops.selection import triton_impl as K

    q, k, v, table, lens_t = _problem(batch=len(lens), lens=lens, page_size=16, hkv=8, group=4, head_dim=128,
                                      dtype=torch.bfloat16, extra_pages=8)
    k_min, k_max = _bounds(k, table, lens_t)
    k_min, k_max = k_min.to(torch.bfloat16), k_max.to(torch.bfloat16)
    q4 = q[:, None]
    B, Hkv, maxp = len(lens), 8, table.shape[1]
    opts = dict(page_size=16, page_budget=budget, num_sink_pages=sinks, num_recent_pages=1)
    scores = torch.empty(B, Hkv, maxp, device="cuda")
    K.page_scores(q4, k_min, k_max, table, lens_t, page_size=16, out=scores)
    one = torch.empty(B, Hkv, budget, dtype=torch.int32, device="cuda")
    K.select_pages(scores, lens_t, **opts, num_query_tokens=1, out=one)
    meta = C.chunk_blocks(B, Hkv, maxp, budget, 1, 4, 128, 16, num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    ws = [torch.empty(C.workspace_shape(B, Hkv, meta), dtype=torch.int32, device="cuda") for _ in range(2)]
    two = torch.empty_like(one)
    K.score_and_select_pages(q4, k_min, k_max, table, lens_t, **opts, meta=meta, ws_key=ws[0], ws_page=ws[1], out=two)
    torch.cuda.synchronize()
    if not torch.equal(one, two):
        for b in range(B):
            for h in range(Hkv):
                a, c = set(one[b, h].tolist()), set(two[b, h].tolist())
                if a == c:
                    continue
                s = scores[b, h]
                forced = set(range(sinks)) | {-(-lens[b] // 16) - 1, -1}
                last = min(s[j].item() for j in a - forced)             # the lowest bound kept by score
                for j in a ^ c:
                    assert abs(s[j].item() - last) <= 1e-5 * (1 + abs(last)), (b, h, j, s[j].item(), last)
    # the plan's sparse step at batch 1 takes the two-stage path
    plan = tinyattn.PagedAttentionPlan(backend="triton").plan(table, lens_t, num_q_heads=32, num_kv_heads=8,
                                                              head_dim=128, page_size=16, page_budget=budget)
    assert plan._impl._chunks is not None


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_long_context_split_k_and_big_pool(dtype):
    """32K tokens (the split-K merge) in a pool of > 2**31 K elements: 64-bit offsets on the device."""
    import tinyattn

    dt = DTYPES[dtype]
    free = torch.cuda.mem_get_info()[0]
    page_size, hkv, d = 16, 8, 128
    pool_pages = (2**31 // (page_size * hkv * d)) + 4096
    need = 2 * pool_pages * page_size * hkv * d * torch.empty((), dtype=dt).element_size()
    if need > 0.6 * free:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of GPU memory")
    L = 32768
    n = L // page_size
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.empty(pool_pages, page_size, hkv, d, dtype=dt, device="cuda")
    v = torch.empty_like(k)
    ids = torch.arange(pool_pages - n, pool_pages, device="cuda")               # the last pages of the pool
    k[ids] = torch.randn(n, page_size, hkv, d, generator=g, device="cuda").to(dt)
    v[ids] = torch.randn(n, page_size, hkv, d, generator=g, device="cuda").to(dt)
    table = ids.flip(0).to(torch.int32)[None]
    lens = torch.tensor([L], dtype=torch.int32, device="cuda")
    q = torch.randn(1, hkv * 4, d, generator=g, device="cuda").to(dt)
    k_small, v_small = k[ids.flip(0)], v[ids.flip(0)]
    table_small = torch.arange(n, dtype=torch.int32, device="cuda")[None]
    want = tinyattn.paged_attention(q.float(), k_small.float(), v_small.float(), table_small, lens, backend="torch")
    same = tinyattn.paged_attention(q, k_small, v_small, table_small, lens, backend="torch")
    got = tinyattn.paged_attention(q, k, v, table, lens, backend="triton")
    _check_close(got, want, same, dt)


def test_backward_matches_torch_backend():
    import tinyattn

    dt = torch.bfloat16
    q, k, v, table, lens = _problem(batch=2, lens=[700, 129], page_size=16, hkv=2, group=4, head_dim=128, dtype=dt)
    k = torch.nan_to_num(k)                                   # finite padding: gradients of padding are zero
    v = torch.nan_to_num(v)
    grads = {}
    for backend in ("torch", "triton"):
        qq, kk, vv = (t.detach().float().requires_grad_() if backend == "torch" else t.detach().requires_grad_()
                      for t in (q, k, v))
        out = tinyattn.paged_attention(qq, kk, vv, table, lens, backend=backend)
        out.float().square().sum().backward()
        grads[backend] = [t.grad.float() for t in (qq, kk, vv)]
    for got, want in zip(grads["triton"], grads["torch"]):
        assert torch.isfinite(got).all()
        scale = want.abs().max().item() + 1e-6
        assert (got - want).abs().max().item() <= 3e-2 * scale



@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_quantized_kv_matches_torch_backend(fmt, dtype):
    """int8 / fp8 e4m3 pools: the Triton kernel dequantizes K/V tiles in registers; compared with the
    torch backend on the same codes and scales (dense, sparse with selection, split-K), and the metadata kernel's
    boxes with the torch backend's, exactly. fp8 needs sm_89+: below it the ops raise a ValueError."""
    import tinyattn
    from tinyattn.cache import PagedKVCache

    if fmt == "fp8_e4m3" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 e4m3 needs sm_89+")
    torch.manual_seed(0)
    lens = [1, 300, 4097, 1500]
    c = PagedKVCache(1, 4, 128, page_size=16, num_pages=sum(-(-n // 16) for n in lens) + 64, dtype=DTYPES[dtype],
                     device="cuda", kv_cache_dtype=fmt)
    ids = [c.add_sequence() for _ in lens]
    for i, n in zip(ids, lens):
        c.write(0, c.extend([i], n), torch.randn(n, 4, 128, device="cuda", dtype=DTYPES[dtype]),
                torch.randn(n, 4, 128, device="cuda", dtype=DTYPES[dtype]))
    q = torch.randn(len(lens), 16, 128, device="cuda", dtype=DTYPES[dtype])
    args = (q, c.k_cache[0], c.v_cache[0], c.block_table(ids), c.seq_lens(ids))
    kw = dict(k_scale=c.k_scale[0], v_scale=c.v_scale[0])
    for extra in ({}, dict(k_min=c.k_min[0], k_max=c.k_max[0], page_budget=8)):
        op = tinyattn.sparse_paged_attention if extra else tinyattn.paged_attention
        got = op(*args, **kw, **extra, backend="triton")
        want = op(*args, **kw, **extra, backend="torch")
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), want.float(), atol=FLOOR[DTYPES[dtype]], rtol=FLOOR[DTYPES[dtype]])
    boxes = [torch.empty_like(c.k_min[0]) for _ in range(2)]
    tinyattn.update_page_metadata(c.k_cache[0], args[3], args[4], *boxes, k_scale=c.k_scale[0], backend="triton")
    used = [p for i in ids for p in c.pages(i)]
    assert torch.equal(boxes[0][used], c.k_min[0][used]) and torch.equal(boxes[1][used], c.k_max[0][used])


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("window_left,tq", [(0, 1), (15, 1), (511, 1), (4095, 1), (100, 300)])
def test_sliding_window_matches_torch_backend(dtype, window_left, tq):
    """window_left on the compiled kernels: long rows (the dense walk starts at the window's page, split-K over
    the window), prefill with several query blocks, forward and backward."""
    import tinyattn

    dt = DTYPES[dtype]
    q, k, v, table, lens = _problem(batch=3, lens=[9000, 40, 3001], page_size=16, hkv=2, group=4, head_dim=128,
                                    dtype=dt, tq=tq)
    want = tinyattn.paged_attention(q.float(), k.float(), v.float(), table, lens, window_left=window_left,
                                    backend="torch")
    same = tinyattn.paged_attention(q, k, v, table, lens, window_left=window_left, backend="torch")
    got = tinyattn.paged_attention(q, k, v, table, lens, window_left=window_left, backend="triton")
    _check_close(got, want, same, dt)
    if dtype != "fp32":
        return
    k, v = torch.nan_to_num(k), torch.nan_to_num(v)           # finite padding: gradients of padding are zero
    grads = []
    for backend in ("torch", "triton"):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out = tinyattn.paged_attention(*leaves, table, lens, window_left=window_left, backend=backend)
        out.float().square().sum().backward()
        grads.append([x.grad for x in leaves])
    for want, got in zip(*grads):
        assert torch.isfinite(got).all()
        # TF32 dots; the floor: with window_left=0 a query sees only its own key and dq / dk are exactly 0 in fp32
        assert (got - want).abs().max().item() <= 3e-2 * want.abs().max().item() + 1e-4
