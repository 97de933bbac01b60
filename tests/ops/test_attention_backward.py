"""Backward of paged / sparse attention (CASES.md §9), both backends, against float64 reference autograd.

The reference (``tinyattn.reference``, per-row loops of differentiable torch ops, run in float64) gives the right
gradients; the Triton kernels run in the interpreter (tests/conftest.py), the torch backend directly. Gradients are
checked for q, k_cache and v_cache, through ``out`` and ``lse`` together, with sliding windows too; gradcheck in fp64,
``torch.library.opcheck`` of the custom ops, ``torch.compile(fullgraph=True)`` (aot_eager and inductor, with the
default value checks) equal to eager; rows that see nothing give zero gradients, unread slots exactly zero; the
per-page gradient norms.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyattn
from tinyattn.ops.page_grad import page_grad_norms
from tinyattn.ops.selection import torch_impl as selection_torch
from tinyattn.ops import custom_ops
from tinyattn import reference

from paged_problems import BACKENDS, SLOW_TRITON, empty_batch, make_problem, problems, tiers, windows


OPS = ["dense", "sparse"]


# ---- helpers -----------------------------------------------------------------------------------------
def leaves(p, dtype):
    return [x.detach().to(dtype).clone().requires_grad_() for x in (p.q, p.k_cache, p.v_cache)]


def run_with_grads(p, dtype, *, op, page_indices=None, seed=0, **kw):
    """(out, lse, dq, dk, dv) of ``loss = <out, g_out> + <lse, g_lse>`` (finite lse only)."""
    q, k, v = leaves(p, dtype)
    args = (q, k, v, p.block_table, p.seq_lens)
    if op == "dense":
        out, lse = kw.pop("fn", tinyattn).paged_attention(*args, return_lse=True, **kw)
    else:
        out, lse = kw.pop("fn", tinyattn).sparse_paged_attention(*args, page_indices=page_indices, return_lse=True,
                                                                 **kw)
    g = torch.Generator().manual_seed(seed)
    g_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    g_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.dtype)
    loss = (out * g_out).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * g_lse).sum()
    if not loss.requires_grad:                            # the reference keeps no graph when no row sees a key
        return out.detach(), lse.detach(), *(torch.zeros_like(x) for x in (q, k, v))
    grads = torch.autograd.grad(loss, (q, k, v), allow_unused=True, materialize_grads=True)
    return out.detach(), lse.detach(), *grads


def reference_grads(p, op, page_indices=None, seed=0):
    return run_with_grads(p, torch.float64, op=op, page_indices=page_indices, seed=seed, fn=reference)


def read_slots(p, page_indices=None):
    """bool ``[num_pages, page_size, Hkv]``: the pool slots the forward reads (listed pages, valid slots)."""
    page_size, Hkv = p.page_size, p.num_kv_heads
    read = torch.zeros(p.k_cache.shape[:3], dtype=torch.bool)
    for b, n in enumerate(p.seq_lens.tolist()):
        n_pages = -(-n // page_size)
        for h in range(Hkv):
            pages = range(n_pages) if page_indices is None else [j for j in page_indices[b, h].tolist()
                                                               if 0 <= j < n_pages]
            for j in pages:
                read[int(p.block_table[b, j]), : min(page_size, n - j * page_size), h] = True
    return read


def assert_grads_match(got, want, *, rel):
    """No NaN anywhere; every tensor within ``rel`` of the reference, relative to its largest entry."""
    names = ["out", "lse", "dq", "dk_cache", "dv_cache"]
    for name, g, w in zip(names, got, want):
        assert not torch.isnan(g).any(), f"{name} has NaN"
        assert not torch.isnan(w).any(), f"reference {name} has NaN"
        if name == "lse":
            assert torch.equal(torch.isneginf(g), torch.isneginf(w))
            g, w = torch.where(torch.isfinite(w), g.double(), 0.0), torch.where(torch.isfinite(w), w, 0.0)
        tol = rel * (1.0 + w.abs().max().item() if w.numel() else 1.0)
        torch.testing.assert_close(g.double(), w.double(), atol=tol, rtol=rel, msg=lambda m: f"{name}: {m}")


def assert_unread_slots_are_exactly_zero(got, p, page_indices=None):
    unread = ~read_slots(p, page_indices)
    for name, g in (("dk_cache", got[3]), ("dv_cache", got[4])):
        assert torch.equal(g[unread], torch.zeros_like(g[unread])), f"{name}: gradient leaked into unread slots"


def random_page_indices(seed, p, width):
    """Distinct logical pages per (row, KV head), shuffled, -1 padded; some past the row's end."""
    g = torch.Generator().manual_seed(seed)
    B, max_pages = p.block_table.shape
    idx = torch.full((B, p.num_kv_heads, width), -1, dtype=torch.int32)
    for b in range(B):
        for h in range(p.num_kv_heads):
            count = int(torch.randint(0, width + 1, (1,), generator=g))
            idx[b, h, :count] = torch.randperm(max_pages + 1, generator=g)[:count].to(torch.int32)
    return idx


