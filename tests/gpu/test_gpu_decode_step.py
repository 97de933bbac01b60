"""GPU-only checks of the decode step as serving engines run it (skipped without CUDA, run by
``bench/gpu.sh``). Written without a GPU: the first GPU session runs them before trusting any GPU figure.

1. The fused KV write (``tinyattn.kernels.kv_write``) on CUDA equals its torch twin bit for bit, every KV format,
   over prefill and decode writes (the interpreter proves the same against the loop reference on a CPU).
2. A whole decode step (the fused write + ``PagedAttentionPlan.run``) captured once as a CUDA graph and replayed
   over 50 steps with changing tables equals eager, with ``torch.cuda.set_sync_debug_mode("error")`` around
   ``run`` and the write.

Test 2 assumes the graph mode of the plan, exactly:
``plan(block_table, seq_lens, ..., max_batch=B, max_pages_per_seq=P)`` allocates every buffer once at that
capacity, and a later ``plan()`` of a batch ``<= B`` and a table ``<= P`` wide only copies the step's values into
the same buffers; ``run(q, ..., out=out)`` then allocates nothing and makes no host sync. It is skipped (with that
reason) while ``plan()`` has no ``max_batch`` argument.
"""
import inspect
import os

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="TRITON_INTERPRET=1: run with TRITON_INTERPRET=0 to test the compiled kernels"),
]

FORMATS = ("auto", "fp16", "bf16", "int8", "fp8_e4m3")


def _same(a, b) -> bool:
    if not a.is_floating_point():
        return torch.equal(a, b)
    a, b = a.double(), b.double()
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("box_dtype", ["auto", "bf16"])
def test_fused_write_equals_the_torch_twin_on_cuda(kv_cache_dtype, box_dtype):
    from tinyattn import PagedKVCache

    if kv_cache_dtype == "fp8_e4m3" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 e4m3 needs sm_89+")
    caches = [PagedKVCache(2, 8, 128, page_size=16, num_pages=256, dtype=torch.bfloat16, device="cuda",
                           kv_cache_dtype=kv_cache_dtype, box_dtype=box_dtype) for _ in range(2)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = [[c.add_sequence() for _ in range(5)] for c in caches]
    for step, count in enumerate([37, 1, 1, 16, 1, 1, 1]):                 # a ragged prefill, then decode
        kv = [torch.randn(5 * count, 8, 128, device="cuda", generator=gen, dtype=torch.bfloat16) * (1 + 3 * step)
              for _ in range(4)]
        for cache, seq_ids, backend in zip(caches, ids, ("torch", "triton")):
            slots = cache.extend(seq_ids, count)
            for layer in range(2):
                cache.write(layer, slots, kv[2 * layer], kv[2 * layer + 1], backend=backend)
    torch.cuda.synchronize()
    for name in ("k_cache", "v_cache", "k_min", "k_max", "k_scale", "v_scale"):
        for x, y in zip(getattr(caches[0], name), getattr(caches[1], name)):
            assert _same(x, y), name


def _graph_mode_available() -> bool:
    import tinyattn

    return "max_batch" in inspect.signature(tinyattn.PagedAttentionPlan.plan).parameters


def test_decode_step_replays_as_a_cuda_graph_over_50_steps_with_changing_tables():
    import tinyattn
    from tinyattn.ops import api as kv_write

    if not _graph_mode_available():
        pytest.skip("PagedAttentionPlan.plan() has no max_batch= / max_pages_per_seq= (graph mode not merged)")
    B, P, S, Hkv, G, D, budget = 4, 96, 16, 8, 4, 128, 32
    num_pages = B * P + 64
    dev, dtype = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(1)
    k_cache = torch.randn(num_pages, S, Hkv, D, device=dev, dtype=dtype, generator=gen)
    v_cache = torch.randn(num_pages, S, Hkv, D, device=dev, dtype=dtype, generator=gen)
    # empty boxes (+inf / -inf, as PagedKVCache's) for the pages no row uses: torch.empty left garbage there, NaN
    # at times on the GPU, and NaN != NaN failed the bitwise comparison of the pools below
    k_min = torch.full((num_pages, Hkv, D), float("inf"), device=dev, dtype=dtype)
    k_max = torch.full_like(k_min, float("-inf"))
    full_table = torch.randperm(num_pages, device=dev, generator=gen)[: B * P].view(B, P).to(torch.int32)
    tinyattn.update_page_metadata(k_cache, full_table, torch.full((B,), P * S, device=dev, dtype=torch.int32),
                                  k_min, k_max)
    # the captured step reads these static buffers; each step copies its values into them
    q = torch.empty(B, Hkv * G, D, device=dev, dtype=dtype)
    k_new = torch.empty(B, Hkv, D, device=dev, dtype=dtype)
    v_new = torch.empty_like(k_new)
    slots = torch.empty(B, device=dev, dtype=torch.int64)
    out = torch.empty_like(q)
    plan = tinyattn.PagedAttentionPlan(backend="triton")

    def step_tables(i):
        g = torch.Generator().manual_seed(100 + i)
        lens = torch.randint(budget * S // 2, P * S + 1, (B,), generator=g)      # some rows within the budget
        width = int(torch.randint(-(-int(lens.max()) // S), P + 1, (1,), generator=g))
        table = full_table[:, torch.randperm(P, generator=g)[:width].sort().values.to(dev)]
        return table.contiguous(), lens.to(dev, torch.int32)

    def plan_step(table, lens):
        plan.plan(table, lens, num_q_heads=Hkv * G, num_kv_heads=Hkv, head_dim=D, page_size=S, page_budget=budget,
                  max_batch=B, max_pages_per_seq=P, trusted=True)

    def fill_step(i, table, lens):
        g = torch.Generator(device=dev).manual_seed(200 + i)
        q.copy_(torch.randn(q.shape, device=dev, generator=g, dtype=dtype))
        k_new.copy_(torch.randn(k_new.shape, device=dev, generator=g, dtype=dtype))
        v_new.copy_(torch.randn(v_new.shape, device=dev, generator=g, dtype=dtype))
        last = (lens.long() - 1)
        slots.copy_(table.long().gather(1, (last // S)[:, None])[:, 0] * S + last % S)

    def decode_step():
        kv_write.write_kv(k_new, v_new, slots, k_cache, v_cache, k_min=k_min, k_max=k_max)
        plan.run(q, k_cache, v_cache, k_min=k_min, k_max=k_max, out=out)

    table, lens = step_tables(0)
    plan_step(table, lens)
    fill_step(0, table, lens)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                      # compile and warm up outside the capture
        for _ in range(2):
            decode_step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_step()
    pools = (k_cache, v_cache, k_min, k_max)
    for i in range(1, 51):
        table, lens = step_tables(i)
        plan_step(table, lens)
        fill_step(i, table, lens)
        before = [t.clone() for t in pools]
        graph.replay()
        replayed = [out.clone()] + [t.clone() for t in pools]
        for t, b in zip(pools, before):                # the same step again, eagerly, from the same state
            t.copy_(b)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            decode_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        for got, want in zip(replayed, [out] + list(pools)):
            assert torch.equal(got, want), f"step {i}: graph replay differs from eager"
    # and the step computes attention: the last one against the torch backend
    ref = tinyattn.sparse_paged_attention(q.float(), k_cache.float(), v_cache.float(), table, lens, k_min=k_min.float(),
                                          k_max=k_max.float(), page_budget=budget, backend="torch")
    assert (out.float() - ref).abs().max().item() < 3e-2
