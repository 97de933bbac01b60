"""GPU-only checks of issue 35's selection on the compiled kernels (skipped without CUDA; run by ``bench/gpu.sh``).

The CPU suites prove these rules against the fp64 reference under the Triton interpreter (tests/ops/test_rerank.py,
test_top_p.py, test_selection_estimate.py). What only a GPU shows: the compiled code at real sizes (32K tokens,
8 KV heads of 128, bf16 / fp32 pools with TF32 / half dots), the key-code writer's exact rounding after compilation
(IEEE ``div_rn``), and that the re-ranked top-p step makes no host sync and replays in a CUDA graph
(tests/gpu/test_gpu_graphs.py runs the whole model with it).

Run with ``TRITON_INTERPRET=0 python -m pytest -q tests/gpu``.
"""
import os

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="TRITON_INTERPRET=1: run with TRITON_INTERPRET=0 to test the compiled kernels"),
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HKV, GROUP, D, S = 8, 4, 128, 16
LENS = [32768, 3001, 17, 1]


def _cache(dtype, lens=LENS, seed=0):
    """A one-layer cache with key codes on the GPU, rows written in interleaved chunks (their pages interleave in the
    pool), keys with a few outlier channels per KV head (scaled 8x, as post-RoPE keys have): the writes go through
    the fused Triton KV write and the Triton code writer."""
    from tinyattn.cache import PagedKVCache

    g = torch.Generator(device="cuda").manual_seed(seed)
    cache = PagedKVCache(1, HKV, D, page_size=S, num_pages=sum(-(-n // S) for n in lens) + 16, dtype=dtype,
                         device="cuda", key_codes=True)
    ids = [cache.add_sequence() for _ in lens]
    gain = torch.ones(HKV, D, device="cuda")
    gain[:, :4] = 8.0
    left = list(lens)
    while any(left):
        for i, sid in enumerate(ids):
            n = min(left[i], 1000 + 37 * i)           # chunks that end mid-page
            if n:
                k = torch.randn(n, HKV, D, generator=g, device="cuda") * gain
                v = torch.randn(n, HKV, D, generator=g, device="cuda")
                cache.write(0, cache.extend([sid], n), k.to(dtype), v.to(dtype))
                left[i] -= n
    q = torch.randn(len(lens), HKV * GROUP, D, generator=g, device="cuda").to(dtype)
    return cache, ids, q


def _args(cache, ids):
    return cache.block_table(ids), cache.seq_lens(ids)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_code_writer_equals_the_torch_encoder_bit_for_bit(dtype):
    """Codes written by the cache's writes (Triton, many small launches) equal the torch form's over every full page."""
    import tinyattn

    cache, ids, _ = _cache(DTYPES[dtype])
    full = [p for sid, n in zip(ids, LENS) for p in cache.pages(sid)[: n // S]]
    pages = torch.tensor(full, device="cuda")
    slots = (pages[:, None] * S + torch.arange(S, device="cuda")).reshape(-1)
    want = torch.zeros_like(cache.k_code[0])
    tinyattn.encode_key_codes(cache.k_cache[0], slots, cache.k_min[0], cache.k_max[0], want, backend="torch")
    got = cache.k_code[0]
    differ = (got[pages] != want[pages])
    assert not differ.any(), f"{int(differ.sum())} of {differ.numel()} code bytes differ"
    assert int(got[pages].max()) > 0x10                                         # real codes, both nibbles


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_rerank_scores_match_the_torch_backend(dtype):
    """The candidates' log-mass at 32K (128 candidates per KV head, a row shorter than its candidate list, a one-token
    row): the same finite entries, values within the dots' precision, and the pages it ranks first the same except
    near ties."""
    import tinyattn

    cache, ids, q = _cache(DTYPES[dtype])
    table, lens = _args(cache, ids)
    k_min, k_max, code, k = cache.k_min[0], cache.k_max[0], cache.k_code[0], cache.k_cache[0]
    scores = tinyattn.page_scores(q, k_min, k_max, table, lens, page_size=S, gamma=0.25, backend="torch")
    cand = tinyattn.select_pages(scores, lens, page_size=S, page_budget=128, num_sink_pages=1, backend="torch")
    got = tinyattn.rerank_scores(q, code, k, k_min, k_max, cand, table, lens, backend="triton")
    want = tinyattn.rerank_scores(q, code, k, k_min, k_max, cand, table, lens, backend="torch")
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    tol = 0.05 if dtype == "fp32" else 0.15                          # TF32 / bf16 dots over logits of size ~10
    err = (got[finite] - want[finite]).abs().max().item()
    assert err <= tol, err
    top = dict(page_size=S, page_budget=32, num_sink_pages=1, backend="torch")
    a, b = tinyattn.select_pages(got, lens, **top), tinyattn.select_pages(want, lens, **top)
    for r, n in enumerate(LENS):
        forced = {0, -(-n // S) - 1, -1}                               # the sink, the last page, padding
        for h in range(HKV):
            diff = set(a[r, h].tolist()) ^ set(b[r, h].tolist())
            by_score = [j for j in b[r, h].tolist() if j not in forced]
            if not diff:
                continue
            cut = min(want[r, h, j].item() for j in by_score)           # the lowest log-mass kept by rank
            for j in diff:
                assert abs(want[r, h, j].item() - cut) <= 2 * tol, (r, h, j)


def _plan(table, lens, **kw):
    import tinyattn

    return tinyattn.PagedAttentionPlan(backend=kw.pop("backend")).plan(
        table, lens, num_q_heads=HKV * GROUP, num_kv_heads=HKV, head_dim=D, page_size=S, trusted=True, **kw)


SETTINGS = {
    "gamma": dict(page_budget=128, num_sink_pages=1, gamma=0.25),
    "top-p": dict(page_budget=128, num_sink_pages=1, gamma=0.25, top_p=0.8),
    "rerank": dict(page_budget=128, num_sink_pages=1, gamma=0.25, rerank="int4"),
    "rerank-top-p": dict(page_budget=128, num_sink_pages=1, gamma=0.25, rerank="int4", top_p=0.8),
    "rerank-c2-top-p": dict(page_budget=64, num_sink_pages=1, gamma=0.25, rerank="int4", candidates=2.0, top_p=0.9),
}


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_plan_attends_its_selection_and_selects_as_the_torch_plan(name, dtype):
    """The Triton plan's output is attention over the pages it reports (``last_selection``), to flash-attention's
    tolerance (2x torch's own error in the input dtype); its selection is the torch plan's on most (row, KV head)s,
    and elsewhere as many pages +- 2 (scores within the dots' precision can swap a page at the cut)."""
    import tinyattn

    dt = DTYPES[dtype]
    cache, ids, q = _cache(dt)
    table, lens = _args(cache, ids)
    kv = dict(k_min=cache.k_min[0], k_max=cache.k_max[0])
    if "rerank" in name:
        kv["k_code"] = cache.k_code[0]
    k, v = cache.k_cache[0], cache.v_cache[0]
    tri = _plan(table, lens, backend="triton", **SETTINGS[name])
    got = tri.run(q, k, v, **kv)
    sel = tri.last_selection.clone()
    ref = _plan(table, lens, backend="torch", **SETTINGS[name])
    ref.run(q, k, v, **kv)
    sel_ref = ref.last_selection
    want = tinyattn.sparse_paged_attention(q.float(), k.float(), v.float(), table, lens, page_indices=sel,
                                           backend="torch")
    same = tinyattn.sparse_paged_attention(q, k, v, table, lens, page_indices=sel, backend="torch")
    assert torch.isfinite(got).all()
    err = (got.float() - want).abs().max().item()
    torch_err = (same.float() - want).abs().max().item()
    assert err <= 2 * torch_err + (2e-3 if dtype == "fp32" else 1.6e-2), (err, torch_err)
    rows = [(r, h) for r in range(len(LENS)) for h in range(HKV)]
    agree = 0
    for r, h in rows:
        pages = -(-int(lens[r]) // S)              # a plan may list ids past a short row's end: attention skips them
        a = {j for j in sel[r, h].tolist() if 0 <= j < pages}
        b = {j for j in sel_ref[r, h].tolist() if 0 <= j < pages}
        agree += a == b
        assert abs(len(a) - len(b)) <= 2, (r, h, len(a), len(b))
        assert pages - 1 in a                                              # the row's last page, always
    assert agree >= 0.75 * len(rows), f"{agree} of {len(rows)} (row, KV head) selections agree"


def test_rerank_top_p_plan_makes_no_sync_and_replays_in_a_cuda_graph():
    """The graph-mode plan (``max_batch`` / ``max_pages_per_seq``) with rerank + top_p: no host sync after warm-up,
    and a captured run replays to the eager result, bit for bit, with a new query."""
    cache, ids, q = _cache(torch.bfloat16)
    table, lens = _args(cache, ids)
    kv = dict(k_min=cache.k_min[0], k_max=cache.k_max[0], k_code=cache.k_code[0])
    k, v = cache.k_cache[0], cache.v_cache[0]
    plan = _plan(table, lens, backend="triton", max_batch=len(LENS), max_pages_per_seq=table.shape[1],
                 **SETTINGS["rerank-top-p"])
    out = torch.empty_like(q)
    plan.run(q, k, v, **kv, out=out)                                     # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan.run(q, k, v, **kv, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        plan.run(q, k, v, **kv, out=out)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        plan.run(q, k, v, **kv, out=out)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    eager = plan.run(q, k, v, **kv)
    assert torch.equal(out, eager)
