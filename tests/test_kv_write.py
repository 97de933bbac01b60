"""The KV write op (issue 26, item 2): the fused Triton kernel (interpreter) and the torch twin against the loop
reference ``tinyattn.reference.write_kv``, for every KV format and box dtype, on poisoned pools.

Pools start full of poison (NaN / huge floats, random int8 / fp8 codes, NaN boxes and scales): slots and pages no
write touches must keep it bit for bit, and everything a write touches must equal the reference bit for bit (NaN
equal to NaN, -0 equal to 0). Slots come from a small page allocator that behaves like ``PagedKVCache.extend``
(pages from a shuffled free list, each page filled from offset 0), over several steps whose magnitudes grow, so
that int8 / fp8 scales grow and pages are re-quantized.
"""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import tinyattn.reference as reference
from tinyattn import PagedKVCache
from tinyattn.ops import api as kv_write, quant

FORMATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8,
           "fp8_e4m3": torch.float8_e4m3fn}
BOXES = {"none": None, "auto": "auto", "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BACKENDS = ("torch", "triton")


def _same(a, b) -> bool:
    """Equal as values, NaN equal to NaN (and -0 to 0); non-float tensors bit for bit."""
    if a is None or b is None:
        return a is b
    if not a.is_floating_point():
        return torch.equal(a, b)
    a, b = a.double(), b.double()
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _poisoned_state(gen, fmt, box, num_pages, page_size, hkv, d):
    dtype = FORMATS[fmt]
    shape = (num_pages, page_size, hkv, d)
    if dtype == torch.int8:
        pools = [torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8) for _ in range(2)]
    elif dtype == torch.float8_e4m3fn:          # every byte, NaN codes (0x7f, 0xff) included
        pools = [torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dtype) for _ in range(2)]
    else:
        pools = []
        for _ in range(2):
            x = torch.randn(shape, generator=gen) * 3
            pick = torch.rand(shape, generator=gen)
            x = torch.where(pick < 0.3, float("nan"), torch.where(pick < 0.5, torch.finfo(dtype).max, x))
            pools.append(x.to(dtype))
    box_dtype = BOXES[box]
    if box_dtype == "auto":
        box_dtype = torch.float32 if quant.is_quantized(dtype) else dtype
    k_min = k_max = None
    if box_dtype is not None:
        k_min = torch.where(torch.rand(num_pages, hkv, d, generator=gen) < 0.5, float("nan"), 1e30).to(box_dtype)
        k_max = torch.where(torch.rand(num_pages, hkv, d, generator=gen) < 0.5, float("nan"), -1e30).to(box_dtype)
    scales = fill = None
    if quant.is_quantized(dtype):
        scales = [torch.where(torch.rand(num_pages, hkv, generator=gen) < 0.5, float("nan"), 7.0) for _ in range(2)]
        fill = torch.full((num_pages,), 99, dtype=torch.int64)
    return dict(k_cache=pools[0], v_cache=pools[1], k_min=k_min, k_max=k_max,
                k_scale=scales[0] if scales else None, v_scale=scales[1] if scales else None, fill=fill)


def _take_page(state, page):
    """What ``PagedKVCache._take_page`` does: an empty box, a zero scale, no valid slot (K/V keep their poison)."""
    if state["k_min"] is not None:
        state["k_min"][page] = float("inf")
        state["k_max"][page] = float("-inf")
    if state["fill"] is not None:
        state["k_scale"][page] = state["v_scale"][page] = 0.0
        state["fill"][page] = 0


