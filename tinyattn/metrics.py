"""The accounting of tinyattn, written once: bytes moved by a decode step, pages read, selection quality.

Every figure the profiler (:mod:`tinyattn.profiler`), the model runtime (:class:`tinyattn.models.LlamaRuntime`,
``GenerationStats``), the selection metrics (:class:`tinyattn.selection.SelectionMetrics`) and the benchmarks
(``bench/``) report comes from the functions below.

**Bytes moved** (DESIGN.md §1, the source of every formula here). Per decode step, per (row, KV head), for a
row of ``L`` valid tokens, head dim ``D``, page size ``S`` and a budget of ``K`` pages (names of
``docs/layout.md``: ``L = seq_len``, ``S = page_size``, ``K = page_budget``)::

    dense  = 2·L·D                          elements: K and V of every valid token
    sparse = 2·⌈L/S⌉·D + 2·K·S·D             elements: the page boxes (k_min + k_max) of every valid page,
                                            then K and V of the K selected pages

A row of at most ``K`` pages (``L <= K·S``) is read whole, with no box pass: its sparse figure is the dense one
(``select_pages`` keeps every page of such a row, and the ops skip scoring). Bytes are elements times the
element size (``elem`` for K/V, ``box_elem`` for the boxes, which may be fp32 over an fp16 cache). At
``L = 32768, S = 16, K·S = 2048`` the ideal speed-up of a memory-bound step, ``dense / sparse``, is 8×.

The functions take Python ints or integer tensors (elementwise, e.g. ``seq_lens`` ``[B]``) and return the same
kind. The queries and outputs (:func:`io_bytes`) are counted apart, once per step, not per KV head.

**Selection quality** (``docs/accuracy.md``): against an oracle selection of the same size, the *hit rate* is
the share of the oracle's pages the selection also holds, and the *captured mass* the share of the full
attention's softmax mass that falls on the selected pages; :func:`selection_overlap` counts both per
(row, KV head), :func:`hit_rate` and :func:`captured_mass` turn sums of them into ratios.
"""

from __future__ import annotations

import torch

__all__ = ["num_pages", "kv_bytes", "box_bytes", "io_bytes", "dense_bytes", "sparse_bytes", "pages_read",
           "window_pages", "window_tokens", "ideal_speedup", "selection_reads", "selection_overlap", "hit_rate",
           "captured_mass", "PagesAttended"]


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


# ---------------------------------------------------------------------------------------------- bytes moved
def num_pages(seq_len, page_size: int):
    """``⌈L/S⌉``: pages holding at least one of ``seq_len`` valid tokens (int, or int64 tensor)."""
    if _is_tensor(seq_len):
        seq_len = seq_len.to(torch.int64)
    return (seq_len + page_size - 1) // page_size


def kv_bytes(tokens, head_dim: int, elem: int):
    """``2·tokens·D·elem``: bytes of K and V of ``tokens`` tokens of one KV head."""
    return 2 * tokens * head_dim * elem


def box_bytes(pages, head_dim: int, elem: int):
    """``2·pages·D·elem``: bytes of the bounding boxes (``k_min`` + ``k_max``) of ``pages`` pages of one KV head."""
    return 2 * pages * head_dim * elem


def io_bytes(batch: int, num_q_heads: int, head_dim: int, elem: int, num_query_tokens: int = 1) -> int:
    """``2·B·Tq·Hq·D·elem``: the queries read and the outputs written by one step."""
    return 2 * batch * num_query_tokens * num_q_heads * head_dim * elem


def dense_bytes(seq_len, head_dim: int, elem: int):
    """DESIGN.md §1 ``dense = 2·L·D`` elements, in bytes: what full attention reads per (row, KV head)."""
    return kv_bytes(seq_len, head_dim, elem)


def _reads_whole_row(seq_len, page_size: int, page_budget: int | None):
    if page_budget is None:
        return True if not _is_tensor(seq_len) else torch.ones_like(seq_len, dtype=torch.bool)
    return num_pages(seq_len, page_size) <= page_budget


