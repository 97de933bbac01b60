"""GPU-only checks of the per-step plan (skipped without CUDA; run by ``bench/gpu.sh``).

``PagedAttentionPlan.run`` on the Triton backend must make no host sync (``torch.cuda.set_sync_debug_mode``
turns one into an error), allocate nothing with ``out=``, survive CUDA-graph capture and replay, and agree
with the torch backend. Written without a GPU in the session that added the plan: the first GPU session runs
it (``bash bench/gpu.sh``) before trusting the plan's GPU figures.
"""
import os

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="TRITON_INTERPRET=1: run with TRITON_INTERPRET=0 to test the compiled kernels"),
]


def _problem(B=2, L=(3000, 1777), S=16, hkv=8, group=4, D=128, dtype=torch.bfloat16):
    import tinyattn

    g = torch.Generator().manual_seed(0)
    P = max(-(-n // S) for n in L) + 2
    N = B * P + 64
    table = torch.randperm(N, generator=g)[: B * P].view(B, P).to(torch.int32).cuda()
    k = torch.randn(N, S, hkv, D, generator=g).to("cuda", dtype)
    v = torch.randn(N, S, hkv, D, generator=g).to("cuda", dtype)
    sl = torch.tensor(L, dtype=torch.int32, device="cuda")
    k_min = torch.empty(N, hkv, D, device="cuda", dtype=torch.float32)
    k_max = torch.empty_like(k_min)
    tinyattn.update_page_metadata(k, table, sl, k_min, k_max)
    q = torch.randn(B, hkv * group, D, generator=g).to("cuda", dtype)
    return q, k, v, table, sl, k_min, k_max


def _plan(q, k, table, sl):
    import tinyattn

    return tinyattn.PagedAttentionPlan(backend="triton").plan(
        table, sl, num_q_heads=q.shape[1], num_kv_heads=k.shape[2], head_dim=q.shape[2], page_size=k.shape[1],
        page_budget=64, trusted=True)


def test_run_makes_no_sync_and_matches_the_torch_backend():
    import tinyattn

    q, k, v, table, sl, k_min, k_max = _problem()
    plan = _plan(q, k, table, sl)
    out = torch.empty_like(q)
    plan.run(q, k, v, k_min=k_min, k_max=k_max, out=out)            # compile outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan.run(q, k, v, k_min=k_min, k_max=k_max, out=out)
        plan.run(q, k, v, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    sparse = plan.run(q, k, v, k_min=k_min, k_max=k_max).float()
    ref = tinyattn.sparse_paged_attention(q.float(), k.float(), v.float(), table, sl, k_min=k_min, k_max=k_max,
                                          page_budget=64, backend="torch")
    assert (sparse - ref).abs().max().item() < 3e-2


def test_run_replays_in_a_cuda_graph():
    import tinyattn

    q, k, v, table, sl, k_min, k_max = _problem()
    plan = _plan(q, k, table, sl)
    out = torch.empty_like(q)
    plan.run(q, k, v, k_min=k_min, k_max=k_max, out=out)            # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(q, k, v, k_min=k_min, k_max=k_max, out=out)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    eager = plan.run(q, k, v, k_min=k_min, k_max=k_max)
    assert torch.equal(out, eager)
