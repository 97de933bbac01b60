"""The plan's contract with its tables (issue 25): ``plan()`` copies ``block_table`` / ``seq_lens``, so changing them
in place afterwards leaves every ``run()`` of the step computing the planned step, identically on the torch and
Triton backends; int64 page ids past int32 are ignored like any id past the row's end, on every path.

Expected values come from the reference loops (:mod:`tinyattn.reference`) on the tables as they were planned."""

import pytest
import torch

import tinyattn
from tinyattn import reference as R
from tinyattn.ops import plan as plan_module

from paged_problems import make_problem

BACKENDS = ["torch", "triton"]          # triton runs in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1)


def _problem(seed=0, lens=(37, 61)):
    p = make_problem(seed, batch=len(lens), seq_lens=list(lens), page_size=4, num_kv_heads=2, group=2, head_dim=16)
    k_min, k_max = p.bounds()
    return p, k_min, k_max


def _plan(p, backend, **kw):
    return tinyattn.PagedAttentionPlan(backend=backend).plan(
        p.block_table, p.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sparse", [False, True])
def test_tables_changed_after_plan_give_the_planned_step(backend, sparse):
    """A caller reuses its table buffers for the next step before the last run() of this one: the rows grow past
    the budget and point at other pages. Every run (first and later, selecting or dense) still computes the
    planned step; before issue 25 the budget was ignored for a grown row and the backends disagreed."""
    p, k_min, k_max = _problem()
    q = p.q[:, 0]
    planned_table, planned_lens = p.block_table.clone(), p.seq_lens.clone()
    budget = 6
    kw = dict(page_budget=budget) if sparse else {}
    run_kw = dict(k_min=k_min, k_max=k_max) if sparse else {}
    if sparse:
        want = R.sparse_paged_attention(q, p.k_cache, p.v_cache, planned_table, planned_lens, k_min=k_min,
                                        k_max=k_max, page_budget=budget)
    else:
        want = R.paged_attention(q, p.k_cache, p.v_cache, planned_table, planned_lens)
    plan = _plan(p, backend, **kw)
    first = plan.run(q, p.k_cache, p.v_cache, **run_kw)
    # the caller's buffers now describe another step: longer rows, other pages
    p.seq_lens.add_(3)
    p.block_table.copy_(torch.flip(p.block_table, dims=[1]))
    second = plan.run(q, p.k_cache, p.v_cache, **run_kw)
    for out in (first, second):
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    assert torch.equal(plan.block_table.long(), planned_table.long())
    assert torch.equal(plan.seq_lens.long(), planned_lens.long())


def test_both_backends_answer_the_same_after_in_place_changes():
    """The same planned step with the same in-place change answers the same on both backends."""
    outs = []
    for backend in BACKENDS:
        p, k_min, k_max = _problem(3)
        plan = _plan(p, backend, page_budget=5)
        p.seq_lens.fill_(p.block_table.shape[1] * 4)                 # every row grown to the table's capacity
        outs.append(plan.run(p.q[:, 0], p.k_cache, p.v_cache, k_min=k_min, k_max=k_max))
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_page_index_past_int32_is_ignored(backend):
    """An int64 page_indices entry of 2**32 + 1 is past every row's end: ignored, not read as page 1 after an
    int32 cast (the removed C++ path did that). Checked through plan.run and the public op."""
    p, _, _ = _problem(4)
    q = p.q[:, 0]
    big = 2**32 + 1
    listed = torch.tensor([[[0, 2, big], [big, 3, -1]], [[1, big, 4], [0, 5, big]]], dtype=torch.int64)
    kept = torch.where(listed == big, -1, listed)
    want = R.sparse_paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, page_indices=kept)
    plan = _plan(p, backend)
    torch.testing.assert_close(plan.run(q, p.k_cache, p.v_cache, page_indices=listed), want, atol=2e-5, rtol=1e-4)
    got = tinyattn.sparse_paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, page_indices=listed,
                                          backend=backend)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_run_dispatches_once(backend, monkeypatch):
    """run() makes one call into the implementation chosen at plan() time, with or without a gradient (the
    implementation routes autograd itself: the torch forms are differentiable, the Triton backend goes through
    the custom op)."""
    p, k_min, k_max = _problem(5)
    plan = _plan(p, backend, page_budget=4)
    impl = plan._impl
    calls = []
    real = impl.run
    monkeypatch.setattr(impl, "run", lambda *a, **k: (calls.append("run"), real(*a, **k))[1])
    plan.run(p.q[:, 0], p.k_cache, p.v_cache, k_min=k_min, k_max=k_max)
    out = plan.run(p.q[:, 0].clone().requires_grad_(), p.k_cache, p.v_cache, k_min=k_min, k_max=k_max)
    assert calls == ["run", "run"] and out.grad_fn is not None
    assert type(impl).__name__ == {"torch": "TorchPlan", "triton": "TritonPlan"}[backend]


