"""The compiled CPU kernel (tinyattn/kernels_cpu) against the reference loops, on ragged, poisoned, GQA problems.

The kernel serves the torch backend's runs on CPU tensors (the tests force ``backend="torch"``: conftest sets
TRITON_INTERPRET=1) and each test checks that the kernel really ran.
"""

import contextlib
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinyattn
import tinyattn.kernels_cpu as kernels_cpu
from tinyattn import reference
from paged_problems import make_problem, problems

pytestmark = pytest.mark.skipif(not kernels_cpu.available(), reason=f"CPU kernel {kernels_cpu.status()}")

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


@contextlib.contextmanager
def counted():
    """Counts the compiled kernel's calls (the plan must route CPU runs to it), at the extension module: the
    decode hot path calls it directly, the other paths through ``kernels_cpu.paged_decode``."""
    seen = []
    kernels_cpu.available()
    real = kernels_cpu._module

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

        def paged_decode(self, *args):
            seen.append(args)
            return real.paged_decode(*args)

    with mock.patch.object(kernels_cpu, "_module", Counting()):
        yield seen


@pytest.fixture
def calls():
    with counted() as seen:
        yield seen


@pytest.fixture(params=[1, 4], ids=["1thread", "4threads"])
def threads(request):
    """4 threads split a short batch's pages across tasks (split-K, merged by lse): both paths checked."""
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


def _check(out, lse, ref, ref_lse, dtype):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=problems(dtypes=("fp32", "fp16", "bf16"), max_query_tokens=4, head_dims=(8, 16, 24, 40, 64, 128)),
       window=st.sampled_from([-1, 0, 3, 17]))