def _steps(gen, num_pages, page_size, num_seqs, num_steps):
    """Per step: the slots (extend()-like: sequence after sequence, token order) and the pages taken first."""
    free = torch.randperm(num_pages, generator=gen).tolist()
    pages = [[] for _ in range(num_seqs)]
    lens = [0] * num_seqs
    out = []
    for _ in range(num_steps):
        slots, taken = [], []
        for s in range(num_seqs):
            count = int(torch.randint(0, 2 * page_size + 2, (1,), generator=gen))
            need = -(-(lens[s] + count) // page_size) - len(pages[s])
            if need > len(free):
                continue
            for _ in range(need):
                pages[s].append(free.pop())
                taken.append(pages[s][-1])
            slots += [pages[s][t // page_size] * page_size + t % page_size for t in range(lens[s], lens[s] + count)]
            lens[s] += count
        out.append((torch.tensor(slots, dtype=torch.int64), taken))
    return out


def _clone(state):
    return {k: (v.clone() if v is not None else None) for k, v in state.items()}


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(list(FORMATS)), box=st.sampled_from(list(BOXES)), page_size=st.sampled_from([1, 3, 4, 16]),
       hkv=st.integers(1, 3), d=st.sampled_from([3, 8, 16]), num_seqs=st.integers(1, 3), num_steps=st.integers(1, 3),
       k_fp32=st.booleans(), int32_slots=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_triton_kernel_and_torch_twin_equal_the_reference(fmt, box, page_size, hkv, d, num_seqs, num_steps, k_fp32,
                                                          int32_slots, seed):
    gen = torch.Generator().manual_seed(seed)
    num_pages = 6
    initial = _poisoned_state(gen, fmt, box, num_pages, page_size, hkv, d)
    dtype = FORMATS[fmt]
    k_dtype = torch.float32 if (k_fp32 or quant.is_quantized(dtype)) else dtype
    states = {name: _clone(initial) for name in ("reference", *BACKENDS)}
    touched: set[int] = set()
    for step, (slots, taken) in enumerate(_steps(gen, num_pages, page_size, num_seqs, num_steps)):
        touched.update(taken)
        magnitude = 10.0 ** float(torch.randint(-2, 3, (1,), generator=gen)) * (4.0 ** step)
        k = (torch.randn(len(slots), hkv, d, generator=gen) * magnitude).to(k_dtype)
        v = (torch.randn(len(slots), hkv, d, generator=gen) * magnitude).to(k_dtype)
        if int32_slots:
            slots = slots.to(torch.int32)
        for name, state in states.items():
            for page in taken:
                _take_page(state, page)
            fn = reference.write_kv if name == "reference" else kv_write.write_kv
            extra = {} if name == "reference" else {"backend": name}
            fn(k, v, slots, **state, **extra)
    want = states["reference"]
    for name in BACKENDS:
        for key, value in states[name].items():
            assert _same(value, want[key]), f"{name}: {key} differs from the reference"
    # nothing outside the written pages moved: untouched pages keep their poison bit for bit
    untouched = [p for p in range(num_pages) if p not in touched]
    for key, value in want.items():
        if value is not None and key != "fill":
            assert _same(value[untouched], initial[key][untouched]), f"{key} of an untouched page moved"


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_quantized_slots_past_the_fill_keep_their_poison(fmt):
    """A re-quantized page rescales its valid slots only: stale codes past ``fill`` stay as they were."""
    gen = torch.Generator().manual_seed(3)
    for name in ("reference", *BACKENDS):
        state = _poisoned_state(gen, fmt, "auto", 2, 8, 2, 8)
        before = state["k_cache"].clone()
        _take_page(state, 1)
        fn = reference.write_kv if name == "reference" else kv_write.write_kv
        extra = {} if name == "reference" else {"backend": name}
        small = torch.full((3, 2, 8), 0.01)
        fn(small, small, torch.tensor([8, 9, 10]), **state, **extra)
        fn(small[:1] * 1000, small[:1] * 1000, torch.tensor([11]), **state, **extra)   # the scale grows: re-quantize
        assert int(state["fill"][1]) == 4
        assert state["k_cache"][1, 4:].view(torch.uint8).equal(before[1, 4:].view(torch.uint8)), name
        assert state["k_cache"][0].view(torch.uint8).equal(before[0].view(torch.uint8)), name
        values = quant.dequantize(state["k_cache"][1:, :4], state["k_scale"][1:])
        assert torch.allclose(values[0, 3], torch.full((2, 8), 10.0), rtol=0.07), name    # stored, not clipped
        assert torch.allclose(values[0, :3], torch.full((3, 2, 8), 0.01), rtol=0.0, atol=10.0 / 127), name


def test_fp8_scale_grows_by_an_exact_power_of_two():
    """fp8: a scale grows by 2**ceil(log2(new / old)), also for ratios a rounding error above a power of two
    (``exp2(ceil(log2(r)))`` in fp32 could round such a ratio down and clip the new token)."""
    for name in ("reference", *BACKENDS):
        state = _poisoned_state(torch.Generator().manual_seed(0), "fp8_e4m3", "none", 1, 4, 1, 1)
        _take_page(state, 0)
        fn = reference.write_kv if name == "reference" else kv_write.write_kv
        extra = {} if name == "reference" else {"backend": name}
        fn(torch.tensor([[[448.0]]]), torch.tensor([[[448.0]]]), torch.tensor([0]), **state, **extra)
        assert state["k_scale"][0, 0] == 1.0
        big = torch.tensor(16.0).nextafter(torch.tensor(100.0)) * 448     # ratio 16 * (1 + 2**-23)
        fn(big.view(1, 1, 1), big.view(1, 1, 1), torch.tensor([1]), **state, **extra)
        assert state["k_scale"][0, 0] == 32.0, name
        assert math.isclose(float(state["k_cache"][0, 1, 0, 0].float() * 32.0), float(big), rel_tol=0.07), name


@pytest.mark.parametrize("kv_cache_dtype,box_dtype", [("auto", "auto"), ("bf16", "bf16"), ("int8", "auto"),
                                                      ("fp8_e4m3", "bf16")])
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


def test_write_kv_names_bad_arguments():
    pool = torch.zeros(4, 2, 1, 8)
    k = torch.zeros(3, 1, 8)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="k: expected shape"):
        kv_write.write_kv(k[:2], k, slots, pool, pool.clone())
    with pytest.raises(TypeError, match="slots"):
        kv_write.write_kv(k, k, slots.float(), pool, pool.clone())
    with pytest.raises(ValueError, match="v_cache"):
        kv_write.write_kv(k, k, slots, pool, pool.half())
    with pytest.raises(ValueError, match="k_scale"):
        kv_write.write_kv(k, k, slots, pool.to(torch.int8), pool.to(torch.int8))
    with pytest.raises(ValueError, match="backend"):
        kv_write.write_kv(k, k, slots, pool, pool.clone(), backend="cuda")


def test_default_backend_is_torch_on_the_cpu_even_when_interpreting():
    """The CPU write path stays the torch one (bit-identical CPU behaviour); Triton is the default on CUDA."""
    assert kv_write.resolve_write_backend(None, torch.device("cpu")) == "torch"
    assert kv_write.resolve_write_backend(None, torch.device("cuda")) == "triton"


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
    state = _poisoned_state(torch.Generator().manual_seed(0), fmt, "auto", 8, 16, 2, 8)
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
        kv_write.write_kv(k, k, slots, **state, backend="triton")
    monkeypatch.undo()
    assert Allocations.count == 0 and len(launches) == 1 and launches[0][0] == (3, 2)