@st.composite
def training_problems(draw, max_batch=3, max_pages_per_row=5):
    page_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_query_tokens = draw(st.integers(1, 2 * page_size))
    batch = draw(st.integers(1, max_batch))
    boundary = st.sampled_from([0, 1, page_size - 1, page_size, page_size + 1, num_query_tokens, 2 * page_size])
    lens = [max(0, draw(st.one_of(boundary, st.integers(0, max_pages_per_row * page_size)))) for _ in range(batch)]
    return make_problem(draw(st.integers(0, 2**31 - 1)), batch=batch, seq_lens=lens, page_size=page_size,
                        num_kv_heads=draw(st.integers(1, 2)), group=draw(st.sampled_from([1, 2, 3])),
                        head_dim=draw(st.sampled_from([8, 12, 16, 40])), num_query_tokens=num_query_tokens,
                        poison=draw(st.sampled_from([float("nan"), 1e30, -1e30])))


# ---- forward + three gradients against float64 (hypothesis) -------------------------------------------
@tiers(2, 12)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", OPS)
def test_gradients_match_float64_reference(backend, op, examples):
    """GQA, head_dims 8/12/40, Tq 1..2*page_size, ragged rows (0 included), poisoned padding, lse gradient."""
    @settings(max_examples=examples, deadline=None)
    @given(p=training_problems(), seed=st.integers(0, 2**31 - 1))
    def check(p, seed):
        pi = random_page_indices(seed, p, width=3) if op == "sparse" else None
        got = run_with_grads(p, torch.float32, op=op, page_indices=pi, seed=seed, backend=backend)
        want = reference_grads(p, op, pi, seed=seed)
        assert_grads_match(got, want, rel=2e-5)
        assert_unread_slots_are_exactly_zero(got, p, pi)

    check()


