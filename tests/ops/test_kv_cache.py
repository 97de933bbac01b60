"""The page pool's upkeep (``tinyattn/ops/kv_cache/``): page boxes recomputed and grown, their outward rounding, the KV
write on every format with int8 / fp8 scale growth, and the refit of a page after a cut.

Proven here, on the shared harness (tests/paged_problems.py) and on both backends (``torch``; ``triton`` under
TRITON_INTERPRET=1): ``update_page_metadata`` equals the reference bit for bit for every pool dtype and box dtype
(poisoned padding never leaks, pages no row holds keep their contents); narrow boxes are the tightest values on
the outward side of the keys (first principles: ``nextafter``), and round-to-nearest would break the Quest bound;
the KV write (torch form and Triton kernel) leaves every pool, box, scale and fill equal to the loop reference bit
for bit on poisoned pools over several growing steps, and touches nothing else; re-quantized pages keep the codes
past ``fill``, fp8 scales grow by exact powers of two, a page whose first token is tiny and a later one huge
keeps every token within one step of its final scale; the Triton write's host code allocates nothing and never
syncs (a CUDA graph can capture it); ``refit_page`` after a cut equals an independent re-quantization of the kept
tokens. Cut and rollback through the cache (truncate, fork, drop_pages, the HF crop, the engine's recompute):
tests/test_cache.py.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyattn
import tinyattn.reference as reference
from tinyattn.ops.kv_cache import reference as kv_cache_reference
from tinyattn.ops.kv_cache import torch_impl as kv_cache_torch
from tinyattn.ops import api, quant
from tinyattn import PagedKVCache

from paged_problems import (BACKENDS, QMAX, WRITE_BOXES, WRITE_FORMATS, make_problem, poisoned_pools, problems,
    take_page, tiers, write_steps)


NARROW = [torch.bfloat16, torch.float16]
INF = float("inf")


def _same(a, b) -> bool:
    """Equal as values, NaN equal to NaN (and -0 to 0); non-float tensors bit for bit."""
    if a is None or b is None:
        return a is b
    if not a.is_floating_point():
        return torch.equal(a, b)
    a, b = a.double(), b.double()
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _write(name, *args, **kwargs):
    """The KV write of ``name``: the loop reference, or the public write on a backend."""
    if name == "reference":
        return reference.write_kv(*args, **kwargs)
    return api.write_kv(*args, **kwargs, backend=name)


# ---- boxes recomputed from the keys --------------------------------------------------------------------------------
BOX_DTYPES = {"pool": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("backend, examples", [("torch", 40), ("triton", 6),
                                               pytest.param("triton", 19, marks=pytest.mark.slow)])
def test_update_page_metadata_matches_the_reference_for_every_box_dtype(backend, examples):
    """Pools of fp32 / fp16 / bf16, boxes of the pool's dtype, fp32 or a narrower one (rounded outward): equal to
    the reference bit for bit; min / max never round, poisoned slots never leak, pages no row holds keep 7.0."""
    @settings(max_examples=examples, deadline=None)
    @given(problems(dtypes=("fp32", "fp16", "bf16"), head_dims=(8, 16, 24, 40, 64, 80, 128),
                    page_sizes=(1, 2, 4, 8, 16, 32)), st.sampled_from(sorted(BOX_DTYPES)))
    def check(p, box):
        dtype = BOX_DTYPES[box] or p.k_cache.dtype
        shape = (p.k_cache.shape[0], p.num_kv_heads, p.k_cache.shape[3])
        got = [torch.full(shape, 7.0, dtype=dtype) for _ in range(2)]
        want = [t.clone() for t in got]
        tinyattn.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, *got, backend=backend)
        reference.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, *want)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        unused = [i for i in range(shape[0]) if i not in p.used_pages()]
        assert (got[0][unused] == 7.0).all() and (got[1][unused] == 7.0).all()

    check()


# ---- outward rounding of narrow boxes ------------------------------------------------------------------------------
def _tightest(x: torch.Tensor, r: torch.Tensor, direction: float) -> None:
    """``r`` (narrow) is on the ``direction`` side of ``x`` (fp32) and its neighbour toward ``x`` is not."""
    wide, xs = r.double(), x.double()
    toward_x = torch.nextafter(r, torch.full_like(r, -direction * INF)).double()
    assert bool(((wide - xs) * direction >= 0).all())         # on the outward side (or equal)
    assert bool(((toward_x - xs) * direction < 0).all())      # one step back crosses x: the tightest


ROUNDINGS = {"torch": (kv_cache_torch.round_down, kv_cache_torch.round_up),
             "reference": (lambda x, dtype: kv_cache_reference.outward(x, dtype, -1),
                           lambda x, dtype: kv_cache_reference.outward(x, dtype, +1))}
finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@pytest.mark.parametrize("form", sorted(ROUNDINGS))
@settings(max_examples=60, deadline=None)
@given(st.lists(finite_f32, min_size=1, max_size=64), st.sampled_from(NARROW))
def test_round_down_up_are_tightest_outward(form, values, dtype):
    """The torch form (``round_down`` / ``round_up``) and the reference (``outward``); the Triton form
    (``_round_out``) equals the reference in the update_page_metadata test above."""
    down, up = ROUNDINGS[form]
    x = torch.tensor(values, dtype=torch.float32)
    _tightest(x, down(x, dtype), -1.0)
    _tightest(x, up(x, dtype), +1.0)


@pytest.mark.parametrize("dtype", NARROW)
def test_round_exact_values_and_specials(dtype):
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, 0.15625, INF, -INF]).to(dtype).float()
    assert torch.equal(kv_cache_torch.round_down(exact, dtype).float(), exact)
    assert torch.equal(kv_cache_torch.round_up(exact, dtype).float(), exact)
    nan = kv_cache_torch.round_down(torch.tensor([float("nan")]), dtype)
    assert bool(nan.isnan().all())
    if dtype == torch.float16:                      # past fp16's range: still a bound
        big = torch.tensor([1e6, -1e6])
        assert kv_cache_torch.round_up(big, dtype).tolist() == [INF, -65504.0]
        assert kv_cache_torch.round_down(big, dtype).tolist() == [65504.0, -INF]


def test_wider_dtype_is_a_plain_cast():
    x = torch.randn(100).to(torch.bfloat16)
    assert torch.equal(kv_cache_torch.round_down(x, torch.float32), x.float())


@pytest.mark.parametrize("box", NARROW)
def test_adversarial_keys_nearest_rounding_would_break_the_bound(box):
    """Every key just above a representable value: round-to-nearest puts k_max below it, outward does not."""
    from paged_problems import max_logits

    p = make_problem(3, batch=2, seq_lens=[9, 16], page_size=4, num_kv_heads=2, group=2, head_dim=8)
    base = p.k_cache.abs().to(box).float() + 1.0
    step = torch.nextafter(base.to(box), torch.full_like(base.to(box), INF)).float() - base
    p.k_cache = (base + 0.3 * step).contiguous()     # nearest rounds down, toward base
    p.q = p.q.abs()                                  # all products positive: the bound is q . k_max
    shape = (p.k_cache.shape[0], p.num_kv_heads, p.k_cache.shape[3])
    lo, hi = torch.zeros(shape, dtype=box), torch.zeros(shape, dtype=box)
    tinyattn.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, lo, hi)
    best, _ = max_logits(p)
    valid = best > -INF
    ub = tinyattn.page_scores(p.q, lo, hi, p.block_table, p.seq_lens, page_size=p.page_size, backend="torch")
    assert bool((ub.double()[valid] >= best[valid]).all())
    near_lo, near_hi = p.bounds()
    ub_near = tinyattn.page_scores(p.q, near_lo.to(box), near_hi.to(box), p.block_table, p.seq_lens,
                                   page_size=p.page_size, backend="torch")
    assert bool((ub_near.double()[valid] < best[valid]).any())      # the mutant the rounding rule prevents


@pytest.mark.parametrize("box", ["bf16", "fp16"])
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_cache_boxes_grown_by_writes_contain_keys_and_are_tightest(box, kv):
    """A prefill then small writes (incremental growth): every used page's narrow box is the tightest outward
    rounding of the exact fp32 box of what the page holds (dequantized for int8)."""
    torch.manual_seed(0)
    cache = PagedKVCache(2, 2, 8, page_size=4, num_pages=12, box_dtype=box, kv_cache_dtype=kv)
    dtype = quant.BOX_DTYPES[box]
    seqs = [cache.add_sequence() for _ in range(3)]
    for step, n in enumerate([5, 1, 3, 1, 1]):
        slots = cache.extend(seqs, n)
        for layer in range(2):
            k = torch.randn(len(seqs) * n, 2, 8) * 3 + 0.01 * step
            cache.write(layer, slots, k, torch.randn_like(k))
    table, lens = cache.block_table(seqs), cache.seq_lens(seqs)
    for layer in range(2):
        assert cache.k_min[layer].dtype == dtype
        keys = cache.k_cache[layer]
        if cache.quantized:
            keys = keys.float() * cache.k_scale[layer][:, None, :, None]
        lo = torch.full(cache.k_min[layer].shape, INF)
        hi = torch.full(cache.k_max[layer].shape, -INF)
        reference.update_page_metadata(keys.float(), table, lens, lo, hi)         # exact fp32 boxes
        used = torch.tensor(sorted({p for s in seqs for p in cache.pages(s)}))
        _tightest(lo[used], cache.k_min[layer][used], -1.0)
        _tightest(hi[used], cache.k_max[layer][used], +1.0)


# ---- the KV write on every format ----------------------------------------------------------------------------------
@tiers(3, 40)
def test_triton_kernel_and_torch_form_equal_the_reference(examples):
    """Pools start full of poison; slots come from an extend()-like allocator over steps whose magnitudes grow
    (int8 / fp8 scales grow and pages are re-quantized). Every tensor the write touches equals the reference bit for
    bit (NaN equal to NaN); pages no write touches keep their poison bit for bit."""
    settings(max_examples=examples, deadline=None)(given(
        fmt=st.sampled_from(list(WRITE_FORMATS)), box=st.sampled_from(list(WRITE_BOXES)),
        page_size=st.sampled_from([1, 3, 4, 16]), hkv=st.integers(1, 3), d=st.sampled_from([3, 8, 16]),
        num_seqs=st.integers(1, 3), num_steps=st.integers(1, 3), k_fp32=st.booleans(), int32_slots=st.booleans(),
        seed=st.integers(0, 2**31 - 1))(_write_equals_the_reference))()


def _write_equals_the_reference(fmt, box, page_size, hkv, d, num_seqs, num_steps, k_fp32, int32_slots, seed):
    gen = torch.Generator().manual_seed(seed)
    num_pages = 6
    initial = poisoned_pools(gen, fmt, box, num_pages, page_size, hkv, d)
    dtype = WRITE_FORMATS[fmt]
    k_dtype = torch.float32 if (k_fp32 or quant.is_quantized(dtype)) else dtype
    states = {name: {k: (v.clone() if v is not None else None) for k, v in initial.items()}
              for name in ("reference", *BACKENDS)}
    touched: set[int] = set()
    for step, (slots, taken) in enumerate(write_steps(gen, num_pages, page_size, num_seqs, num_steps)):
        touched.update(taken)
        magnitude = 10.0 ** float(torch.randint(-2, 3, (1,), generator=gen)) * (4.0 ** step)
        k = (torch.randn(len(slots), hkv, d, generator=gen) * magnitude).to(k_dtype)
        v = (torch.randn(len(slots), hkv, d, generator=gen) * magnitude).to(k_dtype)
        if int32_slots:
            slots = slots.to(torch.int32)
        for name, state in states.items():
            for page in taken:
                take_page(state, page)
            _write(name, k, v, slots, **state)
    want = states["reference"]
    for name in BACKENDS:
        for key, value in states[name].items():
            assert _same(value, want[key]), f"{name}: {key} differs from the reference"
    untouched = [p for p in range(num_pages) if p not in touched]
    for key, value in want.items():
        if value is not None and key != "fill":
            assert _same(value[untouched], initial[key][untouched]), f"{key} of an untouched page moved"


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_quantized_slots_past_the_fill_keep_their_poison(fmt):
    """A re-quantized page rescales its valid slots only: stale codes past ``fill`` stay as they were."""
    gen = torch.Generator().manual_seed(3)
    for name in ("reference", *BACKENDS):
        state = poisoned_pools(gen, fmt, "auto", 2, 8, 2, 8)
        before = state["k_cache"].clone()
        take_page(state, 1)
        small = torch.full((3, 2, 8), 0.01)
        _write(name, small, small, torch.tensor([8, 9, 10]), **state)
        _write(name, small[:1] * 1000, small[:1] * 1000, torch.tensor([11]), **state)   # the scale grows: re-quantize
        assert int(state["fill"][1]) == 4
        assert state["k_cache"][1, 4:].view(torch.uint8).equal(before[1, 4:].view(torch.uint8)), name
        assert state["k_cache"][0].view(torch.uint8).equal(before[0].view(torch.uint8)), name
        values = state["k_cache"][1:, :4].float() * state["k_scale"][1:][:, None, :, None]
        assert torch.allclose(values[0, 3], torch.full((2, 8), 10.0), rtol=0.07), name    # stored, not clipped
        assert torch.allclose(values[0, :3], torch.full((3, 2, 8), 0.01), rtol=0.0, atol=10.0 / 127), name


def test_fp8_scale_grows_by_an_exact_power_of_two():
    """fp8: a scale grows by 2**ceil(log2(new / old)), also for ratios a rounding error above a power of two
    (``exp2(ceil(log2(r)))`` in fp32 could round such a ratio down and clip the new token)."""
    for name in ("reference", *BACKENDS):
        state = poisoned_pools(torch.Generator().manual_seed(0), "fp8_e4m3", "none", 1, 4, 1, 1)
        take_page(state, 0)
        _write(name, torch.tensor([[[448.0]]]), torch.tensor([[[448.0]]]), torch.tensor([0]), **state)
        assert state["k_scale"][0, 0] == 1.0
        big = torch.tensor(16.0).nextafter(torch.tensor(100.0)) * 448     # ratio 16 * (1 + 2**-23)
        _write(name, big.view(1, 1, 1), big.view(1, 1, 1), torch.tensor([1]), **state)
        assert state["k_scale"][0, 0] == 32.0, name
        assert math.isclose(float(state["k_cache"][0, 1, 0, 0].float() * 32.0), float(big), rel_tol=0.07), name


@pytest.mark.parametrize("fmt", sorted(QMAX))
@pytest.mark.parametrize("one_call", [False, True])
def test_worst_case_page_tiny_first_token_then_huge(fmt, one_call):
    """Through the cache: a page's first token is 1e-4, a later one 1e4: the page is re-quantized, nothing clips,
    the error of every token stays within one step of the final scale (two roundings), and the box is exact for
    the stored keys."""
    torch.manual_seed(0)
    page_size, Hkv, D = 8, 2, 16
    c = PagedKVCache(2, Hkv, D, page_size=page_size, num_pages=4, kv_cache_dtype=fmt)
    seq = c.add_sequence()
    k = torch.randn(page_size + 3, Hkv, D)
    k[0] *= 1e-4
    k[5] *= 1e4
    v = -2 * k
    if one_call:
        c.write(1, c.extend([seq], page_size + 3), k, v)
    else:
        for t in range(page_size + 3):
            c.write(1, c.extend([seq], 1), k[t:t + 1], v[t:t + 1])
    page0 = c.pages(seq)[0]
    for x, pool, scales in ((k, c.k_cache[1], c.k_scale[1]), (v, c.v_cache[1], c.v_scale[1])):
        scale = scales[page0]                                                           # [Hkv]
        exact = x[:page_size].abs().amax(dim=(0, 2)) / QMAX[fmt]
        if fmt == "int8" or one_call:
            torch.testing.assert_close(scale, exact)
        else:                          # fp8 grows by powers of two from the first token's scale
            assert (scale >= exact).all() and (scale < 2 * exact).all()
            ratio = torch.log2(scale / (x[0].abs().amax(-1) / QMAX[fmt]))
            torch.testing.assert_close(ratio, ratio.round(), atol=1e-5, rtol=0)
        got = pool[page0].float() * scale[None, :, None]                               # [S, Hkv, D]
        err = (got - x[:page_size]).abs()
        assert torch.isfinite(got).all()
        rel = 1 / 127 if fmt == "int8" else 2 ** -3                                     # grid spacing / qmax
        step = scale[None, :, None] * (1.0 if fmt == "int8" else 448 * rel)
        assert (err <= step * (1.0 if not one_call else 0.5) + 1e-6).all()
        if fmt == "int8":                                # the huge token: rounded once, on the final scale
            assert (err[5] <= 0.5 * scale[:, None] * (1 + 1e-5)).all()
        else:                                            # e4m3: half a spacing (3 mantissa bits), subnormals
            assert (err[5] <= x[5].abs() * 2 ** -4 + scale[:, None] * 2 ** -9 + 1e-6).all()
    keys = torch.cat([c.k_cache[1][p].float() * c.k_scale[1][p][None, :, None] for p in c.pages(seq)])[:page_size + 3]
    for j, p in enumerate(c.pages(seq)):
        page_keys = keys[j * page_size:(j + 1) * page_size]
        assert torch.equal(c.k_min[1][p], page_keys.amin(0))
        assert torch.equal(c.k_max[1][p], page_keys.amax(0))


@pytest.mark.parametrize("kv_cache_dtype,box_dtype", [
    ("auto", "auto"), *(pytest.param(*c, marks=pytest.mark.slow) for c in [("bf16", "bf16"), ("int8", "auto"),
                                                                           ("fp8_e4m3", "bf16")])])
def test_cache_write_with_the_triton_backend_equals_the_cpu_path(kv_cache_dtype, box_dtype):
    """PagedKVCache.write(backend="triton") (what CUDA runs) leaves the same cache as the default CPU path over a
    prefill and decode steps of three sequences (pages taken from the free list, boxes reset on allocation)."""
    caches = [PagedKVCache(2, 2, 8, page_size=4, num_pages=12, kv_cache_dtype=kv_cache_dtype, box_dtype=box_dtype)
              for _ in range(2)]
    gen = torch.Generator().manual_seed(1)
    seqs = [[c.add_sequence() for _ in range(3)] for c in caches]
    for step, count in enumerate([5, 1, 1, 1, 1]):
        kv = [torch.randn(3 * count, 2, 8, generator=gen) * (1 + step) for _ in range(4)]
        for cache, ids in zip(caches, seqs):
            slots = cache.extend(ids, count)
            for layer in range(2):
                cache.write(layer, slots, kv[2 * layer], kv[2 * layer + 1],
                            backend="triton" if cache is caches[1] else None)
    a, b = caches
    for name in ("k_cache", "v_cache", "k_min", "k_max", "k_scale", "v_scale"):
        for x, y in zip(getattr(a, name), getattr(b, name)):
            assert _same(x, y), name
    assert torch.equal(a._fill, b._fill)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_triton_path_host_code_allocates_nothing_and_never_syncs(monkeypatch, fmt):
    """What a CUDA graph needs of the write: the launcher's host code allocates no tensor and reads no device
    value (``item`` / ``tolist`` / ``cpu`` / ``bool`` raise here); the launch itself is stubbed out."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tinyattn.ops.kv_cache import triton_impl as kernel_module

    launches = []

    class Stub:
        def __getitem__(self, grid):
            return lambda **kwargs: launches.append((grid, kwargs))

    monkeypatch.setattr(kernel_module, "kv_write_kernel", Stub())
    state = poisoned_pools(torch.Generator().manual_seed(0), fmt, "auto", 8, 16, 2, 8)
    k = torch.randn(3, 2, 8)
    slots = torch.tensor([0, 17, 40])

    class Allocations(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.returns and "Tensor" in str(func._schema.returns[0].type) \
                    and not func._schema.returns[0].alias_info:
                Allocations.count += 1
            return func(*args, **(kwargs or {}))

    def no_sync(*args, **kwargs):
        raise AssertionError("host sync in the write path")

    for name in ("item", "tolist", "cpu", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    with Allocations():
        api.write_kv(k, k, slots, **state, backend="triton")
    monkeypatch.undo()
    assert Allocations.count == 0 and len(launches) == 1 and launches[0][0] == (3, 2)


# ---- refit after a cut -------------------------------------------------------------------------------------------
def _qdq(x, fmt, scale):
    """Plain-torch quantize-dequantize of ``x`` [n, Hkv, D] with one scale per head."""
    s = scale[None, :, None]
    y = x / s.clamp_min(torch.finfo(torch.float32).tiny)
    y = y.round().clamp(-127, 127) if fmt == "int8" else y.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return y * s


@pytest.mark.parametrize("fmt", sorted(QMAX))
@pytest.mark.parametrize("box", ["none", "auto", "bf16"])
@pytest.mark.parametrize("valid", [1, 3, 7])
def test_refit_page_after_a_cut(fmt, box, valid):
    """``refit_page`` keeps the first ``valid`` slots of a page written with tokens 100x larger after them. int8: the
    scale becomes ``absmax / 127`` of the kept values and each code is re-rounded onto it (an independent
    quantize-dequantize here); fp8: the scale shrinks by the largest power of two that still holds them, so the kept
    values do not move. Other pages, and slots past ``valid``, keep their codes; the box is the (outward-rounded)
    box of the kept keys, recomputed."""
    gen = torch.Generator().manual_seed(valid)
    Hkv, D, page_size = 2, 16, 8
    state = poisoned_pools(gen, fmt, box, 3, page_size, Hkv, D)
    take_page(state, 1)
    x = torch.randn(page_size, Hkv, D, generator=gen)
    x[valid:] *= 100.0
    reference.write_kv(x, -x, torch.arange(page_size, 2 * page_size), **state)               # page 1, full
    before = {k: v.clone() for k, v in state.items() if v is not None}
    kept = [state[pool][1, :valid].float() * state[scale][1][None, :, None]
            for pool, scale in (("k_cache", "k_scale"), ("v_cache", "v_scale"))]
    old_scales = state["k_scale"][1].clone(), state["v_scale"][1].clone()
    kv_cache_torch.refit_page(state["k_cache"], state["v_cache"], state["k_min"], state["k_max"], state["k_scale"],
                              state["v_scale"], 1, valid)
    for pool, scale, values, old in zip(("k_cache", "v_cache"), ("k_scale", "v_scale"), kept, old_scales):
        absmax = values.abs().amax(dim=(0, 2)) if valid else torch.zeros(Hkv)
        if fmt == "int8":
            want_scale = absmax / 127
        else:
            shrink = 2.0 ** torch.floor(torch.log2(448 * old / absmax)).clamp_min(0)
            want_scale = torch.where(absmax > 0, old / shrink, 0.0)
        torch.testing.assert_close(state[scale][1], want_scale, rtol=1e-6, atol=0)
        got = state[pool][1, :valid].float() * state[scale][1][None, :, None]
        torch.testing.assert_close(got, _qdq(values, fmt, want_scale), rtol=1e-6, atol=1e-7)
        if fmt == "fp8_e4m3":
            torch.testing.assert_close(got, values, rtol=0, atol=0)              # a power-of-two rescale: exact
        assert state[pool][1, valid:].view(torch.uint8).equal(before[pool][1, valid:].view(torch.uint8))
        for page in (0, 2):
            assert state[pool][page].view(torch.uint8).equal(before[pool][page].view(torch.uint8))
            assert _same(state[scale][page], before[scale][page])
    if state["k_min"] is not None and valid:
        keys = state["k_cache"][1, :valid].float() * state["k_scale"][1][None, :, None]
        lo, hi = torch.full_like(state["k_min"], INF), torch.full_like(state["k_max"], -INF)
        reference.update_page_metadata(keys[None].expand(3, -1, -1, -1).contiguous(),
                                       torch.tensor([[1]]), torch.tensor([valid]), lo, hi)
        assert torch.equal(state["k_min"][1], lo[1]) and torch.equal(state["k_max"][1], hi[1])
        assert _same(state["k_min"][0], before["k_min"][0]) and _same(state["k_max"][2], before["k_max"][2])
