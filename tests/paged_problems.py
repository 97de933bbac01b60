"""The shared harness of the ops tests: random paged-attention problems (hypothesis strategies and builders).

Every problem is built so that the right answer depends only on ``seq_lens`` and the valid slots: unused slots of
partial pages, unused pages of the pool and table entries past each row's end hold garbage (NaN, 1e30, -1, huge
ids), as CASES.md kinds 1 and 5 ask. :func:`problems` draws ragged rows around page boundaries (0, 1, page_size - 1,
page_size, page_size + 1, 2 * page_size, Tq), shuffled or in-order page tables, spare table columns, poisoned slots,
GQA ratios 1-4, head dims that are not powers of two and the dtypes asked for. The rule files (tests/ops/
test_kv_cache.py, test_selection.py, test_attention.py) and the other ops tests draw from here, so one harness
feeds the reference, the torch form and the Triton form alike.

Also here: the score tables of the selection (:func:`selection_scores`), sliding windows (:func:`windows`), listed
pages (:func:`random_page_indices`), non-contiguous layouts (:func:`relayout`), int8 / fp8 pools
(:func:`quantize_problem`), poisoned pools and slot streams for the KV write (:func:`poisoned_pools`,
:func:`write_steps`), and fp64 facts computed without tinyattn (:func:`contiguous_kv`, :func:`max_logits`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import assume
from hypothesis import strategies as st

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}
BACKENDS = ["torch", "triton"]          # triton runs in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
# for tests whose Triton case takes over ~3 s in the interpreter: the torch case stays in the fast tier
SLOW_TRITON = ["torch", pytest.param("triton", marks=pytest.mark.slow)]
QUANTIZED = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}


@dataclass
class Problem:
    q: torch.Tensor            # [B, Tq, Hq, D]
    k_cache: torch.Tensor      # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor     # [B] int32
    page_size: int

    @property
    def num_kv_heads(self) -> int:
        return self.k_cache.shape[2]

    @property
    def args(self):
        """``(q, k_cache, v_cache, block_table, seq_lens)``: the positional arguments of the attention ops."""
        return self.q, self.k_cache, self.v_cache, self.block_table, self.seq_lens

    def num_valid_pages(self, b: int) -> int:
        return -(-int(self.seq_lens[b]) // self.page_size)

    def bounds(self, dtype=torch.float32):
        """Exact page bounding boxes from the reference (fp32 unless ``dtype`` says otherwise)."""
        from tinyattn import reference
        shape = (self.k_cache.shape[0], self.num_kv_heads, self.k_cache.shape[3])
        k_min = torch.zeros(shape, dtype=dtype)
        k_max = torch.zeros(shape, dtype=dtype)
        reference.update_page_metadata(self.k_cache, self.block_table, self.seq_lens, k_min, k_max)
        return k_min, k_max

    def used_pages(self) -> list[int]:
        """Physical pages some row holds."""
        return sorted({int(self.block_table[b, j]) for b in range(self.block_table.shape[0])
                       for j in range(self.num_valid_pages(b))})


def make_problem(seed: int, *, batch: int, seq_lens: list[int], page_size: int, num_kv_heads: int, group: int,
                 head_dim: int, num_query_tokens: int = 1, dtype=torch.float32, extra_pages: int = 3,
                 poison: float = float("nan"), spare_columns: int = 1, logit_scale: float = 1.0,
                 in_order: bool = False) -> Problem:
    """``in_order``: each row's pages follow each other in the pool, from a random first page (as
    :class:`tinyattn.PagedKVCache` allocates a sequence), instead of a random permutation."""
    g = torch.Generator().manual_seed(seed)
    n_pages = [-(-n // page_size) for n in seq_lens]
    max_pages = max(n_pages + [1]) + spare_columns
    num_pages = sum(n_pages) + extra_pages
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=g) * logit_scale
    v = torch.randn(shape, generator=g)
    # poison every slot no row owns; owned slots are re-filled below
    perm = torch.randperm(num_pages, generator=g)
    if in_order:
        perm = torch.roll(torch.arange(num_pages), -int(torch.randint(0, extra_pages + 1, (1,), generator=g)))
    block_table = torch.full((batch, max_pages), -1, dtype=torch.int32)
    owned = torch.zeros(num_pages, page_size, dtype=torch.bool)
    start = 0
    for b, (n, p) in enumerate(zip(seq_lens, n_pages)):
        pages = perm[start:start + p]
        start += p
        block_table[b, :p] = pages.to(torch.int32)
        for j, page in enumerate(pages.tolist()):
            owned[page, : min(page_size, n - j * page_size)] = True
        # garbage past the row's end: out-of-range ids and -1
        if max_pages > p:
            block_table[b, p:] = torch.randint(-1, num_pages + 1000, (max_pages - p,), generator=g).to(torch.int32)
    k[~owned] = poison
    v[~owned] = poison
    q = torch.randn(batch, num_query_tokens, num_kv_heads * group, head_dim, generator=g)
    return Problem(q.to(dtype), k.to(dtype), v.to(dtype), block_table, torch.tensor(seq_lens, dtype=torch.int32),
                   page_size)


def empty_batch(head_dim=8, num_q_heads=2, num_kv_heads=1, page_size=4, num_pages=3):
    """B = 0: ``(q, k_cache, v_cache, block_table, seq_lens)`` with no rows (legal by DESIGN.md §2)."""
    q = torch.randn(0, num_q_heads, head_dim)
    k = torch.randn(num_pages, page_size, num_kv_heads, head_dim)
    v = torch.randn(num_pages, page_size, num_kv_heads, head_dim)
    bt = torch.zeros(0, 2, dtype=torch.int32)
    sl = torch.zeros(0, dtype=torch.int32)
    return q, k, v, bt, sl


def tiers(fast: int, full: int):
    """Parametrize a property test's ``examples``: ``fast`` hypothesis examples in the fast tier (``-m "not slow"``)
    and the other ``full - fast`` marked slow, so a whole run draws ``full`` (the test sets
    ``settings(max_examples=examples)`` on an inner ``@given`` function)."""
    return pytest.mark.parametrize("examples", [pytest.param(fast, id="fast"),
                                                pytest.param(full - fast, id="more", marks=pytest.mark.slow)])


def two_pages(page_size: int) -> int:
    """``max_query_tokens=two_pages``: prefill chunks of up to two pages (queries that span a page boundary)."""
    return 2 * page_size


def _per_page_size(value, page_size: int) -> int:
    return value(page_size) if callable(value) else value


@st.composite
def problems(draw, dtypes=("fp32",), max_batch=3, max_pages_per_row=6, head_dims=(8, 16, 24, 40, 64),
             page_sizes=(1, 2, 4, 8, 16), max_query_tokens=1, min_batch=1, distinct_lengths=False, max_kv_heads=3,
             groups=(1, 2, 3, 4), poisons=(float("nan"), 1e30, -1e30)):
    """A :func:`make_problem` with every size drawn. ``max_query_tokens`` and ``max_pages_per_row`` are ints or
    functions of the page size (:func:`two_pages`); ``distinct_lengths`` asks for B >= 2 rows not all of one length
    (CASES.md kind 5: batch size 1 hides batch-stride bugs)."""
    page_size = draw(st.sampled_from(page_sizes))
    num_query_tokens = draw(st.integers(1, _per_page_size(max_query_tokens, page_size)))
    batch = draw(st.integers(max(min_batch, 2 if distinct_lengths else 1), max_batch))
    boundary = st.sampled_from([0, 1, page_size - 1, page_size, page_size + 1, 2 * page_size, num_query_tokens])
    anywhere = st.integers(0, _per_page_size(max_pages_per_row, page_size) * page_size)
    lens = [max(0, draw(st.one_of(boundary, anywhere))) for _ in range(batch)]
    if distinct_lengths:
        assume(len(set(lens)) > 1)
    return make_problem(
        draw(st.integers(0, 2**31 - 1)), batch=batch, seq_lens=lens, page_size=page_size,
        num_kv_heads=draw(st.integers(1, max_kv_heads)), group=draw(st.sampled_from(groups)),
        head_dim=draw(st.sampled_from(head_dims)), num_query_tokens=num_query_tokens,
        dtype=DTYPES[draw(st.sampled_from(dtypes))], poison=draw(st.sampled_from(poisons)),
        spare_columns=draw(st.integers(0, 2)), in_order=draw(st.booleans()))


def relocate(p: Problem, *, num_pages: int, spare_columns: int, poison: float, seed: int) -> Problem:
    """The same logical rows placed at random physical pages of a pool of ``num_pages``, more table columns.

    Every slot the rows do not own (and every table entry past a row's end) holds garbage, so the answer
    of any correct op is exactly that of ``p``.
    """
    g = torch.Generator().manual_seed(seed)
    B, old_width = p.block_table.shape
    n_pages = [-(-int(n) // p.page_size) for n in p.seq_lens]
    assert num_pages >= sum(n_pages)
    shape = (num_pages, *p.k_cache.shape[1:])
    k = torch.full(shape, poison, dtype=p.k_cache.dtype)
    v = torch.full(shape, poison, dtype=p.v_cache.dtype)
    table = torch.randint(-1, num_pages + 50, (B, old_width + spare_columns), generator=g).to(torch.int32)
    new_ids = torch.randperm(num_pages, generator=g)
    i = 0
    for b, count in enumerate(n_pages):
        n = int(p.seq_lens[b])
        for j in range(count):
            src, dst = int(p.block_table[b, j]), int(new_ids[i])
            valid = min(p.page_size, n - j * p.page_size)
            k[dst, :valid], v[dst, :valid] = p.k_cache[src, :valid], p.v_cache[src, :valid]
            table[b, j] = dst
            i += 1
    return Problem(p.q, k, v, table, p.seq_lens, p.page_size)


def move_to_high_pages(p: Problem, num_pages: int) -> Problem:
    """``p``'s pages copied, in order, to the top of a NaN pool of ``num_pages`` (CASES.md kind 3: the largest
    offset, not the pool size, overflows 32 bits)."""
    used = sum(p.num_valid_pages(b) for b in range(p.block_table.shape[0]))
    k = torch.full((num_pages, *p.k_cache.shape[1:]), float("nan"), dtype=p.k_cache.dtype)
    v = torch.full_like(k, float("nan"))
    table = torch.full_like(p.block_table, -1)
    dst = num_pages - used
    for b in range(p.block_table.shape[0]):
        for j in range(p.num_valid_pages(b)):
            src = int(p.block_table[b, j])
            k[dst], v[dst] = p.k_cache[src], p.v_cache[src]
            table[b, j] = dst
            dst += 1
    return Problem(p.q, k, v, table, p.seq_lens, p.page_size)


# ---------------------------------------------------------------------------------------------- selection inputs
def windows(page_size: int):
    """Sliding windows around the interesting sizes: none (-1), 0 (the query alone), below / at / above a page,
    beyond any context, and anything up to 40."""
    return st.one_of(st.sampled_from([-1, 0, 1, page_size - 1, page_size, page_size + 1, 2 * page_size, 10**6]),
                     st.integers(0, 40))


@st.composite
def selection_scores(draw, max_batch=3, max_kv_heads=3, page_sizes=(1, 4, 16), max_pages=12, radix=None,
                     max_query_pages=2):
    """``(scores [B, Hkv, max_pages], seq_lens, options of select_pages)``: few distinct values (many ties), NaN,
    ``±inf``, ``-0.0`` and, where the pages past a row's end are, garbage that must never be kept (``+inf``, NaN,
    huge). ``radix`` True asks for budgets above 16 pages (the Triton kernel's radix select) on rows of 18 to 140
    pages; False for small ones (its argmax loop); None for either. The budget is one ``select_pages`` accepts:
    at least ``num_sink_pages + max(num_recent_pages, 1)`` and the pages holding the queries."""
    radix = draw(st.booleans()) if radix is None else radix
    page_size = draw(st.sampled_from(page_sizes))
    B, Hkv = draw(st.integers(1, max_batch)), draw(st.integers(1, max_kv_heads))
    width = draw(st.integers(18, 140) if radix else st.integers(1, max_pages))
    seq_lens = torch.tensor([draw(st.integers(0, width * page_size)) for _ in range(B)], dtype=torch.int32)
    pool = torch.tensor([-2.0, -1.0, 0.0, -0.0, 1.0, 3.5, -math.inf, math.inf, math.nan, 1e30])
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    picks = pool[torch.randint(0, len(pool), (B, Hkv, width), generator=g)]
    spread = draw(st.booleans())                   # half the pages distinct values, or all from the small pool
    scores = torch.where(torch.rand(B, Hkv, width, generator=g) < 0.5, picks, torch.randn(B, Hkv, width, generator=g)) \
        if spread else picks
    past_end = draw(st.sampled_from([math.inf, math.nan, 1e30]))
    for b in range(B):
        scores[b, :, -(-int(seq_lens[b]) // page_size):] = past_end
    num_query_tokens = draw(st.integers(1, max_query_pages * page_size))
    sinks, recent = draw(st.integers(0, 3)), draw(st.integers(0, 20 if radix else 3))
    query_pages = max([forced_query_pages(int(n), page_size, num_query_tokens) for n in seq_lens] + [1])
    low = max(sinks + max(recent, 1), query_pages)        # what select_pages accepts (the sinks may not all fit)
    budget = draw(st.integers(max(low, 17), max(low, 17) + width) if radix else st.integers(low, low + width + 2))
    opts = dict(page_size=page_size, page_budget=budget, num_sink_pages=sinks, num_recent_pages=recent,
                num_query_tokens=num_query_tokens)
    return scores, seq_lens, opts


def forced_query_pages(seq_len: int, page_size: int, num_query_tokens: int) -> int:
    """Pages that hold one of the row's ``Tq`` queries (the last ``Tq`` tokens): always kept by a selection."""
    n = -(-seq_len // page_size)
    return n - max(seq_len - num_query_tokens, 0) // page_size


def brute_force_select(scores, seq_lens, *, page_size, page_budget, num_sink_pages=0, num_recent_pages=1,
                       num_query_tokens=1):
    """docs/layout.md's selection rule, by hand: a row of ``n <= page_budget`` valid pages keeps them all; else the
    recent pages (the last ``max(num_recent_pages, 1)``, and every page holding a query), then the first
    ``num_sink_pages`` (as many as the budget still holds), then the best scores with NaN read as ``-inf`` and ties to the lower page index. Ascending,
    ``-1`` padded, int32 ``[B, Hkv, page_budget]``."""
    B, Hkv, _ = scores.shape
    out = torch.full((B, Hkv, page_budget), -1, dtype=torch.int32)
    for b in range(B):
        n = -(-int(seq_lens[b]) // page_size)
        recent = max(num_recent_pages, 1, forced_query_pages(int(seq_lens[b]), page_size, num_query_tokens))
        for h in range(Hkv):
            if n <= page_budget:
                keep = list(range(n))
            else:                   # forced pages by priority (newest first, then sinks), as many as fit
                keep = list(range(n - 1, max(n - recent, 0) - 1, -1))
                keep = (keep + [j for j in range(min(num_sink_pages, n)) if j not in keep])[:page_budget]
                vals = [-math.inf if math.isnan(v) else v for v in scores[b, h, :n].tolist()]
                ranked = sorted((j for j in range(n) if j not in keep), key=lambda j: (-vals[j], j))
                keep += ranked[: page_budget - len(keep)]
            keep = sorted(keep)
            out[b, h, : len(keep)] = torch.tensor(keep, dtype=torch.int32)
    return out


def random_page_indices(p: Problem, width: int, seed: int, *, canonical: bool = True) -> torch.Tensor:
    """Listed pages ``[B, Hkv, width]`` int32. ``canonical``: a random subset of each row's valid pages, ascending,
    ``-1`` padded (what the kernels take). Else distinct logical pages in any order, some past the row's end
    (what a caller may pass: the ops canonicalize)."""
    g = torch.Generator().manual_seed(seed)
    B, max_pages = p.block_table.shape
    idx = torch.full((B, p.num_kv_heads, width), -1, dtype=torch.int32)
    for b in range(B):
        n = p.num_valid_pages(b)
        for h in range(p.num_kv_heads):
            if canonical:
                keep = int(torch.randint(0, min(n, width) + 1, (1,), generator=g))
                idx[b, h, :keep] = torch.randperm(n, generator=g)[:keep].sort().values.to(torch.int32)
            else:
                count = int(torch.randint(0, width + 1, (1,), generator=g))
                idx[b, h, :count] = torch.randperm(max_pages + 1, generator=g)[:count].to(torch.int32)
    return idx


def canonical(page_indices: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """The listed pages a correct op attends to, written without tinyattn: ids in ``[0, n)``, de-duplicated,
    ascending, ``-1`` padded (the reference raises on duplicates, so it is given these)."""
    B, Hkv, width = page_indices.shape
    out = torch.full((B, Hkv, width), -1, dtype=torch.int64)
    for b in range(B):
        n = -(-int(seq_lens[b]) // page_size)
        for h in range(Hkv):
            keep = sorted({int(j) for j in page_indices[b, h].tolist() if 0 <= j < n})
            out[b, h, :len(keep)] = torch.tensor(keep, dtype=torch.int64)
    return out


# ---------------------------------------------------------------------------------------------- layouts
LAYOUTS = ("contiguous", "transposed", "strided")


def relayout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """Same values as ``x`` [B, T, H, D], in a non-contiguous layout (transposed view or stride(-1) == 2)."""
    if layout == "transposed":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "strided":
        return torch.stack([x, torch.full_like(x, math.nan)], -1)[..., 0]
    return x


@st.composite
def laid_out_problems(draw, dtypes=("fp32", "fp16"), max_pages_per_row=5):
    """``(problem, layout)`` for the kernels' property tests: B = 2 or 3 rows of distinct lengths (around page
    boundaries), page sizes 1..32, head dims up to 128 (not all powers of two), 1-2 KV heads with groups 1-4, up to
    two pages of query tokens, and one of :data:`LAYOUTS` for q / out."""
    p = draw(problems(dtypes=dtypes, min_batch=2, max_batch=3, distinct_lengths=True,
                      max_pages_per_row=max_pages_per_row, page_sizes=(1, 2, 4, 8, 16, 32),
                      head_dims=(8, 16, 24, 40, 64, 80, 128), max_query_tokens=two_pages, max_kv_heads=2))
    return p, draw(st.sampled_from(LAYOUTS))


def interleave_kv(k: torch.Tensor, v: torch.Tensor):
    """K and V as views of one ``[num_pages, 2, page_size, Hkv, D]`` pool (page stride 2x the page size)."""
    kv = torch.stack([k, v], 1)
    return kv[:, 0], kv[:, 1]


# ---------------------------------------------------------------------------------------------- fp64 facts
def contiguous_kv(p: Problem, b: int):
    """Row ``b``'s keys / values gathered into fp64 ``[n, Hkv, D]`` by walking its pages (no tinyattn code)."""
    n = int(p.seq_lens[b])
    idx = [int(p.block_table[b, t // p.page_size]) * p.page_size + t % p.page_size for t in range(n)]
    flat_k = p.k_cache.reshape(-1, *p.k_cache.shape[2:])
    flat_v = p.v_cache.reshape(-1, *p.v_cache.shape[2:])
    return flat_k[idx].double(), flat_v[idx].double()


def max_logits(p: Problem, q: torch.Tensor | None = None):
    """fp64 ``(max_t q·k_t, max_t |q|·|k_t|)`` per (row, KV head, logical page) over the group's heads, the row's
    ``Tq`` queries and the page's valid keys (``-inf`` / 0 for pages past the end). The second is the scale of the
    fp32 rounding error of a bound."""
    q = p.q if q is None else q
    B, Tq, Hq, D = q.shape
    Hkv, page_size = p.num_kv_heads, p.page_size
    G = Hq // Hkv
    best = torch.full((B, Hkv, p.block_table.shape[1]), -math.inf, dtype=torch.float64)
    mag = torch.zeros_like(best)
    for b in range(B):
        keys, _ = contiguous_kv(p, b)
        qg = q[b].double().reshape(Tq, Hkv, G, D)
        for j in range(p.num_valid_pages(b)):
            page = keys[j * page_size:(j + 1) * page_size]                                           # [s, Hkv, D]
            best[b, :, j] = torch.einsum("thgd,shd->hstg", qg, page).reshape(Hkv, -1).amax(1)
            mag[b, :, j] = torch.einsum("thgd,shd->hstg", qg.abs(), page.abs()).reshape(Hkv, -1).amax(1)
    return best, mag


# ---------------------------------------------------------------------------------------------- int8 / fp8 pools
def owned_slots(p: Problem) -> torch.Tensor:
    """``[num_pages, page_size]`` bool: slots some row holds."""
    owned = torch.zeros(p.k_cache.shape[:2], dtype=torch.bool)
    for b in range(p.block_table.shape[0]):
        n = int(p.seq_lens[b])
        for j in range(p.num_valid_pages(b)):
            owned[int(p.block_table[b, j]), : min(p.page_size, n - j * p.page_size)] = True
    return owned


def quantize_problem(p: Problem, fmt: str, *, poison_scales: bool = True):
    """``p``'s pools quantized per (page, KV head) over the owned slots (``absmax / qmax``, int8 rounded to nearest,
    fp8 by torch's cast); unowned slots hold garbage codes (NaN for fp8, 127 for int8) and, with ``poison_scales``,
    the scales of pages no row holds are NaN. Returns ``(k_codes, v_codes, k_scale, v_scale)``."""
    dtype = QUANTIZED[fmt]
    owned = owned_slots(p)
    mask = owned[:, :, None, None]
    out = []
    for pool in (p.k_cache, p.v_cache):
        x = torch.where(mask, pool.float(), 0.0)
        scale = x.abs().amax(dim=(1, 3)) / QMAX[fmt]                                # [num_pages, Hkv]
        y = x / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None, :, None]
        codes = y.round().clamp(-127, 127).to(dtype) if fmt == "int8" else y.clamp(-448, 448).to(dtype)
        garbage = torch.full_like(codes.view(torch.uint8), 0x7F)                    # fp8: NaN, int8: 127
        codes = torch.where(mask, codes.view(torch.uint8), garbage).view(dtype)
        if poison_scales:
            scale = torch.where(owned.any(1)[:, None], scale, float("nan"))
        out.append((codes, scale))
    (kq, ks), (vq, vs) = out
    return kq, vq, ks, vs


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``code * scale`` of a ``[num_pages, page_size, Hkv, D]`` pool with ``[num_pages, Hkv]`` scales, in fp32."""
    return codes.float() * scale[:, None, :, None]


def dequantized_args(p: Problem, kq, vq, ks, vs):
    """The same problem as float pools (dequantized here), with the poison kept out of owned slots."""
    k = torch.nan_to_num(dequantize(kq, ks), nan=0.0).to(p.q.dtype)
    v = torch.nan_to_num(dequantize(vq, vs), nan=0.0).to(p.q.dtype)
    return (p.q, k, v, p.block_table, p.seq_lens)


# ---------------------------------------------------------------------------------------------- the KV write
WRITE_FORMATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8,
                 "fp8_e4m3": torch.float8_e4m3fn}
WRITE_BOXES = {"none": None, "auto": "auto", "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def poisoned_pools(gen, fmt, box, num_pages, page_size, num_kv_heads, head_dim):
    """The state a KV write updates, full of poison: pools of NaN / the dtype's max / random codes (every fp8 byte,
    NaN codes included), NaN or ±1e30 boxes, NaN or 7.0 scales, a ``fill`` of 99. ``box``: a key of
    :data:`WRITE_BOXES`."""
    dtype = WRITE_FORMATS[fmt]
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    quantized = dtype in (torch.int8, torch.float8_e4m3fn)
    if dtype == torch.int8:
        pools = [torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8) for _ in range(2)]
    elif dtype == torch.float8_e4m3fn:
        pools = [torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dtype) for _ in range(2)]
    else:
        pools = []
        for _ in range(2):
            x = torch.randn(shape, generator=gen) * 3
            pick = torch.rand(shape, generator=gen)
            x = torch.where(pick < 0.3, float("nan"), torch.where(pick < 0.5, torch.finfo(dtype).max, x))
            pools.append(x.to(dtype))
    box_dtype = WRITE_BOXES[box]
    if box_dtype == "auto":
        box_dtype = torch.float32 if quantized else dtype
    k_min = k_max = None
    if box_dtype is not None:
        k_min = torch.where(torch.rand(num_pages, num_kv_heads, head_dim, generator=gen) < 0.5, float("nan"),
                            1e30).to(box_dtype)
        k_max = torch.where(torch.rand(num_pages, num_kv_heads, head_dim, generator=gen) < 0.5, float("nan"),
                            -1e30).to(box_dtype)
    scales = fill = None
    if quantized:
        scales = [torch.where(torch.rand(num_pages, num_kv_heads, generator=gen) < 0.5, float("nan"), 7.0)
                  for _ in range(2)]
        fill = torch.full((num_pages,), 99, dtype=torch.int64)
    return dict(k_cache=pools[0], v_cache=pools[1], k_min=k_min, k_max=k_max,
                k_scale=scales[0] if scales else None, v_scale=scales[1] if scales else None, fill=fill)


def take_page(state, page):
    """What ``PagedKVCache`` does to a page it allocates: an empty box, a zero scale, no valid slot (K/V keep their
    poison)."""
    if state["k_min"] is not None:
        state["k_min"][page] = float("inf")
        state["k_max"][page] = float("-inf")
    if state["fill"] is not None:
        state["k_scale"][page] = state["v_scale"][page] = 0.0
        state["fill"][page] = 0


def write_steps(gen, num_pages, page_size, num_seqs, num_steps):
    """Per step: the slots (``extend()``-like: sequence after sequence, token order, pages from a shuffled free
    list, each page filled from offset 0) and the pages taken first."""
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