@pytest.mark.parametrize("op", OPS)
def test_float64_torch_backend_equals_reference_to_rounding(op):
    p = make_problem(3, batch=3, seq_lens=[0, 11, 6], page_size=4, num_kv_heads=2, group=2, head_dim=12,
                     num_query_tokens=5)
    pi = torch.tensor([[[0, -1], [1, 0]], [[2, 0], [1, -1]], [[1, 9], [-1, -1]]], dtype=torch.int32)
    pi = pi if op == "sparse" else None
    got = run_with_grads(p, torch.float64, op=op, page_indices=pi, backend="torch")
    assert got[2].dtype == got[3].dtype == torch.float64
    assert_grads_match(got, reference_grads(p, op, pi), rel=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,rel", [(torch.float16, 4e-3), (torch.bfloat16, 3e-2)])
def test_low_precision_gradients(backend, dtype, rel):
    """fp16/bf16 inputs: fp32 math and fp32 dK/dV accumulation; error relative to the largest gradient."""
    p = make_problem(4, batch=2, seq_lens=[19, 7], page_size=4, num_kv_heads=2, group=2, head_dim=16,
                     num_query_tokens=6)
    got = run_with_grads(p, dtype, op="dense", backend=backend)
    assert got[2].dtype == got[3].dtype == got[4].dtype == dtype
    want = reference_grads(p, "dense")
    assert_grads_match(got, want, rel=rel)


# ---- CASES §9, one test per fault kind ----------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", OPS)
def test_rows_that_see_nothing_give_zero_gradients_not_nan(backend, op):
    """Empty rows and queries before the first key, with a NaN-poisoned pool: zeros, no NaN, other rows exact."""
    p = make_problem(5, batch=3, seq_lens=[0, 3, 10], page_size=4, num_kv_heads=1, group=2, head_dim=8,
                     num_query_tokens=5)                  # row 1: queries at positions -2, -1 see nothing
    pi = torch.tensor([[[0]], [[0]], [[1]]], dtype=torch.int32) if op == "sparse" else None
    got = run_with_grads(p, torch.float32, op=op, page_indices=pi, backend=backend)
    assert_grads_match(got, reference_grads(p, op, pi), rel=2e-5)
    dq = got[2]
    assert torch.equal(dq[0], torch.zeros_like(dq[0])) and torch.equal(dq[1, :2], torch.zeros_like(dq[1, :2]))
    assert_unread_slots_are_exactly_zero(got, p, pi)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pages_shared_by_rows_and_heads_accumulate(backend):
    """Prefix sharing: rows 0-2 share their first two physical pages; GQA heads share each KV head."""
    p = make_problem(6, batch=3, seq_lens=[12, 9, 8], page_size=4, num_kv_heads=2, group=3, head_dim=8,
                     num_query_tokens=3, extra_pages=2)
    shared = p.block_table[0, :2].clone()
    for b in (1, 2):
        p.block_table[b, :2] = shared
    for op, pi in (("dense", None), ("sparse", torch.tensor([[[0, 2], [1, 2]], [[0, 2], [0, 1]], [[1, -1], [0, 1]]],
                                                             dtype=torch.int32))):
        got = run_with_grads(p, torch.float32, op=op, page_indices=pi, backend=backend)
        assert_grads_match(got, reference_grads(p, op, pi), rel=2e-5)
        assert_unread_slots_are_exactly_zero(got, p, pi)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unselected_pages_and_padding_get_exactly_zero(backend):
    """Selected pages through select_pages (k_min/k_max path): every other slot's gradient is exactly 0."""
    p = make_problem(7, batch=2, seq_lens=[30, 17], page_size=4, num_kv_heads=2, group=2, head_dim=8,
                     num_query_tokens=2)
    k_min, k_max = p.bounds()
    got = run_with_grads(p, torch.float32, op="sparse", k_min=k_min, k_max=k_max, page_budget=3, backend=backend)
    scores = reference.page_scores(p.q, k_min, k_max, p.block_table, p.seq_lens, page_size=4)
    pi = reference.select_pages(scores, p.seq_lens, page_size=4, page_budget=3, num_query_tokens=2)
    assert_grads_match(got, reference_grads(p, "sparse", pi), rel=2e-5)
    assert_unread_slots_are_exactly_zero(got, p, pi)
    assert (read_slots(p, pi).sum() < read_slots(p).sum())      # the budget really dropped pages


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_mask_is_applied_in_backward(backend):
    """Tq = 2 * page_size: a query's gradient must not see keys after it (bottom-right alignment)."""
    p = make_problem(8, batch=2, seq_lens=[9, 16], page_size=4, num_kv_heads=1, group=1, head_dim=8,
                     num_query_tokens=8)
    q, k, v = leaves(p, torch.float32)
    out = tinyattn.paged_attention(q, k, v, p.block_table, p.seq_lens, backend=backend)
    out[1, 0].sum().backward()                            # query 0 of row 1 sits at position 8
    first = p.block_table[1, :2].long()                   # keys 0..7
    later = p.block_table[1, 2:4].long()                  # keys 8..15: only key 8 is visible
    assert k.grad[first].abs().sum() > 0
    assert torch.equal(k.grad[later[0], 1:], torch.zeros_like(k.grad[later[0], 1:]))
    assert torch.equal(v.grad[later[1]], torch.zeros_like(v.grad[later[1]]))
    assert v.grad[later[0], 0].abs().sum() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_page_ids(backend):
    p = make_problem(9, batch=2, seq_lens=[9, 5], page_size=4, num_kv_heads=1, group=2, head_dim=8, extra_pages=0,
                     num_query_tokens=2)
    num_pages = 20000
    big = make_problem(9, batch=2, seq_lens=[9, 5], page_size=4, num_kv_heads=1, group=2, head_dim=8,
                       extra_pages=0, num_query_tokens=2)
    big.k_cache = torch.full((num_pages, 4, 1, 8), float("nan"))
    big.v_cache = torch.full((num_pages, 4, 1, 8), float("nan"))
    big.block_table = torch.full_like(p.block_table, -1)
    dst = num_pages - 5
    for b, n in enumerate([9, 5]):
        for j in range(-(-n // 4)):
            src = int(p.block_table[b, j])
            big.k_cache[dst], big.v_cache[dst] = p.k_cache[src], p.v_cache[src]
            big.block_table[b, j] = dst
            dst += 1
    got = run_with_grads(big, torch.float32, op="dense", backend=backend)
    assert_grads_match(got, reference_grads(big, "dense"), rel=2e-5)
    assert torch.equal(got[3][: num_pages - 5], torch.zeros_like(got[3][: num_pages - 5]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_reused_across_configurations(backend):
    """Alternate shapes, dense/sparse and Tq between calls: a cached specialisation must not leak."""
    shapes = [dict(seq_lens=[7, 13], num_query_tokens=1, group=2), dict(seq_lens=[5], num_query_tokens=4, group=1),
              dict(seq_lens=[7, 13], num_query_tokens=1, group=2)]
    for i, s in enumerate(shapes):
        p = make_problem(40 + i, batch=len(s["seq_lens"]), page_size=4, num_kv_heads=1, head_dim=8, **s)
        for op, pi in (("dense", None), ("sparse", torch.zeros(len(s["seq_lens"]), 1, 1, dtype=torch.int32))):
            got = run_with_grads(p, torch.float32, op=op, page_indices=pi, backend=backend)
            assert_grads_match(got, reference_grads(p, op, pi), rel=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_q_and_broadcast_output_gradient(backend):
    """q as a transposed view, decode-shaped q [B, Hq, D], and out.sum() (a stride-0 upstream gradient)."""
    p = make_problem(11, batch=2, seq_lens=[6, 11], page_size=4, num_kv_heads=2, group=2, head_dim=8)
    base = p.q[:, 0].detach().clone()                                             # [B, Hq, D]
    q = base.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()      # non-contiguous leaf
    k, v = [x.detach().clone().requires_grad_() for x in (p.k_cache, p.v_cache)]
    tinyattn.paged_attention(q, k, v, p.block_table, p.seq_lens, backend=backend).sum().backward()
    q2, k2, v2 = [x.detach().double().requires_grad_() for x in (base, p.k_cache, p.v_cache)]
    reference.paged_attention(q2, k2, v2, p.block_table, p.seq_lens).sum().backward()
    for g, w in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(g.double(), w, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_grad_path_records_no_graph(backend):
    """Without requires_grad (or under no_grad) nothing is recorded; with it, the torch backend's forms are
    differentiable torch ops and the Triton backend goes through the custom op with its backward kernel."""
    p = make_problem(12, batch=1, seq_lens=[5], page_size=4, num_kv_heads=1, group=1, head_dim=8)
    out = tinyattn.paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, backend=backend)
    assert out.grad_fn is None
    q = p.q.clone().requires_grad_()
    with torch.no_grad():
        assert tinyattn.paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens,
                                        backend=backend).grad_fn is None
    out = tinyattn.paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, backend=backend)
    custom = "tinyattn_paged_attention_fwd" in type(out.grad_fn).__name__
    assert out.grad_fn is not None and custom == (backend == "triton")


# ---- gradcheck, opcheck, torch.compile -------------------------------------------------------------------
def tiny_problem(dtype=torch.float64, poison=float("nan")):
    return make_problem(13, batch=3, seq_lens=[0, 5, 3], page_size=2, num_kv_heads=1, group=2, head_dim=3,
                        num_query_tokens=3, dtype=dtype, poison=poison, extra_pages=1)


@pytest.mark.parametrize("op", OPS)
def test_gradcheck_torch_backend_float64(op):
    p = tiny_problem()
    pi = torch.tensor([[[0, 1]], [[2, 0]], [[1, -1]]], dtype=torch.int32) if op == "sparse" else None

    def f(q, k, v):
        if op == "dense":
            return tinyattn.paged_attention(q, k, v, p.block_table, p.seq_lens, backend="torch")
        return tinyattn.sparse_paged_attention(q, k, v, p.block_table, p.seq_lens, page_indices=pi, backend="torch")

    q, k, v = leaves(p, torch.float64)
    assert torch.autograd.gradcheck(f, (q, k, v), atol=1e-8, rtol=1e-6)


def test_gradcheck_custom_op_out_and_lse_float64():
    """Both outputs of tinyattn::paged_attention_fwd (lse in float64 here) against finite differences."""
    p = tiny_problem(poison=1e30)
    pi = selection_torch.canonical_page_indices(torch.tensor([[[0, 1]], [[2, 0]], [[1, -1]]]), p.seq_lens, p.page_size)

    def f(q, k, v):
        out, lse = custom_ops.paged_attention_fwd(q, k, v, p.block_table, p.seq_lens, pi, 0.7, "torch")
        return out, torch.where(torch.isfinite(lse), lse, 0.0)

    assert torch.autograd.gradcheck(f, tuple(leaves(p, torch.float64)), atol=1e-8, rtol=1e-6)


def opcheck_args(backend, dtype=torch.float32):
    p = make_problem(14, batch=2, seq_lens=[5, 3], page_size=2, num_kv_heads=1, group=2, head_dim=8,
                     num_query_tokens=2, dtype=dtype, poison=0.5)
    bt, sl = p.block_table.to(torch.int32), p.seq_lens.to(torch.int32)
    pi = selection_torch.canonical_page_indices(torch.tensor([[[0, 2]], [[1, -1]]]), sl, 2)
    q, k, v = leaves(p, dtype)
    return q, k, v, bt, sl, pi


@pytest.mark.slow
@pytest.mark.parametrize("backend,dtype", [("torch", torch.float64), ("triton", torch.float32)])
def test_opcheck_forward_and_backward_ops(backend, dtype):
    q, k, v, bt, sl, pi = opcheck_args(backend, dtype)
    for indices in (pi, None):
        torch.library.opcheck(custom_ops.paged_attention_fwd, (q, k, v, bt, sl, indices, 0.5, backend))
    out, lse = custom_ops.paged_attention_fwd(q.detach(), k.detach(), v.detach(), bt, sl, pi, 0.5, backend)
    dout = torch.randn_like(out)
    torch.library.opcheck(custom_ops.paged_attention_bwd, (dout, None, q.detach(), k.detach(), v.detach(), bt, sl, pi, out,
                                                  lse, 0.5, backend))


@pytest.mark.slow
def test_torch_compile_fullgraph_forward_and_backward():
    """The public sparse op (Triton kernels) inside a compiled training step, fullgraph, forward and backward.

    Value checks are off (they sync with the host); ``aot_eager`` traces through Dynamo and AOTAutograd with
    the fake kernels like inductor does, without inductor's C++ build (a minute on 2 cores).
    """
    backend = "triton"
    q, k, v, bt, sl, pi = opcheck_args(backend)

    def step(q, k, v):
        out = tinyattn.sparse_paged_attention(q, k, v, bt, sl, page_indices=pi, backend=backend)
        return (out * out).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with tinyattn.value_checks(False):
        loss = compiled(q, k, v)
        loss.backward()
    q2, k2, v2 = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    step(q2, k2, v2).backward()
    for g, w in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


# ---- per-page gradient magnitude -----------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size,head_dim", [(1, 8), (4, 12), (16, 40)])
def test_page_grad_norms(backend, page_size, head_dim):
    p = make_problem(15, batch=2, seq_lens=[3 * page_size - 1, page_size + 1], page_size=page_size, num_kv_heads=2,
                     group=2, head_dim=head_dim, num_query_tokens=2, extra_pages=5)
    pi = torch.tensor([[[0, 2], [1, -1]], [[1, -1], [0, 1]]], dtype=torch.int32)
    _, _, _, dk, dv = run_with_grads(p, torch.float32, op="sparse", page_indices=pi, backend=backend)
    norms = page_grad_norms(dk, dv, backend=backend)
    assert norms.shape == (p.k_cache.shape[0], 2) and norms.dtype == torch.float32
    want = (dk.double() ** 2).sum((1, 3)) + (dv.double() ** 2).sum((1, 3))
    torch.testing.assert_close(norms.double(), want, rtol=1e-5, atol=1e-9)
    unread = ~read_slots(p, pi).any(1)                     # [num_pages, Hkv]: pages a head never read
    assert torch.equal(norms[unread], torch.zeros_like(norms[unread]))
    assert (norms[~unread] > 0).all()


# ---- torch.compile(fullgraph=True) with the default value checks, with and without grad ----------------------------
def _compile_problem():
    p = make_problem(11, batch=2, seq_lens=[5, 21], page_size=8, num_kv_heads=1, group=2, head_dim=8)
    lo, hi = p.bounds()
    return p, lo, hi


def _op(kind, p, lo, hi, backend):
    args = (p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    if kind == "dense":
        return lambda x: tinyattn.paged_attention(x, *args, backend=backend)
    if kind == "sparse":
        return lambda x: tinyattn.sparse_paged_attention(x, *args, k_min=lo, k_max=hi, page_budget=2,
                                                         num_sink_pages=1, backend=backend)
    indices = torch.tensor([[[0, -1]], [[2, 0]]], dtype=torch.int32)
    return lambda x: tinyattn.sparse_paged_attention(x, *args, page_indices=indices, backend=backend)


def _reference(kind, p, lo, hi, x):
    args = (x, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    if kind == "dense":
        return reference.paged_attention(*args)
    if kind == "sparse":
        return reference.sparse_paged_attention(*args, k_min=lo, k_max=hi, page_budget=2, num_sink_pages=1)
    return reference.sparse_paged_attention(*args, page_indices=torch.tensor([[[0, -1]], [[0, 2]]]))


def _check_compiled(kind, backend, compiler, grad):
    torch._dynamo.reset()
    p, lo, hi = _compile_problem()
    f = _op(kind, p, lo, hi, backend)
    q = p.q[:, 0].detach()
    x_eager, x_comp = q.clone().requires_grad_(grad), q.clone().requires_grad_(grad)
    want = f(x_eager)
    got = torch.compile(f, fullgraph=True, backend=compiler)(x_comp)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.detach(), _reference(kind, p, lo, hi, q), atol=3e-5, rtol=3e-5)
    if grad:
        want.square().sum().backward()
        got.square().sum().backward()
        torch.testing.assert_close(x_comp.grad, x_eager.grad, atol=1e-6, rtol=1e-6)
        assert x_comp.grad.abs().sum() > 0


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("kind", ["dense", "sparse", "page_indices"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fullgraph_compile_aot_eager_equals_eager(backend, kind, grad):
    """Default value checks on: they are skipped while tracing; the no-grad path goes through the custom ops."""
    _check_compiled(kind, backend, "aot_eager", grad)


@pytest.mark.slow
@pytest.mark.parametrize("backend, kind, grad", [("torch", "dense", True), ("triton", "sparse", False)])
def test_fullgraph_compile_inductor_equals_eager(backend, kind, grad):
    """Inductor on the CPU compiles C++ (a few seconds a graph here): two cases only."""
    _check_compiled(kind, backend, "inductor", grad)


def test_value_checks_still_run_in_eager_after_compiling():
    p, lo, hi = _compile_problem()
    f = _op("dense", p, lo, hi, "torch")
    torch.compile(f, fullgraph=True, backend="aot_eager")(p.q[:, 0])
    with pytest.raises(ValueError, match="seq_lens: expected values <="):
        tinyattn.paged_attention(p.q[:, 0], p.k_cache, p.v_cache, p.block_table, p.seq_lens + 1000, backend="torch")


# ---- edge cases of the backward ---------------------------------------------------------------------------------
def test_torch_backend_empty_batch_backward():
    q, k, v, bt, sl = empty_batch()
    q.requires_grad_(); k.requires_grad_(); v.requires_grad_()
    tinyattn.paged_attention(q, k, v, bt, sl, backend="torch").sum().backward()
    assert torch.count_nonzero(k.grad) == 0 and torch.count_nonzero(v.grad) == 0


def test_triton_backward_keeps_its_own_selection():
    """Triton: the selection buffer is rewritten by the next call's kernel (no version bump), so a backward after
    another sparse call must still use its own pages: dq equals the reference's."""
    torch.manual_seed(1)
    page_size, N = 4, 12
    k, v = torch.randn(N, page_size, 1, 8), torch.randn(N, page_size, 1, 8)
    bt = torch.arange(N, dtype=torch.int32).view(2, 6)
    sl = torch.tensor([23, 18], dtype=torch.int32)
    kmin, kmax = torch.zeros(N, 1, 8), torch.zeros(N, 1, 8)
    tinyattn.update_page_metadata(k, bt, sl, kmin, kmax, backend="torch")
    q, q2 = torch.randn(2, 2, 8), 3 * torch.randn(2, 2, 8)
    qa = q.clone().requires_grad_()
    out = tinyattn.sparse_paged_attention(qa, k, v, bt, sl, k_min=kmin, k_max=kmax, page_budget=2, backend="triton")
    tinyattn.sparse_paged_attention(q2, k, v, bt, sl, k_min=kmin, k_max=kmax, page_budget=2, backend="triton")
    out.sum().backward()
    qr = q.clone().requires_grad_()
    reference.sparse_paged_attention(qr, k, v, bt, sl, k_min=kmin, k_max=kmax, page_budget=2).sum().backward()
    torch.testing.assert_close(qa.grad, qr.grad, atol=1e-5, rtol=1e-4)


# ---- sliding windows in the backward: against reference autograd, gradcheck, opcheck --------------------------------
WINDOW_EXAMPLES = {"torch": 40, "triton": 12}      # the interpreter is slow: fewer, small examples

def grads(fn, p, dtype, w, page_indices=None, backend=None):
    q, k, v = (x.detach().to(dtype).clone().requires_grad_() for x in (p.q, p.k_cache, p.v_cache))
    kw = dict(window_left=w, return_lse=True)
    if backend is not None:
        kw["backend"] = backend
    if page_indices is None:
        out, lse = fn.paged_attention(q, k, v, p.block_table, p.seq_lens, **kw)
    else:
        out, lse = fn.sparse_paged_attention(q, k, v, p.block_table, p.seq_lens, page_indices=page_indices, **kw)
    g = torch.Generator().manual_seed(7)
    g_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)      # the same draws for any dtype
    g_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.dtype)
    loss = (out * g_out).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * g_lse).sum()
    if not loss.requires_grad:                            # the reference keeps no graph when no row sees a key
        return tuple(torch.zeros_like(x) for x in (q, k, v))
    return torch.autograd.grad(loss, (q, k, v), allow_unused=True, materialize_grads=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sparse", [False, True])
def test_backward_with_a_window_matches_reference_autograd(backend, sparse):
    """dq, dk, dv against float64 autograd through the reference loops; pages before the window get exact zeros."""
    page_size, W = 4, 5
    p = make_problem(6, batch=2, seq_lens=[22, 9], page_size=page_size, num_kv_heads=2, group=2, head_dim=8,
                     num_query_tokens=3, poison=1e30)
    idx = None
    if sparse:
        idx = torch.tensor([[[0, 3, 5], [4, 5, -1]], [[1, 2, -1], [0, 2, 1]]], dtype=torch.int32)
    got = grads(tinyattn, p, torch.float32, W, idx, backend)
    want = grads(reference, p, torch.float64, W, idx)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert not torch.isnan(a).any(), name
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4, msg=name)
    for b, n in enumerate(p.seq_lens.tolist()):                     # pages wholly before the window: no gradient
        for j in range((n - 3 - W) // page_size):
            page = int(p.block_table[b, j])
            assert (got[1][page] == 0).all() and (got[2][page] == 0).all()


@pytest.mark.parametrize("backend", SLOW_TRITON)
def test_backward_property_with_windows(backend):
    """Random ragged problems and windows (dense): gradients equal float64 reference autograd, never NaN."""
    @settings(max_examples={"torch": 15, "triton": 5}[backend], deadline=None)
    @given(data=st.data())
    def check(data):
        p = data.draw(problems(max_query_tokens=3, head_dims=(8,), max_pages_per_row=4, page_sizes=(1, 2, 4)))
        w = data.draw(windows(p.page_size))
        got = grads(tinyattn, p, torch.float32, w, backend=backend)
        want = grads(reference, p, torch.float64, w)
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            assert not torch.isnan(a).any(), name
            torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4, msg=name)

    check()


def test_gradcheck_torch_backend_with_a_window():
    p = make_problem(8, batch=2, seq_lens=[7, 5], page_size=2, num_kv_heads=1, group=2, head_dim=4,
                     num_query_tokens=2, extra_pages=0, spare_columns=0, poison=0.0)
    q, k, v = (x.double().requires_grad_() for x in (p.q, p.k_cache, p.v_cache))

    def f(q, k, v):
        return tinyattn.paged_attention(q, k, v, p.block_table, p.seq_lens, window_left=2, backend="torch")

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("backend,dtype", [("torch", torch.float64), ("triton", torch.float32)])
def test_opcheck_custom_ops_with_a_window(backend, dtype):
    """The custom ops' schema, fake kernels and autograd registration with the ``window_left`` argument."""
    from tinyattn.ops import custom_ops
    from tinyattn.ops.selection import torch_impl as selection_torch

    p = make_problem(14, batch=2, seq_lens=[7, 3], page_size=2, num_kv_heads=1, group=2, head_dim=8,
                     num_query_tokens=2, dtype=dtype, poison=0.5)
    pi = selection_torch.canonical_page_indices(torch.tensor([[[0, 2, 3]], [[1, -1, 0]]]), p.seq_lens, 2)
    q, k, v = (x.detach().clone().requires_grad_() for x in (p.q, p.k_cache, p.v_cache))
    for indices in (pi, None):
        torch.library.opcheck(custom_ops.paged_attention_fwd, (q, k, v, p.block_table, p.seq_lens, indices, 0.5, backend, 2))
    out, lse = custom_ops.paged_attention_fwd(q.detach(), k.detach(), v.detach(), p.block_table, p.seq_lens, pi, 0.5,
                                     backend, 2)
    torch.library.opcheck(custom_ops.paged_attention_bwd, (torch.randn_like(out), None, q.detach(), k.detach(), v.detach(),
                                                  p.block_table, p.seq_lens, pi, out, lse, 0.5, backend, 2))
