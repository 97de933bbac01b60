"""Boxes never filled (issue 28, item 6): with value checks on, ``sparse_paged_attention`` refuses page boxes that
cannot be the pages' bounding boxes (``k_min > k_max`` in some channel, NaN, or not holding a page's first key),
naming ``k_min``/``k_max`` and ``update_page_metadata``, on both backends; with checks off it does not look."""

from __future__ import annotations

import pytest
import torch

import tinyattn
from tinyattn.cache import PagedKVCache

BACKENDS = ["torch", "triton"]          # triton runs in the CPU interpreter (TRITON_INTERPRET=1, conftest.py)
MESSAGE = r"k_min, k_max: .*update_page_metadata"


def _problem(seed=0):
    """The README's snippet, small: 1 row of 40 tokens in pages of 8, 2 KV heads, 4 query heads, D=16."""
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = torch.randn(6, 8, 2, 16, generator=g), torch.randn(6, 8, 2, 16, generator=g)
    block_table = torch.tensor([[4, 0, 2, 5, 1]], dtype=torch.int32)
    seq_lens = torch.tensor([40], dtype=torch.int32)
    q = torch.randn(1, 4, 16, generator=g)
    return q, k_cache, v_cache, block_table, seq_lens


def _call(backend, q, k_cache, v_cache, block_table, seq_lens, k_min, k_max, **kw):
    return tinyattn.sparse_paged_attention(q, k_cache, v_cache, block_table, seq_lens, k_min=k_min, k_max=k_max,
                                           page_budget=2, backend=backend, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fill", ["empty_inf", "nan", "reversed", "zeros"])
def test_unfilled_boxes_raise_naming_update_page_metadata(backend, fill):
    """``torch.full(inf)`` / ``-inf`` (a fresh PagedKVCache box), NaN, ``k_min > k_max`` and never-filled zeros
    (what ``torch.empty`` often returns) all raise the one ValueError."""
    q, k_cache, v_cache, bt, sl = _problem()
    k_min, k_max = torch.empty(6, 2, 16), torch.empty(6, 2, 16)
    tinyattn.update_page_metadata(k_cache, bt, sl, k_min, k_max)
    page, head, ch = 2, 1, 5                                     # physical page 2 is in use (logical page 2)
    if fill == "empty_inf":
        k_min[page], k_max[page] = float("inf"), float("-inf")
    elif fill == "nan":
        k_min[page, head, ch] = float("nan")
    elif fill == "reversed":
        k_min[page, head, ch], k_max[page, head, ch] = k_max[page, head, ch] + 1, k_min[page, head, ch]
    else:
        k_min.zero_(), k_max.zero_()
    with pytest.raises(ValueError, match=MESSAGE) as err:
        _call(backend, q, k_cache, v_cache, bt, sl, k_min, k_max)
    if fill != "zeros":
        assert f"physical page {page}" in str(err.value)
    if fill in ("nan", "reversed"):
        assert f"KV head {head}, channel {ch}" in str(err.value)
    with tinyattn.value_checks(False):                          # skipped when the checks are off
        _call(backend, q, k_cache, v_cache, bt, sl, k_min, k_max)


@pytest.mark.parametrize("backend", BACKENDS)
def test_filled_boxes_pass_and_pages_not_in_use_are_not_read(backend):
    """Exact boxes pass; a page past every row's end may hold anything (its box is never scored)."""
    q, k_cache, v_cache, bt, sl = _problem()
    k_min, k_max = torch.empty(6, 2, 16), torch.empty(6, 2, 16)
    tinyattn.update_page_metadata(k_cache, bt, sl, k_min, k_max)
    k_min[3], k_max[3] = float("nan"), float("-inf")             # physical page 3: not in the block table
    out = _call(backend, q, k_cache, v_cache, bt, sl, k_min, k_max)
    ref = tinyattn.reference.sparse_paged_attention(q, k_cache, v_cache, bt, sl, k_min=k_min, k_max=k_max,
                                                    page_budget=2)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


# fp8 pools run on the torch backend or on sm_89+ GPUs (docs/api.md): not under the interpreter
@pytest.mark.parametrize("backend, fmt", [("torch", "int8"), ("triton", "int8"), ("torch", "fp8_e4m3")])
def test_quantized_cache_boxes_pass_and_a_stale_box_raises(backend, fmt):
    """A quantized PagedKVCache's boxes (of the dequantized keys) pass; reset one page's box (in place, after a
    call that passed: the checked-call memo must not hide it) and the call raises."""
    c = PagedKVCache(1, 2, 16, page_size=8, num_pages=6, kv_cache_dtype=fmt)
    seq = c.add_sequence()
    g = torch.Generator().manual_seed(1)
    c.write(0, c.extend([seq], 30), torch.randn(30, 2, 16, generator=g) * 3, torch.randn(30, 2, 16, generator=g))
    q = torch.randn(1, 4, 16, generator=g)
    bt, sl = c.block_table([seq]), c.seq_lens([seq])
    kw = dict(k_scale=c.k_scale[0], v_scale=c.v_scale[0])
    _call(backend, q, c.k_cache[0], c.v_cache[0], bt, sl, c.k_min[0], c.k_max[0], **kw)
    c.k_min[0][c.pages(seq)[1]], c.k_max[0][c.pages(seq)[1]] = float("inf"), float("-inf")
    with pytest.raises(ValueError, match=MESSAGE):
        _call(backend, q, c.k_cache[0], c.v_cache[0], bt, sl, c.k_min[0], c.k_max[0], **kw)


def test_the_check_runs_again_only_after_a_write():
    """A pass is remembered per (boxes, tables) until a torch in-place write touches one of them."""
    from tinyattn.ops import validation as V

    q, k_cache, v_cache, bt, sl = _problem()
    k_min, k_max = torch.empty(6, 2, 16), torch.empty(6, 2, 16)
    tinyattn.update_page_metadata(k_cache, bt, sl, k_min, k_max)
    V.check_boxes_filled(k_min, k_max, k_cache, bt, sl, 8)
    saved = k_min.clone()
    k_min.data[2] = float("inf")             # through .data: no version bump, so the pass is (knowingly) recalled
    V.check_boxes_filled(k_min, k_max, k_cache, bt, sl, 8)
    k_min.copy_(saved)                       # an in-place torch write: checked again, and passes
    V.check_boxes_filled(k_min, k_max, k_cache, bt, sl, 8)
    k_min[2] = float("inf")
    with pytest.raises(ValueError, match=MESSAGE):
        V.check_boxes_filled(k_min, k_max, k_cache, bt, sl, 8)