def test_per_layer_scale_is_passed_down_not_stored():
    """A layer's own scale changes that call only; the plan's scale (and the next call) are untouched."""
    p, _, _ = _problem(6)
    q = p.q[:, 0]
    plan = _plan(p, "torch")
    before = plan.scale
    got = plan.run(q, p.k_cache, p.v_cache, scale=0.05)
    assert plan.scale == before
    torch.testing.assert_close(got, R.paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, scale=0.05),
                               atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(plan.run(q, p.k_cache, p.v_cache),
                               R.paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens),
                               atol=2e-5, rtol=1e-4)


def test_no_compiled_code_in_the_package():
    """No C, C++ or CUDA source ships, and nothing builds an extension (issue 25, DESIGN.md §5)."""
    from pathlib import Path

    root = Path(plan_module.__file__).resolve().parents[1]
    sources = [f for f in root.rglob("*") if f.suffix in {".c", ".cc", ".cpp", ".h", ".hpp", ".cu", ".cuh"}]
    assert sources == []
    offenders = [f for f in root.rglob("*.py") if "cpp_extension" in f.read_text() or "ninja" in f.read_text()]
    assert offenders == []


_SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero")
_FACTORIES = ("empty", "empty_like", "zeros", "zeros_like", "full", "full_like", "ones", "ones_like", "tensor",
              "arange", "empty_strided")


def _from_tinyattn() -> bool:
    """Whether the frame that called the patched function is tinyattn's own code (the Triton interpreter itself
    moves launch arguments through numpy: that is the stand-in for a GPU, not a host sync of tinyattn's)."""
    import sys
    name = sys._getframe(2).f_globals.get("__name__", "")
    return name == "tinyattn" or name.startswith("tinyattn.")


def _watch(monkeypatch, seen):
    for name in _SYNCS:
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _r=real, _n=name, **k: (_from_tinyattn() and seen.append(_n), _r(self, *a, **k))[1])
    for name in _FACTORIES:
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _r=real, _n=name, **k: (_from_tinyattn() and seen.append(_n), _r(*a, **k))[1])
    for name in ("new_empty", "new_zeros", "new_full", "new_ones", "new_tensor", "clone"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _r=real, _n=name, **k: (_from_tinyattn() and seen.append(_n), _r(self, *a, **k))[1])


def test_graph_mode_steps_allocate_nothing_and_never_sync(monkeypatch):
    """Issue 26 (graph mode, Triton path under the interpreter): after one warm-up step, plan() + run() of later
    steps with new tables (other lengths, other pages) within the capacity allocate no tensor and read no value
    on the host, the buffers keep their storage (a captured CUDA graph stays valid), and every step equals the
    reference."""
    cap_b, cap_p, S, budget = 2, 24, 4, 3
    plans = tinyattn.PagedAttentionPlan(backend="triton")
    g = torch.Generator().manual_seed(0)
    num_pages = 64
    k = torch.randn(num_pages, S, 2, 16, generator=g)
    v = torch.randn(num_pages, S, 2, 16, generator=g)
    k_min, k_max = torch.empty(num_pages, 2, 16), torch.empty(num_pages, 2, 16)
    every = torch.arange(num_pages, dtype=torch.int32)[None].expand(1, -1).contiguous()
    R.update_page_metadata(k, every, torch.tensor([num_pages * S]), k_min, k_max)
    out = torch.empty(cap_b, 4, 16)
    ptrs = None
    for step in range(4):
        lens = torch.randint(9, 60, (cap_b,), generator=g, dtype=torch.int32)
        width = int(lens.max()) // S + 1 + step % 2                         # the table's width changes too
        table = torch.randperm(num_pages, generator=g, dtype=torch.int32)[: cap_b * width].view(cap_b, width)
        q = torch.randn(cap_b, 4, 16, generator=g)
        seen = []
        if step > 0:
            _watch(monkeypatch, seen)
        plans.plan(table, lens, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=S, page_budget=budget,
                   trusted=True, max_batch=cap_b, max_pages_per_seq=cap_p)
        got = plans.run(q, k, v, k_min=k_min, k_max=k_max, out=out)
        monkeypatch.undo()
        assert seen == [], f"step {step}: tinyattn called {seen}"
        assert got is out
        now = {n: b.data_ptr() for n, b in plans._impl._buffers.items()}
        assert ptrs is None or now == ptrs                                 # same storage every step
        ptrs = now
        want = R.sparse_paged_attention(q, k, v, table, lens, k_min=k_min, k_max=k_max, page_budget=budget)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
