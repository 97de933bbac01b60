"""Random paged-attention problems for tests: ragged rows, shuffled page tables, poisoned padding.

Every problem is built so that the right answer depends only on ``seq_lens`` and the valid slots:
unused slots of partial pages, unused pages of the pool and table entries past each row's end hold
garbage (NaN, 1e30, -1, huge ids), as CASES.md kinds 1 and 5 ask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


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

    def bounds(self):
        """Exact page bounding boxes from the reference (fp32)."""
        from tinyattn import reference
        shape = (self.k_cache.shape[0], self.num_kv_heads, self.k_cache.shape[3])
        k_min = torch.zeros(shape, dtype=torch.float32)
        k_max = torch.zeros(shape, dtype=torch.float32)
        reference.update_page_metadata(self.k_cache, self.block_table, self.seq_lens, k_min, k_max)
        return k_min, k_max


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


@st.composite
def problems(draw, dtypes=("fp32",), max_batch=3, max_pages_per_row=6, head_dims=(8, 16, 24, 40, 64),
             page_sizes=(1, 2, 4, 8, 16), max_query_tokens=1):
    page_size = draw(st.sampled_from(page_sizes))
    batch = draw(st.integers(1, max_batch))
    boundary = st.sampled_from([0, 1, page_size - 1, page_size, page_size + 1, 2 * page_size])
    anywhere = st.integers(0, max_pages_per_row * page_size)
    lens = [max(0, draw(st.one_of(boundary, anywhere))) for _ in range(batch)]
    return make_problem(
        draw(st.integers(0, 2**31 - 1)), batch=batch, seq_lens=lens, page_size=page_size,
        num_kv_heads=draw(st.integers(1, 3)), group=draw(st.sampled_from([1, 2, 3, 4])),
        head_dim=draw(st.sampled_from(head_dims)), num_query_tokens=draw(st.integers(1, max_query_tokens)),
        dtype=DTYPES[draw(st.sampled_from(dtypes))], poison=draw(st.sampled_from([float("nan"), 1e30, -1e30])))


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