def test_dense_matches_reference(p, window, threads):
    args = (p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    with counted() as calls:
        out, lse = tinyattn.paged_attention(*args, return_lse=True, window_left=window, backend="torch")
    ref, ref_lse = reference.paged_attention(*args, return_lse=True, window_left=window)
    _check(out, lse, ref, ref_lse, p.q.dtype)
    assert calls or not int(p.seq_lens.max())


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=problems(dtypes=("fp32", "bf16"), max_query_tokens=3, max_pages_per_row=12,
                 head_dims=(8, 16, 24, 32, 64, 128)),
       budget=st.integers(1, 6), sinks=st.integers(0, 2), recent=st.integers(0, 2),
       box_dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_fused_selection_matches_reference(p, budget, sinks, recent, box_dtype, threads):
    """Quest scoring + top-k inside the kernel = reference scores -> select_pages -> sparse attention."""
    k_min, k_max = p.bounds()
    if box_dtype != torch.float32:                   # narrow boxes rounded outward, as the cache stores them
        from tinyattn.ops.boxes import round_down, round_up
        k_min, k_max = round_down(k_min, box_dtype), round_up(k_max, box_dtype)
    Tq = p.q.shape[1]
    needed = max([-(-int(n) // p.page_size) - max(int(n) - Tq, 0) // p.page_size for n in p.seq_lens] + [1])
    budget = max(budget, needed, sinks + max(recent, 1))
    opts = dict(page_budget=budget, num_sink_pages=sinks, num_recent_pages=recent)
    args = (p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    with counted() as calls:
        out, lse = tinyattn.sparse_paged_attention(*args, k_min=k_min, k_max=k_max, return_lse=True, backend="torch",
                                                       **opts)
    ref, ref_lse = reference.sparse_paged_attention(*args, k_min=k_min.float(), k_max=k_max.float(),
                                                    return_lse=True, **opts)
    _check(out, lse, ref, ref_lse, p.q.dtype)
    assert calls or not int(p.seq_lens.max())                 # all rows empty: nothing to attend, no call


def test_selection_output_is_select_pages(threads):
    """The kernel's ``selected`` buffer = reference.select_pages of the reference scores (ascending, -1 padded,
    forced recent and sink pages), including a row that fits its budget."""
    from paged_problems import make_problem

    p = make_problem(3, batch=3, seq_lens=[300, 40, 0], page_size=8, num_kv_heads=2, group=3, head_dim=16,
                     num_query_tokens=2)
    k_min, k_max = p.bounds()
    budget, sinks, recent = 7, 1, 2
    B, Hkv = 3, 2
    out = torch.empty_like(p.q)
    selected = torch.full((B, Hkv, budget), 99, dtype=torch.int32)
    kernels_cpu.paged_decode(p.q.contiguous(), p.k_cache, p.v_cache, p.block_table, p.seq_lens, out, k_min=k_min,
                             k_max=k_max, selected=selected, page_budget=budget, num_sink_pages=sinks,
                             num_recent_pages=recent, scale=16 ** -0.5)
    scores = reference.page_scores(p.q, k_min, k_max, p.block_table, p.seq_lens, page_size=8)
    want = reference.select_pages(scores, p.seq_lens, page_size=8, page_budget=budget, num_sink_pages=sinks,
                                  num_recent_pages=recent, num_query_tokens=2)
    assert torch.equal(selected[:2], want[:2].to(torch.int32))       # the empty row selects nothing to compare


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=problems(dtypes=("fp32",), max_query_tokens=2, max_pages_per_row=8, head_dims=(8, 24, 32, 128)),
       data=st.data())
def test_listed_pages_with_duplicates_and_padding(p, data, threads):
    """Listed pages: -1 and past-the-end ids ignored, duplicates counted once (= the reference on the
    de-duplicated list)."""
    B, Hkv = p.q.shape[0], p.k_cache.shape[2]
    width = data.draw(st.integers(1, 10))
    ids = data.draw(st.lists(st.integers(-1, 9), min_size=B * Hkv * width, max_size=B * Hkv * width))
    listed = torch.tensor(ids, dtype=torch.int64).view(B, Hkv, width)
    n_pages = (p.seq_lens.long() + p.page_size - 1) // p.page_size
    clean = torch.full_like(listed, -1)
    for b in range(B):
        for h in range(Hkv):
            kept = sorted({i for i in listed[b, h].tolist() if 0 <= i < int(n_pages[b])})
            clean[b, h, :len(kept)] = torch.tensor(kept, dtype=torch.int64)
    args = (p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    plan = tinyattn.PagedAttentionPlan(backend="torch").plan(p.block_table, p.seq_lens, num_q_heads=p.q.shape[2], num_kv_heads=Hkv,
                                              head_dim=p.q.shape[3], page_size=p.page_size,
                                              num_query_tokens=p.q.shape[1])
    with counted() as calls:
        out, lse = plan.run(p.q, p.k_cache, p.v_cache, page_indices=listed, return_lse=True)
    ref, ref_lse = reference.sparse_paged_attention(*args, page_indices=clean, return_lse=True)
    _check(out, lse, ref, ref_lse, torch.float32)
    assert calls or not int(p.seq_lens.max())


def test_strided_pool_and_out_buffer(calls):
    """A pool that is a view (HND storage read as NHD) and a caller's ``out``: same answer, written in place."""
    from paged_problems import make_problem

    p = make_problem(5, batch=2, seq_lens=[70, 33], page_size=16, num_kv_heads=2, group=4, head_dim=32)
    k_hnd = p.k_cache.transpose(1, 2).contiguous().transpose(1, 2)     # same values, strides of an HND pool
    v_hnd = p.v_cache.transpose(1, 2).contiguous().transpose(1, 2)
    q = p.q[:, 0]
    out = torch.full_like(q, float("nan"))
    got = tinyattn.PagedAttentionPlan(backend="torch").plan(p.block_table, p.seq_lens, num_q_heads=8, num_kv_heads=2, head_dim=32,
                                             page_size=16).run(q, k_hnd, v_hnd, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, reference.paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens),
                               atol=2e-5, rtol=2e-5)
    assert calls


def test_routing(calls):
    """Decode on the torch backend: the kernel; ``disabled()``, gradients, more than 16 queries: the PyTorch path."""
    from paged_problems import make_problem

    p = make_problem(1, batch=1, seq_lens=[64], page_size=16, num_kv_heads=1, group=2, head_dim=16,
                     num_query_tokens=17)
    args = (p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    tinyattn.paged_attention(*args, backend="torch")                   # Tq = 17: the GEMM path
    with kernels_cpu.disabled():
        tinyattn.paged_attention(p.q[:, -1:], *args[1:], backend="torch")
    tinyattn.paged_attention(p.q[:, -1:].clone().requires_grad_(), *args[1:], backend="torch")
    assert not calls
    tinyattn.paged_attention(p.q[:, -1:], *args[1:], backend="torch")
    assert len(calls) == 1


def test_kernel_off_falls_back(tmp_path):
    """``TINYATTN_CPU_KERNEL=0``: status says so and the ops still answer (the PyTorch path)."""
    code = ("import torch, tinyattn, tinyattn.kernels_cpu as K\n"
            "q = torch.randn(1, 2, 8); k = torch.randn(2, 4, 1, 8)\n"
            "out = tinyattn.paged_attention(q, k, k, torch.tensor([[0, 1]], dtype=torch.int32), "
            "torch.tensor([7], dtype=torch.int32))\n"
            "print(K.status(), tuple(out.shape))\n")
    env = dict(os.environ, TINYATTN_CPU_KERNEL="0", TRITON_INTERPRET="0")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "off: TINYATTN_CPU_KERNEL=0 (1, 2, 8)"


def _plan_problem():
    p = make_problem(5, batch=2, seq_lens=[150, 61], page_size=16, num_kv_heads=2, group=4, head_dim=64)
    plan = tinyattn.PagedAttentionPlan(backend="torch").plan(
        p.block_table, p.seq_lens, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, page_budget=4)
    k_min, k_max = p.bounds()
    return p, plan, k_min, k_max


def test_run_with_out_allocates_nothing(monkeypatch, calls):
    """Issue 9: with ``out=`` the kernel path of plan.run allocates no tensor (the int32 tables and the selection
    buffer are the step's, made by its first run), and writes the answer into ``out``."""
    p, plan, k_min, k_max = _plan_problem()
    q = p.q[:, 0]
    out = torch.empty_like(q)
    for boxes in ({}, dict(k_min=k_min, k_max=k_max)):
        plan.run(q, p.k_cache, p.v_cache, out=out, **boxes)               # the step's first run
        made = []
        for name in ("empty", "empty_like", "zeros", "zeros_like", "full", "full_like", "ones", "tensor"):
            real = getattr(torch, name)
            monkeypatch.setattr(torch, name, lambda *a, _real=real, _n=name, **kw: (made.append(_n), _real(*a, **kw))[1])
        got = plan.run(q, p.k_cache, p.v_cache, out=out, **boxes)
        monkeypatch.undo()
        assert made == [] and got is out
        ref = (reference.sparse_paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, page_budget=4,
                                                **boxes) if boxes else
               reference.paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens))
        torch.testing.assert_close(out, ref, **TOL[torch.float32])
    assert len(calls) == 4


@pytest.mark.parametrize("bad", ["pool", "k_max", "q", "out"])
def test_run_hot_path_still_names_the_argument(bad, calls):
    """plan.run's decode hot path leaves the shape checks to the kernel; what the kernel refuses goes through the
    checked path, so the error is the same ValueError naming the argument as before."""
    p, plan, k_min, k_max = _plan_problem()
    q, k, v = p.q[:, 0], p.k_cache, p.v_cache
    kwargs = dict(k_min=k_min, k_max=k_max)
    if bad == "pool":                  # fewer pages than the table's ids: the plan knows the largest id
        k, v, kwargs = k[:3], v[:3], {}
    elif bad == "k_max":
        kwargs = dict(k_min=k_min)
    elif bad == "q":
        q = q[:, :4]
    else:
        kwargs["out"] = torch.empty(2, 8, 32)
    match = {"pool": "block_table", "k_max": "k_min, k_max", "q": "q:", "out": "out:"}[bad]
    with pytest.raises(ValueError, match=match):
        plan.run(q, k, v, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write_in_kernel_matches_torch_ops(dtype, monkeypatch):
    """PagedKVCache.write through the kernel (rows + boxes in one call) = the index_copy_ / index_reduce_ path:
    several tokens of one page in one call, pages of several rows, a NaN key (propagates into the box, as amin /
    amax do), and slots that did not come from extend()."""
    from tinyattn.cache import PagedKVCache

    real, seen = kernels_cpu.write_kv, []
    monkeypatch.setattr(kernels_cpu, "write_kv", lambda *a: (seen.append(1), real(*a))[1])
    caches = [PagedKVCache(2, 3, 16, page_size=4, num_pages=12, dtype=dtype) for _ in range(2)]
    for c in caches:
        assert [c.add_sequence(), c.add_sequence()] == [0, 1]
    g = torch.Generator().manual_seed(0)
    for step, n in enumerate([7, 1, 3, 1]):
        slots = [c.extend([0, 1], n) for c in caches]
        k = torch.randn(2 * n, 3, 16, generator=g).to(dtype)
        v = torch.randn(2 * n, 3, 16, generator=g).to(dtype)
        if step == 2:
            k[1, 2, 5] = float("nan")
        for layer in range(2):
            caches[0].write(layer, slots[0], k, v)                        # the kernel
            with kernels_cpu.disabled():
                caches[1].write(layer, slots[1], k, v)                    # the PyTorch ops
    loose = torch.tensor([1, 5, 6], dtype=torch.int64)                    # not from extend(): checked, then written
    k, v = torch.randn(2, 3, 3, 16, generator=g).to(dtype)
    caches[0].write(0, loose, k, v)
    with kernels_cpu.disabled():
        caches[1].write(0, loose, k, v)
    for name in ("k_cache", "v_cache", "k_min", "k_max"):
        for a, b in zip(getattr(caches[0], name), getattr(caches[1], name)):
            torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)
    assert torch.isnan(caches[0].k_min[0]).any()
    assert len(seen) == 9                                                 # every write of caches[0] took the kernel


def test_portable_build_matches_reference():
    """The portable loops (what CPUs without AVX-512 run; built here with -mno-avx512f) against the reference,
    on the head sizes the AVX-512 micro-kernels take on this machine: dense, fused selection, Tq > 1."""
    code = (
        "import torch, tinyattn, tinyattn.kernels_cpu as K\n"
        "from tinyattn import reference\n"
        "from paged_problems import make_problem\n"
        "assert K.status() == 'compiled (portable loops)', K.status()\n"
        "for seed, (D, G, Tq) in enumerate([(64, 4, 1), (128, 2, 1), (32, 3, 2), (128, 1, 3)]):\n"
        "    p = make_problem(seed, batch=2, seq_lens=[37, 70], page_size=8, num_kv_heads=2, group=G,\n"
        "                     head_dim=D, num_query_tokens=Tq, dtype=torch.float32, poison=float('nan'))\n"
        "    args = (p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)\n"
        "    k_min, k_max = p.bounds()\n"
        "    out = tinyattn.paged_attention(*args, backend='torch')\n"
        "    torch.testing.assert_close(out, reference.paged_attention(*args), atol=2e-5, rtol=2e-5)\n"
        "    opts = dict(k_min=k_min, k_max=k_max, page_budget=4, num_recent_pages=1)\n"
        "    out = tinyattn.sparse_paged_attention(*args, backend='torch', **opts)\n"
        "    ref = reference.sparse_paged_attention(*args, **opts)\n"
        "    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)\n"
        "print('ok')\n")
    env = dict(os.environ, TINYATTN_CPU_KERNEL_SIMD="portable", TRITON_INTERPRET="0",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("ok")


@pytest.mark.parametrize("bad", ["page_id", "seq_len"])
def test_bad_tables_raise_even_with_value_checks_off(bad):
    """With the ops' data checks off (a runtime trusting its tables), wrong tables still raise in the kernel
    (naming the argument) instead of reading outside the pool."""
    q = torch.randn(1, 4, 8)
    k = torch.randn(3, 4, 2, 8)
    table = torch.tensor([[0, 7 if bad == "page_id" else 1]], dtype=torch.int32)
    lens = torch.tensor([6 if bad == "page_id" else 9], dtype=torch.int32)
    with tinyattn.value_checks(False), pytest.raises(RuntimeError, match="block_table" if bad == "page_id"
                                                     else "seq_lens"), counted() as calls:
        tinyattn.paged_attention(q, k, k, table, lens, backend="torch")
    assert calls
