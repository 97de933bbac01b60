"""Half-precision page boxes (issue 10, item 2): rounded outward, the Quest bound stays an upper bound.

Expected values come from first principles: a rounded-down value must be ``<= x`` and its next representable
neighbour ``> x`` (the tightest such value); a box must contain every valid key of its page; the score of a page
must be ``>= max_t q.k_t`` computed in fp64 over the page's keys. An adversarial case (keys just above a bf16
value) shows that round-to-nearest would break the bound, so the direction is what the tests pin.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyattn
from tinyattn import reference
from tinyattn.cache import PagedKVCache
from tinyattn.ops import quant
from tinyattn.ops.kv_cache import torch_impl as boxes
from model_fixtures import model, tok  # noqa: F401  (module fixtures)
from paged_problems import make_problem, problems

NARROW = [torch.bfloat16, torch.float16]
INF = float("inf")


def _tightest(x: torch.Tensor, r: torch.Tensor, direction: float) -> None:
    """``r`` (narrow) is on the ``direction`` side of ``x`` (fp32) and its neighbour toward ``x`` is not."""
    wide, xs = r.double(), x.double()
    toward_x = torch.nextafter(r, torch.full_like(r, -direction * INF)).double()
    assert bool(((wide - xs) * direction >= 0).all())         # on the outward side (or equal)
    assert bool(((toward_x - xs) * direction < 0).all())      # one step back crosses x: the tightest


finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(st.lists(finite_f32, min_size=1, max_size=64), st.sampled_from(NARROW))
def test_round_down_up_are_tightest_outward(values, dtype):
    x = torch.tensor(values, dtype=torch.float32)
    _tightest(x, boxes.round_down(x, dtype), -1.0)
    _tightest(x, boxes.round_up(x, dtype), +1.0)


@pytest.mark.parametrize("dtype", NARROW)
def test_round_exact_values_and_specials(dtype):
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, 0.15625, INF, -INF]).to(dtype).float()
    assert torch.equal(boxes.round_down(exact, dtype).float(), exact)
    assert torch.equal(boxes.round_up(exact, dtype).float(), exact)
    nan = boxes.round_down(torch.tensor([float("nan")]), dtype)
    assert bool(nan.isnan().all())
    if dtype == torch.float16:                      # past fp16's range: still a bound
        big = torch.tensor([1e6, -1e6])
        assert boxes.round_up(big, dtype).tolist() == [INF, -65504.0]
        assert boxes.round_down(big, dtype).tolist() == [65504.0, -INF]


def test_wider_dtype_is_a_plain_cast():
    x = torch.randn(100).to(torch.bfloat16)
    assert torch.equal(boxes.round_down(x, torch.float32), x.float())


@pytest.mark.parametrize("box", ["bf16", "fp16"])
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_cache_boxes_contain_keys_and_are_tightest(box, kv):
    torch.manual_seed(0)
    cache = PagedKVCache(2, 2, 8, page_size=4, num_pages=12, box_dtype=box, kv_cache_dtype=kv)
    dtype = quant.BOX_DTYPES[box]
    seqs = [cache.add_sequence() for _ in range(3)]
    for step, n in enumerate([5, 1, 3, 1, 1]):      # prefill then small writes: incremental upkeep
        slots = cache.extend(seqs, n)
        for layer in range(2):
            k = torch.randn(len(seqs) * n, 2, 8) * 3 + 0.01 * step
            cache.write(layer, slots, k, torch.randn_like(k))
    table, lens = cache.block_table(seqs), cache.seq_lens(seqs)
    for layer in range(2):
        assert cache.k_min[layer].dtype == dtype
        keys = cache.k_cache[layer]
        if cache.quantized:
            keys = tinyattn.ops.quant.dequantize(keys, cache.k_scale[layer])
        lo = torch.full(cache.k_min[layer].shape, INF)
        hi = torch.full(cache.k_max[layer].shape, -INF)
        reference.update_page_metadata(keys.float(), table, lens, lo, hi)         # exact fp32 boxes
        used = torch.tensor(sorted({p for s in seqs for p in cache.pages(s)}))
        _tightest(lo[used], cache.k_min[layer][used], -1.0)
        _tightest(hi[used], cache.k_max[layer][used], +1.0)


@settings(max_examples=25, deadline=None)
@given(problems(dtypes=("fp32", "bf16", "fp16")), st.sampled_from(NARROW), st.sampled_from(["torch", "triton"]))
def test_update_page_metadata_narrow_boxes_match_reference(p, box, backend):
    if backend == "triton" and p.page_size & (p.page_size - 1):
        return
    shape = (p.k_cache.shape[0], p.num_kv_heads, p.k_cache.shape[3])
    want_lo, want_hi = torch.zeros(shape, dtype=box), torch.zeros(shape, dtype=box)
    reference.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, want_lo, want_hi)
    got_lo, got_hi = torch.zeros(shape, dtype=box), torch.zeros(shape, dtype=box)
    tinyattn.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, got_lo, got_hi, backend=backend)
    assert torch.equal(got_lo, want_lo) and torch.equal(got_hi, want_hi)


def _max_logit(p, magnitude: bool = False):
    """fp64 ``max_t q.k_t`` per (row, KV head, logical page), over the group's heads and the page's valid keys
    (and, with ``magnitude``, ``max_t |q|.|k_t|``: the scale of the fp32 rounding error of a score)."""
    B, Tq, Hq, D = p.q.shape
    Hkv, S = p.num_kv_heads, p.page_size
    out = torch.full((B, Hkv, p.block_table.shape[1]), -INF, dtype=torch.float64)
    mag = torch.zeros_like(out)
    for b in range(B):
        n = int(p.seq_lens[b])
        for j in range(-(-n // S)):
            keys = p.k_cache[int(p.block_table[b, j]), : min(S, n - j * S)].double()    # [t, Hkv, D]
            for h in range(Hkv):
                qg = p.q[b, :, h * (Hq // Hkv):(h + 1) * (Hq // Hkv)].double().reshape(-1, D)
                out[b, h, j] = (qg @ keys[:, h].T).max()
                mag[b, h, j] = (qg.abs() @ keys[:, h].abs().T).max()
    return (out, mag) if magnitude else out


@settings(max_examples=25, deadline=None)
@given(problems(dtypes=("fp32",)), st.sampled_from(NARROW), st.sampled_from(["torch", "triton"]))
def test_scores_over_narrow_boxes_bound_every_logit(p, box, backend):
    if backend == "triton" and p.page_size & (p.page_size - 1):
        return
    shape = (p.k_cache.shape[0], p.num_kv_heads, p.k_cache.shape[3])
    lo, hi = torch.zeros(shape, dtype=box), torch.zeros(shape, dtype=box)
    tinyattn.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, lo, hi, backend="torch")
    ub = tinyattn.page_scores(p.q, lo, hi, p.block_table, p.seq_lens, page_size=p.page_size, backend=backend)
    best, mag = _max_logit(p, magnitude=True)
    valid = best > -INF
    assert bool((ub.double()[valid] >= best[valid] - 1e-5 * mag[valid]).all())


@pytest.mark.parametrize("box", NARROW)
def test_adversarial_keys_nearest_rounding_would_break_the_bound(box):
    """Every key just above a representable value: round-to-nearest puts k_max below it, outward does not."""
    p = make_problem(3, batch=2, seq_lens=[9, 16], page_size=4, num_kv_heads=2, group=2, head_dim=8)
    base = p.k_cache.abs().to(box).float() + 1.0
    step = torch.nextafter(base.to(box), torch.full_like(base.to(box), INF)).float() - base
    p.k_cache = (base + 0.3 * step).contiguous()     # nearest rounds down, toward base
    p.q = p.q.abs()                                  # all products positive: the bound is q . k_max
    shape = (p.k_cache.shape[0], p.num_kv_heads, p.k_cache.shape[3])
    lo, hi = torch.zeros(shape, dtype=box), torch.zeros(shape, dtype=box)
    tinyattn.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, lo, hi)
    best = _max_logit(p)
    valid = best > -INF
    ub = tinyattn.page_scores(p.q, lo, hi, p.block_table, p.seq_lens, page_size=p.page_size, backend="torch")
    assert bool((ub.double()[valid] >= best[valid]).all())
    near_lo, near_hi = p.bounds()
    ub_near = tinyattn.page_scores(p.q, near_lo.to(box), near_hi.to(box), p.block_table, p.seq_lens,
                                   page_size=p.page_size, backend="torch")
    assert bool((ub_near.double()[valid] < best[valid]).any())      # the mutant the rounding rule prevents


def test_box_dtype_errors_name_the_option():
    with pytest.raises(ValueError, match="box_dtype: expected one of"):
        PagedKVCache(1, 1, 8, page_size=4, num_pages=2, box_dtype="int8")
    p = make_problem(0, batch=1, seq_lens=[5], page_size=4, num_kv_heads=1, group=1, head_dim=8)
    lo = torch.zeros(p.k_cache.shape[0], 1, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="k_max: expected the dtype of k_min"):
        tinyattn.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, lo, lo.float())
    with pytest.raises(TypeError, match="k_min: expected dtype"):
        tinyattn.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, lo.to(torch.float64), lo.double())


def test_runtime_decodes_with_bf16_boxes_and_counts_their_bytes(model, tok):
    from tinyattn.models import LlamaRuntime

    prompt = tok.encode("Once upon a time, there was a little girl named Lily. She liked to play", bos=True)
    runs = {}
    for box in ("auto", "bf16"):
        rt = LlamaRuntime(model, page_size=4, page_budget=3, backend="torch", box_dtype=box)
        runs[box] = rt.generate([prompt], max_new_tokens=12)
    assert len(runs["bf16"].tokens[0]) == 12
    cfg = model.config
    # decode steps see lengths len(prompt) + 1 ... len(prompt) + 11 (the first token comes from the prefill);
    # each sparse layer and KV head scores every page's two boxes: 2 bytes less per element with bf16
    lens = range(len(prompt) + 1, len(prompt) + 12)
    saved = sum(-(-n // 4) for n in lens) * 2 * cfg.head_dim * 2 * cfg.n_kv_heads * cfg.n_layers
    got = runs["auto"].stats.kv_bytes_read - runs["bf16"].stats.kv_bytes_read
    assert got == saved


def test_engine_and_hf_cache_take_box_dtype(model):
    from tinyattn.engine import Engine

    engine = Engine(model, page_size=4, num_pages=8, page_budget=2, backend="torch", box_dtype="bf16")
    assert engine.cache.k_min[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="box_dtype: expected one of"):
        Engine(model, page_size=4, num_pages=8, box_dtype="half")
    transformers = pytest.importorskip("transformers")
    TinyAttnCache = pytest.importorskip("tinyattn.integrations.hf").TinyAttnCache
    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=32)
    with pytest.raises(ValueError, match="box_dtype: expected one of"):
        TinyAttnCache(cfg, box_dtype="int8")
    assert TinyAttnCache(cfg, box_dtype="fp16").box_dtype == "fp16"
