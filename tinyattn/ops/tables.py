"""Per-step index tables of the torch backend's plan, built on the host with NumPy.

A decode step's tables are small (``B x Hkv x pages x page_size`` integers) and are rebuilt every step, so
their cost is per-call overhead, not bandwidth: a few dozen PyTorch calls on tiny tensors cost ~3 µs each,
the same NumPy calls well under 1 µs. They are built here from the host copies of ``block_table`` and
``seq_lens`` and handed to the device once (``torch.from_numpy`` shares the memory on the CPU).

Layout (docs/layout.md): the pool ``[num_pages, page_size, Hkv, D]`` is read as flat rows
``(page * page_size + slot) * Hkv + head``. A slot that must not count (past ``seq_lens``, an invalid page)
points at the first key of its own (row, head) — a valid key, so NaN or garbage in unused slots is never
read — and is hidden by the additive mask (``0`` visible, ``-inf`` hidden).

Selection keys (see :func:`sparse_tables`): recent pages ``+inf``, sink pages ``FLT_MAX``, invalid pages
``-inf`` (forced); every other page is keyed by its Quest bound, capped below ``FLT_MAX``. A stable descending
sort then lists recent pages, sinks, scored pages, invalid pages, in that order, ties to the lower page: so
where every forced page lands in a selection is known when planning, and the mask of any selection is the
mask of a template selection computed here.
"""

from __future__ import annotations

import numpy as np
import torch

FLT_MAX = float(np.finfo(np.float32).max)
_SORT_MAX_PAGES = 64        # rows of more pages select with topk over packed int64 keys (cheaper than a sort)

__all__ = ["dense_tables", "sparse_tables", "FLT_MAX"]


def _kept(memo: dict | None, key, build):
    """``memo[key]``, or ``build()`` kept there as the only entry (a step's tables replace the last step's)."""
    if memo is not None and key in memo:
        return memo[key]
    value = build()
    if memo is not None:
        memo.clear()
        memo[key] = value
    return value


