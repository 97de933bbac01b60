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
from model_fixtures import model, tok  # noqa: F401  (module fixtures)
from paged_problems import problems

NARROW = [torch.bfloat16, torch.float16]
INF = float("inf")


finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


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