def sparse_bytes(seq_len, head_dim: int, page_size: int, page_budget: int | None, elem: int,
                 box_elem: int | None = None):
    """DESIGN.md §1 ``sparse = 2·⌈L/S⌉·D + 2·K·S·D`` elements, in bytes, per (row, KV head).

    ``box_elem`` is the element size of ``k_min``/``k_max`` (default ``elem``). A row of at most
    ``page_budget`` pages (or ``page_budget=None``, dense) reads :func:`dense_bytes` and no boxes.
    """
    box_elem = elem if box_elem is None else box_elem
    sparse = (box_bytes(num_pages(seq_len, page_size), head_dim, box_elem)
              + kv_bytes((page_budget or 0) * page_size, head_dim, elem))
    whole = _reads_whole_row(seq_len, page_size, page_budget)
    if _is_tensor(seq_len):
        return torch.where(whole, dense_bytes(seq_len.to(torch.int64), head_dim, elem), sparse)
    return dense_bytes(seq_len, head_dim, elem) if whole else sparse


def pages_read(seq_len, page_size: int, page_budget: int | None = None):
    """Pages whose K/V a step reads per (row, KV head): ``min(⌈L/S⌉, K)`` (all of them when ``K`` is None)."""
    n = num_pages(seq_len, page_size)
    if page_budget is None:
        return n
    return torch.clamp(n, max=page_budget) if _is_tensor(n) else min(n, page_budget)


def window_pages(seq_len: int, page_size: int, window_left: int) -> int:
    """Pages a decode query (at position ``L - 1``) of a sliding layer reads per KV head: those overlapping its
    window ``[L - 1 - window_left, L - 1]`` (all ``⌈L/S⌉`` with ``window_left = -1``)."""
    if seq_len <= 0:
        return 0
    if window_left < 0:
        return num_pages(seq_len, page_size)
    return (seq_len - 1) // page_size - max(seq_len - 1 - window_left, 0) // page_size + 1


def window_tokens(seq_len: int, window_left: int) -> int:
    """Keys a decode query of a sliding layer sees: ``min(L, window_left + 1)`` (``L`` with no window)."""
    return seq_len if window_left < 0 else min(seq_len, window_left + 1)


def ideal_speedup(seq_len: int, head_dim: int, page_size: int, page_budget: int | None, elem: int = 2,
                  box_elem: int | None = None) -> float:
    """``dense / sparse``: the speed-up of a memory-bound decode step that reads only what it must
    (8.0 at ``L = 32768, S = 16, K = 128``; 1.0 when the row fits the budget)."""
    return dense_bytes(seq_len, head_dim, elem) / sparse_bytes(seq_len, head_dim, page_size, page_budget, elem,
                                                              box_elem)