def _page_rows(table: np.ndarray, nonempty: np.ndarray, P: int, S: int, Hkv: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat pool rows ``[B, Hkv, P, S]`` of every slot of the first ``P`` logical pages, and each row's filler
    ``[B, Hkv, 1, 1]``: its own first key; an empty row borrows another row's (a valid key is finite, an unused
    slot may hold NaN, and a hidden key's 0 weight times NaN would still be NaN). Depend on the pages only."""
    B = table.shape[0]
    heads = np.arange(Hkv)
    base = table[:, :P].astype(np.int64) * (S * Hkv)                                   # [B, P]
    rows = base[:, None, :, None] + (np.arange(S) * Hkv)[None, None, None, :] + heads[None, :, None, None]
    first = table[:, 0].astype(np.int64) * (S * Hkv) if P else np.zeros(B, np.int64)
    donor = np.flatnonzero(nonempty)
    first = np.where(nonempty, first, first[donor[0]] if donor.size else 0)
    return rows, first[:, None, None, None] + heads[None, :, None, None]


def _with_fillers(rows: np.ndarray, filler: np.ndarray, lens: np.ndarray, P: int, S: int,
                  first_key: np.ndarray | None = None):
    """``rows`` with every slot past its row's length replaced by the filler; and ``key_ok`` ``[B, P * S]``.
    ``first_key`` ``[B]``: the position of each row's first gathered key (a windowed gather), default 0."""
    B = rows.shape[0]
    n_keys = lens if first_key is None else lens - first_key
    key_ok = np.arange(P * S)[None, :] < n_keys[:, None]                               # [B, P*S]
    return np.where(key_ok.reshape(B, 1, P, S), rows, filler), key_ok


def _visible(key_ok: np.ndarray, lens: np.ndarray, Tq: int, window_left: int = -1,
             first_key: np.ndarray | None = None) -> np.ndarray:
    """``[B, Tq, keys]``: query ``t`` (at ``p = len - Tq + t``) sees key ``i`` (bottom-right causal; with a window
    only keys at positions ``>= p - window_left``). Key ``i`` sits at position ``first_key + i`` (default ``i``)."""
    if Tq == 1 and window_left < 0:      # the query is the last token: it sees every valid key
        return key_ok[:, None, :]
    pos = np.arange(key_ok.shape[1])[None, None, :]
    if first_key is not None:
        pos = pos + first_key[:, None, None]                                           # [B, 1, keys]
    q_pos = (lens[:, None] - Tq + np.arange(Tq))[:, :, None]                           # [B, Tq, 1]
    visible = key_ok[:, None, :] & (pos <= q_pos)
    if window_left >= 0:
        visible &= pos >= q_pos - window_left
    return visible


def _bias(visible: np.ndarray, group: int) -> np.ndarray:
    """``[B, Tq, keys]`` bool -> additive fp32 mask ``[B, 1, Tq * G, keys]`` (query rows ordered ``(t, g)``)."""
    B, Tq, n_keys = visible.shape
    bias = np.where(visible, np.float32(0.0), np.float32(-np.inf))
    if Tq > 1:
        bias = np.repeat(bias, group, axis=1)
    return bias.reshape(B, 1, -1, n_keys)


def dense_tables(table: np.ndarray, lens: np.ndarray, *, page_size: int, num_kv_heads: int, group: int,
                 num_query_tokens: int, device: torch.device, memo: dict | None = None,
                 window_left: int = -1) -> dict:
    """Every valid key of each row: ``rows`` ``[B * Hkv * L]`` int64, ``L`` = longest row, and the additive
    ``bias`` ``[B, 1, Tq * G, L]`` or ``None`` when every query sees every key (equal lengths, decode).
    ``memo``: as in :func:`sparse_tables` (the rows of whole pages are reused while the pages stand).

    ``window_left >= 0`` (a sliding window, FlashInfer's convention): each row's keys start at the page holding
    the first key its earliest query sees (``len - Tq - window_left``), so ``L`` is the longest row's window
    rounded out to whole pages, not its length: a sliding layer reads ``O(window)`` keys whatever the context."""
    S, Hkv, Tq = page_size, num_kv_heads, num_query_tokens
    B = table.shape[0]
    lens = np.minimum(lens, table.shape[1] * S)
    first_page = np.zeros(B, np.int64)
    if window_left >= 0:
        first_page = np.maximum(lens - Tq - window_left, 0) // S
        # the row's table from its first window page on (columns past the table are never valid keys)
        cols = np.minimum(first_page[:, None] + np.arange(table.shape[1])[None, :], table.shape[1] - 1)
        table = np.take_along_axis(table, cols, axis=1) if table.size else table
    first_key = first_page * S
    L = int((lens - first_key).max(initial=0))
    P = -(-L // S)
    nonempty = lens > 0
    key = (table[:, :P].tobytes(), B, nonempty.tobytes(), S, Hkv)
    pages = _kept(memo, key, lambda: _page_rows(table, nonempty, P, S, Hkv))
    rows, key_ok = _with_fillers(*pages, lens, P, S, first_key)
    rows = rows.reshape(B, Hkv, P * S)[:, :, :L]
    visible = _visible(key_ok[:, :L], lens, Tq, window_left, first_key)
    bias = None
    if not visible.all():
        bias = torch.from_numpy(_bias(visible, group)).to(device)
    return dict(rows=torch.from_numpy(np.ascontiguousarray(rows).reshape(-1)).to(device), L=L, bias=bias)


def sparse_tables(table: np.ndarray, lens: np.ndarray, *, page_size: int, num_kv_heads: int, group: int,
                  num_query_tokens: int, page_budget: int, num_sink_pages: int, num_recent_pages: int,
                  device: torch.device, memo: dict | None = None) -> dict:
    """What a selecting step reads, for the first ``Pv`` pages (the longest row's):

    - ``rows`` ``[B, Hkv, Pv, S]`` pool rows of every slot; ``box_rows`` ``[B * Hkv * Pv]`` head-major rows of
      the page boxes ``[num_pages * Hkv, D]``;
    - ``forced`` ``[B, 1, Pv]`` bool and ``forced_key`` ``[B, 1, Pv]`` fp32 (recent ``+inf``, sink ``FLT_MAX``,
      invalid ``-inf``): the keys that replace the Quest bound where ``forced``;
    - ``sel_bias`` ``[B, 1, Tq * G, K * S]``: the mask of any selection made with these keys (module docstring);
    - ``K = min(page_budget, Pv)`` pages selected, ``Pv``.

    ``memo``: a dict the caller keeps across steps. What depends on the pages alone (everything but the
    fillers of partial pages and the mask) is reused from it while the rows' pages and their number stand: a
    decode step then rebuilds only the per-token part (one page in ``page_size`` steps rebuilds it all).
    """
    S, Tq = page_size, num_query_tokens
    n = (lens + S - 1) // S                                                            # [B] valid pages
    Pv = int(min(table.shape[1], n.max(initial=0)))
    recent = np.maximum(n - np.maximum(lens - Tq, 0) // S, max(num_recent_pages, 1))  # query pages, >= 1
    settings = (num_kv_heads, group, Tq, page_budget, num_sink_pages, S, device)
    key = (table[:, :Pv].tobytes(), table.shape[0], n.tobytes(), recent.tobytes(), settings)
    pages = _kept(memo, key, lambda: _sparse_page_tables(table[:, :Pv], n, recent, Pv, *settings))
    B, K = table.shape[0], pages["K"]
    rows, key_ok = _with_fillers(pages["base_rows"], pages["filler"], lens, Pv, S)
    visible = _visible(key_ok, lens, Tq).reshape(B, Tq, Pv, S)                        # [B, Tq, Pv, S]
    sel_visible = np.take_along_axis(visible, pages["template"][:, None, :, None], axis=2).reshape(B, Tq, K * S)
    return dict(pages["tensors"], rows=torch.from_numpy(rows).to(device),
                sel_bias=torch.from_numpy(_bias(sel_visible, group)).to(device))


def _sparse_page_tables(table: np.ndarray, n: np.ndarray, recent: np.ndarray, Pv: int, num_kv_heads: int,
                        group: int, num_query_tokens: int, page_budget: int, num_sink_pages: int, page_size: int,
                        device: torch.device) -> dict:
    """The part of :func:`sparse_tables` that depends on the pages alone (``table`` ``[B, Pv]``, ``n`` valid and
    ``recent`` forced trailing pages per row)."""
    Hkv = num_kv_heads
    K = min(page_budget, Pv)
    j = np.arange(Pv)
    valid = j[None, :] < n[:, None]                                                    # [B, Pv]
    is_recent = valid & (j[None, :] >= (n - recent)[:, None])
    is_sink = valid & ~is_recent & (j[None, :] < num_sink_pages)
    forced_key = np.where(is_recent, np.float32(np.inf),
                          np.where(is_sink, np.float32(FLT_MAX), np.float32(-np.inf))).astype(np.float32)
    forced = is_recent | is_sink | ~valid
    phys = np.where(valid, table, 0).astype(np.int64)
    box_rows = (phys[:, None, :] * Hkv + np.arange(Hkv)[None, :, None]).reshape(-1)
    # template selection: every scored page keyed 0 -> where each forced page lands (stable, descending)
    template = np.argsort(-np.where(forced, forced_key, np.float32(0.0)), axis=1, kind="stable")[:, :K]
    # long rows select with topk over unique int64 keys (plan._top_pages): forced pages above every bound,
    # recent above sinks, each group in page order; invalid pages below everything
    packed = rank = None
    if Pv > _SORT_MAX_PAGES:
        rank = (Pv - 1 - j).astype(np.int64)                                            # ties: lower page first
        forced_base = np.int64(0x7F800001) << np.int64(32)                             # above +inf's image
        packed = np.where(is_recent, forced_base + Pv + rank,
                          np.where(is_sink, forced_base + rank, np.iinfo(np.int64).min + rank))
        packed = torch.from_numpy(packed[:, None, :]).to(device)
        rank = torch.from_numpy(rank).to(device)
    base_rows, filler = _page_rows(table, n > 0, Pv, page_size, Hkv)
    tensors = dict(
        Pv=Pv, K=K, shape=(table.shape[0], Hkv, K, page_size), packed=packed, rank=rank,
        phys_hb=torch.from_numpy(np.broadcast_to(phys[None], (Hkv,) + phys.shape).copy()).to(device),
        box_rows=torch.from_numpy(box_rows).to(device),
        forced=torch.from_numpy(forced[:, None, :]).to(device),
        forced_key=torch.from_numpy(forced_key[:, None, :]).to(device))
    return dict(K=K, base_rows=base_rows, filler=filler, template=template, tensors=tensors)


def host_copy(x: torch.Tensor) -> np.ndarray:
    """The tensor's values as an int64 NumPy array, always a copy: a view of a CPU int64 table would change under
    the plan when the caller reuses its buffer for the next step."""
    return x.detach().to("cpu", torch.int64, copy=True).numpy()