def selection_reads(page_indices: torch.Tensor, seq_lens: torch.Tensor, page_size: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """What attending to an actual selection reads: ``(pages, tokens)``, int64 ``[B, Hkv]`` each.

    ``page_indices`` ``[B, Hkv, K]`` logical pages (``-1`` and pages past the row's end are not read);
    ``tokens`` counts the valid tokens of the selected pages (a partial last page holds fewer than ``S``).
    K/V bytes are :func:`kv_bytes` of ``tokens``.
    """
    sel = page_indices.to(torch.int64)
    lens = seq_lens.to(torch.int64)
    ok = (sel >= 0) & (sel < num_pages(lens, page_size)[:, None, None])
    tok = torch.clamp(lens[:, None, None] - sel * page_size, 0, page_size)           # valid tokens of each page
    return ok.sum(-1), torch.where(ok, tok, 0).sum(-1)


# ---------------------------------------------------------------------------------------------- selection quality
def selection_overlap(selected: torch.Tensor, oracle: torch.Tensor, mass: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (row, KV head): ``(|selected ∩ oracle|, |oracle|, mass on selected)`` as fp32 ``[B, Hkv]``.

    ``selected``, ``oracle``: ``[B, Hkv, K]`` logical pages (``-1`` = none); ``mass``: ``[B, Hkv,
    max_pages_per_seq]``, the share of the row's true attention mass on each logical page.
    """
    max_pages = mass.shape[2]
    sel = selected.long()
    orc = oracle.long()
    sel_ok = (sel >= 0) & (sel < max_pages)
    in_oracle = torch.zeros(*orc.shape[:2], max_pages + 1, dtype=torch.bool, device=mass.device)
    in_oracle.scatter_(2, torch.where((orc >= 0) & (orc < max_pages), orc, max_pages), True)
    in_oracle[..., max_pages] = False
    hit = torch.gather(in_oracle, 2, torch.where(sel_ok, sel, max_pages)).sum(-1).float()
    n_oracle = in_oracle.sum(-1).float()
    captured = torch.where(sel_ok, torch.gather(mass, 2, sel.clamp(0, max_pages - 1)), 0.0).sum(-1).float()
    return hit, n_oracle, captured


def hit_rate(hits: float, oracle_pages: float) -> float:
    """Pages of the oracle's selections the selection also holds, over all the oracle's pages (NaN if none)."""
    return hits / oracle_pages if oracle_pages else float("nan")


def captured_mass(mass_sum: float, samples: int) -> float:
    """Mean over ``samples`` (row, KV head) pairs of the attention mass on the selected pages (NaN if none)."""
    return mass_sum / samples if samples else float("nan")


# ---------------------------------------------------------------------------------------------- pages attended
class PagesAttended:
    """How many pages each (sparse layer, KV head, row, decode step) attended: a histogram kept on the device.

    With ``top_p`` the selection keeps a varying number of pages per (row, KV head) (at most ``page_budget``),
    so the pages read are known only on the device. :meth:`add` counts one layer's selection with tensor ops
    only (no host sync: a ``scatter_add_`` into a histogram whose length comes from host shapes); :meth:`summary`
    reads it once (one host sync), at the end of a ``generate``. Filled by :class:`tinyattn.layer.PagedAttention`
    (its ``attended`` attribute) in the decode steps of its sparse layers: a step whose rows all fit the budget
    (no selection) counts every valid page of each row.
    """

    def __init__(self):
        self.hist: torch.Tensor | None = None       # int64 [most pages + 1]: hist[k] = (layer, head, row, step)s with k

    def add(self, page_indices: torch.Tensor | None, seq_lens: torch.Tensor, page_size: int, num_kv_heads: int,
            width: int) -> None:
        """Count one layer's step: ``page_indices`` ``[B, Hkv, K]`` (``-1`` / past the row's end = not attended;
        ``None``: every valid page, a step that did not select), ``seq_lens`` ``[B]``, ``width`` the block
        table's pages per row (the most any row can attend: the histogram's length, a host int)."""
        if page_indices is None:
            n = num_pages(seq_lens.to(torch.int64), page_size)[:, None].expand(-1, num_kv_heads)
            width = max(width, 0)
        else:
            n, _ = selection_reads(page_indices, seq_lens, page_size)                      # [B, Hkv]
            width = max(width, page_indices.shape[-1])
        n = n.reshape(-1).clamp(0, width)
        if self.hist is None or self.hist.device != n.device:
            self.hist = torch.zeros(width + 1, dtype=torch.int64, device=n.device)
        elif self.hist.numel() < width + 1:                          # a longer row: grow (host shapes, no sync)
            self.hist = torch.cat([self.hist, self.hist.new_zeros(width + 1 - self.hist.numel())])
        self.hist.scatter_add_(0, n, torch.ones_like(n))

    def summary(self) -> dict:
        """``{"count", "mean", "min", "median", "max", "histogram"}``: over the counted (layer, KV head, row, step)s,
        pages attended (``histogram[k]``: how many attended ``k``); zeros and an empty histogram when none."""
        h = [] if self.hist is None else self.hist.tolist()
        while h and not h[-1]:
            h.pop()
        count = sum(h)
        if not count:
            return {"count": 0, "mean": 0.0, "min": 0, "median": 0, "max": 0, "histogram": []}
        seen = [k for k, c in enumerate(h) if c]
        half, acc, median = (count + 1) // 2, 0, 0
        for k, c in enumerate(h):
            acc += c
            if acc >= half:
                median = k
                break
        return {"count": count, "mean": sum(k * c for k, c in enumerate(h)) / count, "min": seen[0],
                "median": median, "max": seen[-1], "histogram": h}

    def format(self, page_size: int | None = None) -> str:
        """One line: mean (tokens too, given ``page_size``), min / median / max pages per (layer, KV head, row,
        step)."""
        s = self.summary()
        tokens = f" ({s['mean'] * page_size:.0f} tokens)" if page_size else ""
        return (f"{s['mean']:.1f} pages{tokens} mean, min {s['min']} / median {s['median']} / max {s['max']} per "
                f"(sparse layer, KV head, row, step), {s['count']} counted")
