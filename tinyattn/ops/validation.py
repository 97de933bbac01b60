"""Input validation for the public ops.

Every check raises ``ValueError`` (bad shape or value) or ``TypeError`` (bad type or dtype) whose
message names the argument, the expected and the actual value, and never formats a tensor's
contents. Value checks that need the data (``seq_lens`` within capacity, block-table ids in range)
cost one host sync; :func:`value_checks` turns them off for hot loops whose inputs are trusted.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)       # pools that need k_scale / v_scale

_VALUE_CHECKS = True


@contextlib.contextmanager
def value_checks(enabled: bool):
    """Turn the data-dependent checks (one host sync per call) on or off inside a ``with`` block.

    The shape, dtype and device checks always run. Turn value checks off only for inputs built by
    :class:`tinyattn.cache.PagedKVCache` or already checked once.
    """
    global _VALUE_CHECKS
    previous, _VALUE_CHECKS = _VALUE_CHECKS, enabled
    try:
        yield
    finally:
        _VALUE_CHECKS = previous


#: the backends a ``backend=`` argument may name (DESIGN.md §4)
BACKENDS = ("torch", "triton")

_INTERPRET: bool | None = None


def _interpreting() -> bool:
    """TRITON_INTERPRET=1? Read once (the variable only counts when set before triton is imported); code that
    sets it later, as the CLI does for ``--backend triton`` on a CPU, resets ``_INTERPRET`` to ``None``."""
    global _INTERPRET
    if _INTERPRET is None:
        _INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
    return _INTERPRET


def resolve_backend(backend, device: torch.device) -> str:
    """``"triton"`` for CUDA tensors or under ``TRITON_INTERPRET=1``, else ``"torch"``; validate a forced one."""
    if backend is None:
        return "triton" if device.type == "cuda" or _interpreting() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton" and device.type != "cuda" and not _interpreting():
        raise ValueError(f"backend: 'triton' needs CUDA tensors or TRITON_INTERPRET=1 set before triton is "
                         f"imported, got tensors on {device}")
    return backend


def value_checks_active() -> bool:
    """Whether the data-dependent checks run now: on (see :func:`value_checks`) and not while ``torch.compile``
    traces. They read tensor values on the host (``int(...)``, ``.tolist()``), which would break a
    ``fullgraph=True`` trace; a compiled caller checks its inputs by running the op once eagerly."""
    if torch.compiler.is_compiling():
        return False
    return _VALUE_CHECKS


_Tensor = torch.Tensor
_memo = threading.local()     # per thread: the box pairs check_boxes_filled passed (see there)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def expect_tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def expect_dim(name: str, x: torch.Tensor, dims: tuple[int, ...], layout: str) -> None:
    if x.dim() not in dims:
        raise ValueError(f"{name}: expected a {layout} tensor ({' or '.join(map(str, dims))}-D), "
                         f"got shape {tuple(x.shape)}")


def expect_dtype(name: str, x: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if x.dtype not in dtypes:
        names = ", ".join(_dtype_name(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype in ({names}), got {_dtype_name(x.dtype)}")


def expect_shape(name: str, x: torch.Tensor, shape: tuple[int, ...], layout: str) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} {layout}, got {tuple(x.shape)}")


def expect_device(name: str, x: torch.Tensor, device: torch.device, ref_name: str) -> None:
    if x.device != device:
        raise ValueError(f"{name}: expected device {device} (that of {ref_name}), got {x.device}")


def expect_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
            value = int(value)
        else:
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class PagedShapes:
    """Sizes read off validated inputs: the names of DESIGN.md §2."""

    batch: int
    num_query_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int
    max_pages_per_seq: int


def check_query(q) -> torch.Tensor:
    expect_tensor("q", q)
    expect_dim("q", q, (3, 4), "[B, Hq, D] or [B, Tq, Hq, D]")
    expect_dtype("q", q, FLOAT_DTYPES + (torch.float64,))
    return q


def check_tables(block_table, seq_lens, batch: int | None, device: torch.device) -> None:
    """block_table [B, max_pages] and seq_lens [B], integer, on ``device``; ``batch=None`` takes B from the table."""
    expect_tensor("block_table", block_table)
    expect_tensor("seq_lens", seq_lens)
    expect_dim("block_table", block_table, (2,), "[B, max_pages_per_seq]")
    expect_dim("seq_lens", seq_lens, (1,), "[B]")
    expect_dtype("block_table", block_table, INDEX_DTYPES)
    expect_dtype("seq_lens", seq_lens, INDEX_DTYPES)
    batch = block_table.shape[0] if batch is None else batch
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table: expected {batch} rows (the batch size B of q), got {block_table.shape[0]}")
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens: expected {batch} entries (the batch size B of q), got {seq_lens.shape[0]}")
    expect_device("block_table", block_table, device, "q")
    expect_device("seq_lens", seq_lens, device, "q")


def check_table_values(block_table, seq_lens, page_size: int, num_pages: int | None) -> int | None:
    """seq_lens in [0, capacity] and every block-table entry of a valid page in [0, num_pages) (``>= 0`` when
    the pool size is not known yet, ``num_pages=None``). Returns the largest physical page id a valid page uses
    (``-1`` if none), learnt in the same host sync, or ``None`` when the checks did not run."""
    if not value_checks_active():
        return None
    if seq_lens.numel() == 0:
        return -1
    capacity = block_table.shape[1] * page_size
    lens = seq_lens.to(torch.int64)
    n_valid = (lens + page_size - 1) // page_size                              # [B]
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    used = cols[None, :] < n_valid[:, None]                                    # [B, P]
    bad_ids = used & (block_table < 0) if num_pages is None else used & ((block_table < 0) | (block_table >= num_pages))
    top = torch.where(used, block_table.to(torch.int64), -1).max() if used.numel() else lens.new_tensor(-1)
    stats = torch.stack([lens.min(), lens.max(), bad_ids.sum(), top]).tolist()      # one host sync
    if stats[0] < 0:
        raise ValueError(f"seq_lens: expected values >= 0, got a minimum of {stats[0]}")
    if stats[1] > capacity:
        raise ValueError(f"seq_lens: expected values <= {capacity} (max_pages_per_seq {block_table.shape[1]} "
                         f"x page_size {page_size}), got a maximum of {stats[1]}")
    if stats[2] > 0:
        row, col = bad_ids.nonzero()[0].tolist()
        want = "ids >= 0" if num_pages is None else f"ids in [0, {num_pages})"
        raise ValueError(f"block_table: expected physical page {want} for the valid pages of each "
                         f"row, got {int(block_table[row, col])} at [{row}, {col}]")
    return stats[3]


def check_paged_inputs(q, k_cache, v_cache, block_table, seq_lens, k_scale=None, v_scale=None, *,
                       values: bool = True) -> tuple[torch.Tensor, PagedShapes]:
    """Validate the arguments shared by every attention op; return q as [B, Tq, Hq, D] and the sizes.

    The pools hold ``q``'s dtype, or int8 / float8_e4m3fn with ``k_scale`` and ``v_scale`` ``[num_pages, Hkv]``
    fp32 (:mod:`tinyattn.ops.quant`). ``values``: also the table values (:func:`check_table_values`)."""
    q = check_query(q)
    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    B, Tq, Hq, D = q4.shape
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        expect_tensor(name, x)
        expect_dim(name, x, (4,), "[num_pages, page_size, Hkv, D]")
        expect_device(name, x, q.device, "q")
    check_kv_format(q, k_cache, v_cache, k_scale, v_scale)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: expected shape {tuple(k_cache.shape)} (that of k_cache), "
                         f"got {tuple(v_cache.shape)}")
    num_pages, page_size, Hkv, Dk = k_cache.shape
    if D < 1:
        raise ValueError(f"q: expected head_dim D >= 1 in the last dim, got shape {tuple(q.shape)}")
    if Dk != D:
        raise ValueError(f"k_cache: expected head_dim {D} (that of q) in dim 3, got {Dk}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"q: expected a number of query heads divisible by num_kv_heads={Hkv}, got Hq={Hq}")
    if page_size < 1:
        raise ValueError(f"k_cache: expected page_size >= 1 in dim 1, got {page_size}")
    check_tables(block_table, seq_lens, B, q.device)
    if values:
        check_table_values(block_table, seq_lens, page_size, num_pages)
    return q4, PagedShapes(B, Tq, Hq, Hkv, D, num_pages, page_size, block_table.shape[1])


def check_kv_format(q, k_cache, v_cache, k_scale, v_scale) -> None:
    """Pool dtypes and scales: both pools of ``q``'s dtype and no scales, or both int8 / both float8_e4m3fn with
    ``k_scale`` and ``v_scale`` fp32 ``[num_pages, Hkv]`` on ``q``'s device (pools already checked 4-D)."""
    quantized = k_cache.dtype in QUANTIZED_DTYPES
    if not quantized:
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if x.dtype != q.dtype:
                raise TypeError(f"{name}: expected dtype {_dtype_name(q.dtype)} (that of q), or int8 / "
                                f"float8_e4m3fn with k_scale and v_scale, got {_dtype_name(x.dtype)}")
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
            if x is not None:
                raise ValueError(f"{name}: expected None for a {_dtype_name(k_cache.dtype)} pool (scales go with "
                                 f"int8 / float8_e4m3fn pools only), got a tensor")
        return
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache: expected dtype {_dtype_name(k_cache.dtype)} (that of k_cache), "
                        f"got {_dtype_name(v_cache.dtype)}")
    shape = (k_cache.shape[0], k_cache.shape[2])
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if x is None:
            raise ValueError(f"{name}: expected a float32 [num_pages, Hkv] = {shape} tensor of scales for the "
                             f"{_dtype_name(k_cache.dtype)} pool, got None")
        expect_tensor(name, x)
        expect_dtype(name, x, (torch.float32,))
        expect_shape(name, x, shape, "[num_pages, Hkv]")
        expect_device(name, x, q.device, "q")


def kv_formats_supported(backend: str, device: torch.device) -> tuple[str, ...]:
    """The ``kv_cache_dtype`` formats ``backend`` runs on ``device``: all of them, except fp8 e4m3 on the Triton
    backend of a GPU below sm_89 (no e4m3 conversion in hardware; Triton rejects the type there)."""
    formats = ("auto", "fp16", "bf16", "int8", "fp8_e4m3")
    if backend == "triton" and device.type == "cuda" and torch.cuda.is_available():
        if torch.cuda.get_device_capability(device) < (8, 9):
            return formats[:-1]
    return formats


def check_kv_backend(k_cache, backend: str) -> None:
    """A quantized pool on a backend that cannot read it: a ValueError naming ``kv_cache_dtype`` and the formats
    that backend supports (see :func:`kv_formats_supported`)."""
    if k_cache.dtype not in QUANTIZED_DTYPES:
        return
    fmt = "int8" if k_cache.dtype == torch.int8 else "fp8_e4m3"
    supported = kv_formats_supported(backend, k_cache.device)
    if fmt not in supported:
        raise ValueError(f"kv_cache_dtype: the {backend} backend on {k_cache.device} supports {supported}, got "
                         f"{fmt!r} (a {_dtype_name(k_cache.dtype)} pool); use int8 or backend='torch'")


def box_dtype(q, k_cache) -> torch.dtype:
    """The dtype page boxes may hold besides float32: the pool's, or ``q``'s for a quantized pool."""
    return q.dtype if k_cache.dtype in QUANTIZED_DTYPES else k_cache.dtype


def check_page_bounds(k_min, k_max, num_pages: int, num_kv_heads: int, head_dim: int,
                      cache_dtype: torch.dtype, device: torch.device, whose: str = "the cache") -> None:
    """k_min / k_max: [num_pages, Hkv, D], dtype of the cache, float32, or (rounded outward) bfloat16 / float16
    (``whose``: what ``cache_dtype`` is the dtype of, for the message)."""
    for name, x in (("k_min", k_min), ("k_max", k_max)):
        expect_tensor(name, x)
        expect_shape(name, x, (num_pages, num_kv_heads, head_dim), "[num_pages, Hkv, D]")
        others = [d for d in (torch.float32, torch.bfloat16, torch.float16) if d != cache_dtype]
        if x.dtype != cache_dtype and x.dtype not in others:
            raise TypeError(f"{name}: expected dtype {_dtype_name(cache_dtype)} (that of {whose}) or "
                            f"{', '.join(map(_dtype_name, others))} (narrower boxes rounded outward), "
                            f"got {_dtype_name(x.dtype)}")
        if x.dtype != k_min.dtype:
            raise TypeError(f"k_max: expected the dtype of k_min ({_dtype_name(k_min.dtype)}), "
                            f"got {_dtype_name(x.dtype)}")
        expect_device(name, x, device, "q")


def check_boxes_filled(k_min, k_max, k_cache, block_table, seq_lens, page_size: int, k_scale=None) -> None:
    """With value checks on: every page in use (a valid page of a row, below ``seq_lens``) holds a bounding box
    that can be its keys': ``k_min <= k_max`` in every channel, no NaN, and the key in its slot 0 (always valid)
    inside the box. Boxes allocated with ``torch.empty`` (or NaN) and never filled by
    :func:`tinyattn.update_page_metadata` fail here instead of selecting arbitrary pages; zero-filled
    ones fail the slot-0 test unless the keys are zero there too.

    Args: ``k_min``, ``k_max`` ``[num_pages, Hkv, D]``; ``k_cache`` ``[num_pages, page_size, Hkv, D]`` (int8 /
    fp8 with ``k_scale`` ``[num_pages, Hkv]``: the dequantized key is compared); ``block_table`` ``[B, P]`` and
    ``seq_lens`` ``[B]`` already checked by :func:`check_table_values`. Cost: gathers ``2 + 1`` rows of
    ``Hkv x D`` per page in use and one host sync (measured in docs/api.md#value-checks).

    Runs with the other value checks (not under :func:`value_checks` ``(False)`` nor while ``torch.compile``
    traces), and not again for boxes and tables it already passed on this thread that no in-place write has
    touched since (keyed on each tensor's storage and version counter; the last 64 box pairs are kept, so a
    model's layers, each with its own boxes, are each checked once while nothing changes).

    Raises:
        ValueError naming ``k_min``/``k_max``, the physical page, KV head and channel, and saying to call
        ``update_page_metadata``.
    """
    if not _VALUE_CHECKS or torch.compiler.is_compiling() or seq_lens.numel() == 0:   # value_checks_active()
        return
    # inference tensors keep no version counter: those calls are always checked
    seen = None if (k_min.is_inference() or k_max.is_inference() or k_cache.is_inference() or
                    block_table.is_inference() or seq_lens.is_inference()) else (
        (k_min.data_ptr(), k_min._version), (k_max.data_ptr(), k_max._version), (k_cache.data_ptr(), k_cache._version),
        (block_table.data_ptr(), block_table._version), (seq_lens.data_ptr(), seq_lens._version))
    passed = getattr(_memo, "boxes", None)
    if passed is None:
        passed = _memo.boxes = {}
    if seen is not None and passed.get(seen[:2]) == seen[2:]:
        return
    lens = seq_lens.to(torch.int64)
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    used = cols[None, :] < ((lens + page_size - 1) // page_size)[:, None]          # [B, P]
    pages = block_table[used].to(torch.int64).clamp_(min=0)                         # [U] physical pages in use
    lo, hi = k_min.index_select(0, pages).float(), k_max.index_select(0, pages).float()       # [U, Hkv, D]
    key = k_cache.select(1, 0).index_select(0, pages).float()                       # [U, Hkv, D] slot 0
    if k_scale is not None:
        key = key * k_scale.index_select(0, pages).float()[..., None]
    empty = ~(lo <= hi)                                      # k_min > k_max, or NaN in either
    outside = torch.isfinite(key) & ((key < lo) | (key > hi))
    bad = empty | outside
    if not bool(bad.any()):                                  # one host sync
        if seen is not None:
            if len(passed) >= 64:
                passed.clear()
            passed[seen[:2]] = seen[2:]
        return
    i, h, d = bad.nonzero()[0].tolist()
    what = ("k_min > k_max or NaN" if bool(empty[i, h, d]) else
            f"a box that does not hold the page's first key ({float(key[i, h, d]):.4g} outside "
            f"[{float(lo[i, h, d]):.4g}, {float(hi[i, h, d]):.4g}])")
    raise ValueError(f"k_min, k_max: expected the bounding box of each page in use (k_min <= k_max in every "
                     f"channel, no NaN, holding the page's keys), got {what} at physical page {int(pages[i])}, KV "
                     f"head {h}, channel {d}. Fill the boxes with tinyattn.update_page_metadata(k_cache, block_table, "
                     f"seq_lens, k_min, k_max) after writing keys (PagedKVCache.write keeps them up to date).")


def check_page_indices(page_indices, shapes: PagedShapes, device: torch.device) -> None:
    expect_tensor("page_indices", page_indices)
    expect_dim("page_indices", page_indices, (3,), "[B, Hkv, page_budget]")
    expect_dtype("page_indices", page_indices, INDEX_DTYPES)
    if tuple(page_indices.shape[:2]) != (shapes.batch, shapes.num_kv_heads):
        raise ValueError(f"page_indices: expected shape [B={shapes.batch}, Hkv={shapes.num_kv_heads}, page_budget], "
                         f"got {tuple(page_indices.shape)}")
    expect_device("page_indices", page_indices, device, "q")
    if value_checks_active() and page_indices.numel() and int(page_indices.min()) < -1:
        raise ValueError(f"page_indices: expected logical page ids >= -1 (-1 = padding), "
                         f"got a minimum of {int(page_indices.min())}")


def check_selection_options(page_budget, num_sink_pages, num_recent_pages) -> tuple[int, int, int]:
    """Ints ``page_budget >= 1``, ``num_sink_pages >= 0``, ``num_recent_pages >= 0``, and a budget that holds
    the always-kept pages: ``num_sink_pages + max(num_recent_pages, 1) <= page_budget`` (the partial last page
    is always kept, so at least one recent page counts). The one rule of the ops, the references,
    :class:`tinyattn.models.SparsityConfig`, the HF cache and the CLI."""
    page_budget = expect_int("page_budget", page_budget, 1)
    num_sink_pages = expect_int("num_sink_pages", num_sink_pages, 0)
    num_recent_pages = expect_int("num_recent_pages", num_recent_pages, 0)
    forced = num_sink_pages + max(num_recent_pages, 1)
    if forced > page_budget:
        raise ValueError(f"page_budget: expected at least num_sink_pages + max(num_recent_pages, 1) = "
                         f"{num_sink_pages} + {max(num_recent_pages, 1)} = {forced} (the pages always kept), got "
                         f"page_budget={page_budget} with num_sink_pages={num_sink_pages}, "
                         f"num_recent_pages={num_recent_pages}")
    return page_budget, num_sink_pages, num_recent_pages


def check_query_pages_fit(seq_lens, num_query_tokens: int, page_size: int, page_budget: int) -> None:
    """With Tq > 1 every page holding a query must be kept: the budget has to cover them."""
    if num_query_tokens <= 1 or not value_checks_active() or seq_lens.numel() == 0:
        return
    check_query_pages_fit_host(seq_lens.tolist(), num_query_tokens, page_size, page_budget)   # one host sync


def check_query_pages_fit_host(lens: list[int], num_query_tokens: int, page_size: int, page_budget: int) -> None:
    """:func:`check_query_pages_fit` on lengths already on the host (no sync)."""
    if num_query_tokens <= 1:
        return
    needed = max((-(-n // page_size) - max(n - num_query_tokens, 0) // page_size for n in lens), default=0)
    if needed > page_budget:
        raise ValueError(f"page_budget: expected at least {needed} (the pages holding the Tq={num_query_tokens} "
                         f"query tokens), got {page_budget}")


def check_metadata_inputs(k_cache, block_table, seq_lens, k_min, k_max, k_scale=None) -> tuple[int, int, int, int]:
    """Arguments of ``update_page_metadata``; returns ``(num_pages, page_size, Hkv, D)`` of ``k_cache``. An int8 /
    float8_e4m3fn pool needs ``k_scale`` ``[num_pages, Hkv]`` fp32 and fp32 boxes."""
    expect_tensor("k_cache", k_cache)
    expect_dim("k_cache", k_cache, (4,), "[num_pages, page_size, Hkv, D]")
    expect_dtype("k_cache", k_cache, FLOAT_DTYPES + (torch.float64,) + QUANTIZED_DTYPES)
    num_pages, page_size, Hkv, D = k_cache.shape
    check_key_scale(k_cache, k_scale, k_cache.device, "k_cache")
    if page_size < 1:
        raise ValueError(f"k_cache: expected page_size >= 1 in dim 1, got {page_size}")
    check_tables(block_table, seq_lens, None, k_cache.device)
    check_table_values(block_table, seq_lens, page_size, num_pages)
    check_page_bounds(k_min, k_max, num_pages, Hkv, D,
                      torch.float32 if k_cache.dtype in QUANTIZED_DTYPES else k_cache.dtype, k_cache.device)
    return num_pages, page_size, Hkv, D


def check_scoring_inputs(q, k_min, k_max, block_table, seq_lens, page_size,
                         gamma=1.0) -> tuple[torch.Tensor, int]:
    """Arguments of ``page_scores`` (``gamma`` included: :func:`check_gamma`); returns q as ``[B, Tq, Hq, D]`` and
    ``page_size``."""
    check_gamma(gamma)
    q = check_query(q)
    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    page_size = expect_int("page_size", page_size, 1)
    expect_tensor("k_min", k_min)
    expect_dim("k_min", k_min, (3,), "[num_pages, Hkv, D]")
    num_pages, Hkv, D = k_min.shape
    if q4.shape[-1] != D:
        raise ValueError(f"k_min: expected head_dim {q4.shape[-1]} (that of q) in dim 2, got {D}")
    if Hkv == 0 or q4.shape[2] % Hkv != 0:
        raise ValueError(f"q: expected a number of query heads divisible by num_kv_heads={Hkv}, got Hq={q4.shape[2]}")
    # no pool here: the boxes may hold q's dtype (the pool's, or what an int8 / fp8 pool's boxes may hold) or a
    # float one; k_min's own dtype would let integer boxes through
    check_page_bounds(k_min, k_max, num_pages, Hkv, D, q.dtype, q.device, whose="q")
    check_tables(block_table, seq_lens, q4.shape[0], q.device)
    check_table_values(block_table, seq_lens, page_size, num_pages)
    return q4, page_size


def check_select_inputs(scores, seq_lens, page_size, page_budget, num_sink_pages, num_recent_pages,
                        num_query_tokens, top_p=None, scale=None) -> dict:
    """Arguments of ``select_pages``; returns its keyword options as checked ints (and ``top_p``, ``scale``: the
    softmax scale of the mass, required with ``top_p``, a finite number > 0)."""
    top_p = check_top_p(top_p)
    if top_p is not None:
        if scale is None:
            raise ValueError(f"scale: expected the softmax scale of the estimated mass with top_p={top_p} (e.g. "
                             f"head_dim ** -0.5 for page_scores' logits), got None")
        scale = check_top_p_scale(scale)
    elif scale is not None:
        scale = check_scale(scale, 1)
    expect_tensor("scores", scores)
    expect_dim("scores", scores, (3,), "[B, Hkv, max_pages_per_seq]")
    expect_dtype("scores", scores, (torch.float32,))
    page_budget, num_sink_pages, num_recent_pages = check_selection_options(
        page_budget, num_sink_pages, num_recent_pages)
    page_size = expect_int("page_size", page_size, 1)
    num_query_tokens = expect_int("num_query_tokens", num_query_tokens, 1)
    expect_tensor("seq_lens", seq_lens)
    expect_dim("seq_lens", seq_lens, (1,), "[B]")
    expect_dtype("seq_lens", seq_lens, INDEX_DTYPES)
    if seq_lens.shape[0] != scores.shape[0]:
        raise ValueError(f"seq_lens: expected {scores.shape[0]} entries (dim 0 of scores), got {seq_lens.shape[0]}")
    expect_device("seq_lens", seq_lens, scores.device, "scores")
    if value_checks_active() and seq_lens.numel():
        low, top = torch.stack([seq_lens.min(), seq_lens.max()]).tolist()           # one host sync
        if top > scores.shape[2] * page_size or low < 0:
            raise ValueError(f"seq_lens: expected values in [0, {scores.shape[2] * page_size}] (pages in scores x "
                             f"page_size), got range [{low}, {top}]")
    check_query_pages_fit(seq_lens, num_query_tokens, page_size, page_budget)
    return dict(page_size=page_size, page_budget=page_budget, num_sink_pages=num_sink_pages,
                num_recent_pages=num_recent_pages, num_query_tokens=num_query_tokens, top_p=top_p, scale=scale)


def check_sparse_selection(shapes: PagedShapes, q, k_cache, seq_lens, page_indices, k_min, k_max, page_budget,
                           num_sink_pages, num_recent_pages, *, values: bool = True) -> dict:
    """The page arguments of ``sparse_paged_attention``: either ``page_indices``, or ``k_min``, ``k_max`` and
    ``page_budget`` together. Returns the selection rules ``{page_budget, num_sink_pages, num_recent_pages}``
    (with ``page_indices``: its width and the rules the caller says it chose them under). ``values``: also check
    that the budget holds the pages of the ``Tq`` queries (a host sync)."""
    if page_indices is None:
        if k_min is None or k_max is None or page_budget is None:
            missing = [n for n, x in (("k_min", k_min), ("k_max", k_max), ("page_budget", page_budget)) if x is None]
            raise ValueError(f"page_indices: expected page_indices, or k_min, k_max and page_budget together; "
                             f"got page_indices=None and no {', '.join(missing)}")
        check_page_bounds(k_min, k_max, shapes.num_pages, shapes.num_kv_heads, shapes.head_dim,
                          box_dtype(q, k_cache), q.device)
        options = dict(zip(("page_budget", "num_sink_pages", "num_recent_pages"),
                           check_selection_options(page_budget, num_sink_pages, num_recent_pages)))
        if values:
            check_query_pages_fit(seq_lens, shapes.num_query_tokens, shapes.page_size, options["page_budget"])
        return options
    given = [n for n, x in (("k_min", k_min), ("k_max", k_max), ("page_budget", page_budget)) if x is not None]
    if given:
        raise ValueError(f"page_indices: expected either page_indices or k_min, k_max and page_budget, "
                         f"got page_indices together with {', '.join(given)}")
    check_page_indices(page_indices, shapes, q.device)
    return dict(page_budget=page_indices.shape[-1], num_sink_pages=expect_int("num_sink_pages", num_sink_pages, 0),
                num_recent_pages=expect_int("num_recent_pages", num_recent_pages, 0))


def check_window_left(window_left) -> int:
    """``window_left`` (FlashInfer's convention): keys a query sees before its own position; ``-1`` = no limit.

    Raises ``TypeError`` for a non-int (bool included), ``ValueError`` below ``-1``."""
    if type(window_left) is int and window_left >= -1:     # the common case, without the slow ABC check
        return window_left
    if isinstance(window_left, bool) or not isinstance(window_left, numbers.Integral):   # NumPy ints too
        raise TypeError(f"window_left: expected an int (-1 = no window, W - 1 for a sliding window of W tokens), "
                        f"got {type(window_left).__name__}")
    if window_left < -1:
        raise ValueError(f"window_left: expected an int >= -1 (-1 = no window), got {window_left}")
    return int(window_left)


def check_window_selection(window_left: int, num_sink_pages: int) -> None:
    """A windowed selection forces no sink pages: the window hides them once it has slid past them."""
    if window_left >= 0 and num_sink_pages:
        raise ValueError(f"num_sink_pages: expected 0 with a sliding window (window_left={window_left} hides the "
                         f"first pages once it slides past them), got {num_sink_pages}")


def check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):      # numbers.Real: NumPy floats too
        raise TypeError(f"scale: expected a real number (float) or None, got {type(scale).__name__}")
    scale = float(scale)
    if not (scale == scale and abs(scale) != float("inf")):
        raise ValueError(f"scale: expected a finite float, got {scale}")
    return scale


def check_gamma(gamma) -> float:
    """``gamma``: the share of the box half-width in the page estimate (``q·c + gamma·|q|·r``), a real in ``[0, 1]``
    (``1``: Quest's bound). Raises ``TypeError`` for a non-real (bool included), ``ValueError`` outside ``[0, 1]``."""
    if type(gamma) is float and 0.0 <= gamma <= 1.0:         # the common case, without the slow ABC check
        return gamma
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Real):
        raise TypeError(f"gamma: expected a real number in [0, 1] (1 = Quest's bound), got {type(gamma).__name__}")
    gamma = float(gamma)
    if not 0.0 <= gamma <= 1.0:                              # NaN fails too
        raise ValueError(f"gamma: expected a number in [0, 1] (1 = Quest's bound), got {gamma}")
    return gamma


def check_top_p(top_p) -> float | None:
    """``top_p``: ``None`` (a fixed budget) or the estimated attention mass to reach, a real in ``(0, 1]``.
    Raises ``TypeError`` for a non-real (bool included), ``ValueError`` outside ``(0, 1]``."""
    if top_p is None or (type(top_p) is float and 0.0 < top_p <= 1.0):
        return top_p
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real):
        raise TypeError(f"top_p: expected None or a real number in (0, 1], got {type(top_p).__name__}")
    top_p = float(top_p)
    if not 0.0 < top_p <= 1.0:                               # NaN fails too
        raise ValueError(f"top_p: expected None or a number in (0, 1], got {top_p}")
    return top_p


def check_no_box_rules(gamma: float, top_p: float | None, where: str, instead: str, rerank=None) -> None:
    """``gamma``, ``top_p`` and ``rerank`` shape a selection by boxes: where none happens (listed ``page_indices``, a
    plan without ``page_budget``) a value other than the default would be ignored, so it is an error instead."""
    if rerank is not None:
        raise ValueError(f"rerank: expected None {where} (rerank ranks the candidates of a selection by boxes: "
                         f"{instead}), got {rerank!r}")
    if top_p is not None:
        raise ValueError(f"top_p: expected None {where} (top_p prunes a selection by boxes: {instead}), got {top_p}")
    if gamma != 1.0:
        raise ValueError(f"gamma: expected the default 1.0 {where} (gamma is the page estimate of a selection by "
                         f"boxes: {instead}), got {gamma}")


RERANKS = ("int4",)


def check_rerank(rerank, candidates) -> tuple[str | None, float]:
    """``rerank``: ``None`` or one of :data:`RERANKS`; ``candidates``: the share of ``page_budget`` the estimate
    hands to the re-rank, a finite real ``>= 1`` (``ceil(candidates · page_budget)`` pages), ``1.0`` without a
    re-rank (a setting nothing reads would be silent)."""
    if rerank is not None and rerank not in RERANKS:
        raise ValueError(f"rerank: expected None or one of {RERANKS}, got {rerank!r}")
    if isinstance(candidates, bool) or not isinstance(candidates, numbers.Real):
        raise TypeError(f"candidates: expected a real number >= 1 (a multiple of page_budget), got "
                        f"{type(candidates).__name__}")
    candidates = float(candidates)
    if not (1.0 <= candidates < float("inf")):
        raise ValueError(f"candidates: expected a finite number >= 1 (a multiple of page_budget), got {candidates}")
    if rerank is None and candidates != 1.0:
        raise ValueError(f"candidates: expected 1.0 without rerank (only the re-rank reads the estimate's "
                         f"candidates), got {candidates}; pass rerank='int4'")
    return rerank, candidates


def check_key_codes(k_code, rerank, k_cache, q) -> None:
    """``k_code``: ``[num_pages, page_size, Hkv, D/2]`` uint8 on the pool's device with ``rerank``, ``None``
    without (a code tensor nothing reads would be silent)."""
    if rerank is None:
        if k_code is not None:
            raise ValueError("k_code: expected None without rerank (only the re-rank reads the key codes), got a "
                             "tensor; pass rerank='int4'")
        return
    D = q.shape[-1]
    if D % 2:
        raise ValueError(f"rerank: expected an even head_dim (two 4-bit codes per byte), got head_dim={D}")
    if k_code is None:
        raise ValueError("k_code: expected the pool's 4-bit key codes with rerank='int4' (a cache made with "
                         "PagedKVCache(..., key_codes=True): its k_code[layer]), got None")
    expect_tensor("k_code", k_code)
    want = (k_cache.shape[0], k_cache.shape[1], k_cache.shape[2], D // 2)
    expect_shape("k_code", k_code, want, "[num_pages, page_size, Hkv, D/2]")
    expect_dtype("k_code", k_code, (torch.uint8,))
    expect_device("k_code", k_code, k_cache.device, "k_cache")


def check_rerank_pool(k_cache, k_scale, k_min, q4) -> None:
    """The pool of :func:`tinyattn.rerank_scores` (it reads each row's last page from it): ``[num_pages, page_size,
    Hkv, D]`` with the boxes' ``num_pages`` and ``Hkv`` and ``q``'s ``D``, on ``q``'s device; a float pool with no
    ``k_scale``, or int8 / float8_e4m3fn with ``k_scale`` fp32 ``[num_pages, Hkv]``. A kernel would otherwise read a
    smaller pool out of bounds, or an int8 pool's codes as values (``k_cache`` already checked 4-D)."""
    num_pages, Hkv, D = k_min.shape
    expect_dtype("k_cache", k_cache, FLOAT_DTYPES + (torch.float64,) + QUANTIZED_DTYPES)
    expect_shape("k_cache", k_cache, (num_pages, k_cache.shape[1], Hkv, D),
                 "[num_pages, page_size, Hkv, D] (num_pages and Hkv of k_min, D of q)")
    expect_device("k_cache", k_cache, q4.device, "q")
    check_key_scale(k_cache, k_scale, q4.device, "q")


def check_key_scale(k_cache, k_scale, device, device_name: str) -> None:
    """``k_scale`` of a pool ``k_cache`` ``[num_pages, page_size, Hkv, D]`` (already checked): fp32
    ``[num_pages, Hkv]`` on ``device`` for an int8 / float8_e4m3fn pool, ``None`` for a float one."""
    num_pages, _, Hkv, _ = k_cache.shape
    if k_cache.dtype not in QUANTIZED_DTYPES:
        if k_scale is not None:
            raise ValueError(f"k_scale: expected None for a {_dtype_name(k_cache.dtype)} pool (scales go with int8 / "
                             f"float8_e4m3fn pools only), got a tensor")
        return
    if k_scale is None:
        raise ValueError(f"k_scale: expected a float32 [num_pages, Hkv] = {(num_pages, Hkv)} tensor of scales for the "
                         f"{_dtype_name(k_cache.dtype)} pool, got None")
    expect_tensor("k_scale", k_scale)
    expect_dtype("k_scale", k_scale, (torch.float32,))
    expect_shape("k_scale", k_scale, (num_pages, Hkv), "[num_pages, Hkv]")
    expect_device("k_scale", k_scale, device, device_name)


def check_candidates(candidates, batch: int, num_kv_heads: int, device) -> None:
    """``candidates`` of :func:`tinyattn.rerank_scores`: ``[B, Hkv, C]`` int32 / int64 on ``q``'s device."""
    expect_tensor("candidates", candidates)
    expect_dtype("candidates", candidates, INDEX_DTYPES)
    if candidates.dim() != 3 or tuple(candidates.shape[:2]) != (batch, num_kv_heads):
        raise ValueError(f"candidates: expected shape [B={batch}, Hkv={num_kv_heads}, C], got "
                         f"{tuple(candidates.shape)}")
    expect_device("candidates", candidates, device, "q")


def check_code_inputs(k_cache, slots, k_min, k_max, k_code, k_scale) -> None:
    """Arguments of :func:`tinyattn.encode_key_codes`: the pool and boxes as :func:`check_metadata_inputs` reads
    them, ``slots`` ``[N]`` int on the pool's device, ``k_code`` ``[num_pages, page_size, Hkv, D/2]`` uint8."""
    expect_tensor("k_cache", k_cache)
    expect_dim("k_cache", k_cache, (4,), "[num_pages, page_size, Hkv, D]")
    expect_tensor("slots", slots)
    expect_dtype("slots", slots, INDEX_DTYPES)
    if slots.dim() != 1:
        raise ValueError(f"slots: expected a [N] tensor, got shape {tuple(slots.shape)}")
    expect_device("slots", slots, k_cache.device, "k_cache")
    num_pages, _, Hkv, D = k_cache.shape
    check_page_bounds(k_min, k_max, num_pages, Hkv, D,
                      torch.float32 if k_cache.dtype in QUANTIZED_DTYPES else k_cache.dtype, k_cache.device)
    if D % 2:
        raise ValueError(f"k_cache: expected an even head_dim (two 4-bit codes per byte), got head_dim={D}")
    expect_tensor("k_code", k_code)
    expect_shape("k_code", k_code, (num_pages, k_cache.shape[1], Hkv, D // 2), "[num_pages, page_size, Hkv, D/2]")
    expect_dtype("k_code", k_code, (torch.uint8,))
    expect_device("k_code", k_code, k_cache.device, "k_cache")
    if k_cache.dtype in QUANTIZED_DTYPES:
        expect_tensor("k_scale", k_scale)
        expect_shape("k_scale", k_scale, (num_pages, Hkv), "[num_pages, Hkv]")
    capacity = num_pages * k_cache.shape[1]
    if value_checks_active() and slots.numel():       # the kernel would code a page past the pool (one host sync)
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= capacity:
            raise ValueError(f"slots: expected values in [0, {capacity}) (num_pages x page_size), got range "
                             f"[{lo}, {hi}]")


def check_top_p_scale(scale) -> float:
    """The softmax scale of a top-p selection's estimated mass: a finite real ``> 0``."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a real number > 0 with top_p (the softmax scale of the estimated mass), "
                        f"got {type(scale).__name__}")
    scale = float(scale)
    if not (0.0 < scale < float("inf")):
        raise ValueError(f"scale: expected a finite number > 0 with top_p (the softmax scale of the estimated "
                         f"mass), got {scale}")
    return scale


def check_kernel_page_size(page_size: int) -> None:
    """The Triton kernels tile pages with ``tl.arange(0, page_size)``: a power of two (vLLM uses 8/16/32)."""
    if page_size & (page_size - 1):
        raise ValueError(f"page_size: expected a power of two for the Triton backend (or backend='torch'), "
                         f"got {page_size}")


def check_write_inputs(k, v, slots, k_cache, v_cache, k_min, k_max, k_scale, v_scale, fill) -> None:
    """Arguments of :func:`tinyattn.ops.api.write_kv`: shapes, dtypes and devices (no data-dependent check: no
    host sync)."""
    for name, x in (("k", k), ("v", v), ("slots", slots), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(x).__name__}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache: expected the shape and dtype of k_cache {tuple(k_cache.shape)} {k_cache.dtype} "
                         f"[num_pages, page_size, Hkv, D], got {tuple(v_cache.shape)} {v_cache.dtype}")
    num_pages, _, Hkv, D = k_cache.shape
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slots: expected a 1-D int32/int64 tensor, got {slots.dtype} of shape {tuple(slots.shape)}")
    for name, x in (("k", k), ("v", v)):
        if tuple(x.shape) != (slots.shape[0], Hkv, D):
            raise ValueError(f"{name}: expected shape {(slots.shape[0], Hkv, D)} [N, Hkv, D], got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{name}: expected a float tensor, got {x.dtype}")
    if (k_min is None) != (k_max is None):
        raise ValueError("k_min, k_max: expected both or neither")
    if k_min is not None:
        for name, x in (("k_min", k_min), ("k_max", k_max)):
            if tuple(x.shape) != (num_pages, Hkv, D) or x.dtype != k_min.dtype:
                raise ValueError(f"{name}: expected shape {(num_pages, Hkv, D)} of one dtype, got "
                                 f"{tuple(x.shape)} {x.dtype}")
    if k_cache.dtype in QUANTIZED_DTYPES:
        for name, x, shape, dtype in (("k_scale", k_scale, (num_pages, Hkv), torch.float32),
                                      ("v_scale", v_scale, (num_pages, Hkv), torch.float32),
                                      ("fill", fill, (num_pages,), torch.int64)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape or x.dtype != dtype:
                got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else repr(x)
                raise ValueError(f"{name}: expected a {dtype} tensor of shape {shape} for a {k_cache.dtype} pool, "
                                 f"got {got}")
    for name, x in (("k", k), ("v", v), ("slots", slots), ("v_cache", v_cache), ("k_min", k_min),
                    ("k_max", k_max), ("k_scale", k_scale), ("v_scale", v_scale), ("fill", fill)):
        if isinstance(x, torch.Tensor) and x.device != k_cache.device:
            raise ValueError(f"{name}: expected a tensor on {k_cache.device} (k_cache's device), got {x.device}")


class Call(NamedTuple):
    """A checked call of an attention op: its backend, softmax scale and window; ``step``: the sizes and rules a
    plan's :class:`~tinyattn.ops.step.Step` must have to serve it (``Step[1:17]``); ``plan_args``: the keyword
    arguments of :meth:`tinyattn.PagedAttentionPlan.plan` that give that step; ``num_pages``: the pool's pages
    (the bound of the block-table ids, checked with the table values by :func:`check_step_values`)."""
    backend: str
    scale: float
    window_left: int
    step: tuple
    plan_args: dict
    num_pages: int


_T = torch.Tensor
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INDEX = (torch.int32, torch.int64)


def _call(q, num_pages, page_size, num_kv_heads, max_pages, scale, backend, window_left, page_budget=None,
          num_sink_pages=0, num_recent_pages=1, gamma=1.0, top_p=None, rerank=None, candidates=1.0) -> Call:
    """The :class:`Call` of checked arguments (``scale``, ``backend`` and ``window_left`` are checked here;
    ``gamma`` and ``top_p`` by the caller)."""
    Tq = 1 if q.dim() == 3 else q.shape[1]
    B, Hq, D = q.shape[0], q.shape[-2], q.shape[-1]
    if scale is None:
        scale = D ** -0.5
    elif type(scale) is not float or scale != scale or abs(scale) == float("inf"):
        scale = check_scale(scale, D)
    if backend == "torch" or (backend is None and q.is_cpu and _INTERPRET is False):
        backend = "torch"                      # the common CPU cases, without a call
    else:
        backend = resolve_backend(backend, q.device)
    if type(window_left) is not int or window_left < -1:
        window_left = check_window_left(window_left)
    if top_p is not None and scale <= 0:
        check_top_p_scale(scale)
    step = (q.device, B, max_pages, Hq, num_kv_heads, D, page_size, Tq, page_budget, num_sink_pages,
            num_recent_pages, scale, gamma, top_p, rerank, candidates)
    args = dict(num_q_heads=Hq, num_kv_heads=num_kv_heads, head_dim=D, page_size=page_size, num_query_tokens=Tq,
                page_budget=page_budget, num_sink_pages=num_sink_pages, num_recent_pages=num_recent_pages,
                scale=scale, gamma=gamma, top_p=top_p, rerank=rerank, candidates=candidates)
    if backend == "triton":
        check_kernel_page_size(page_size)
    return Call(backend, scale, window_left, step, args, num_pages)


def _plain_pools(q, k_cache, v_cache, block_table, seq_lens):
    """The common case of :func:`check_paged_inputs`, tested inline (no call per argument): plain tensors, a float
    pool of ``q``'s dtype, int tables, one device, matching sizes. ``False`` sends the call to the detailed
    checks, which name what is wrong (or accept a less common case: quantized pools, subclasses)."""
    return (type(q) is _T and type(k_cache) is _T and type(v_cache) is _T and type(block_table) is _T
            and type(seq_lens) is _T and q.dim() in (3, 4) and q.dtype in _FLOATS and k_cache.dim() == 4
            and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype and v_cache.shape == k_cache.shape
            and block_table.dim() == 2 and seq_lens.dim() == 1 and block_table.dtype in _INDEX
            and seq_lens.dtype in _INDEX and k_cache.device == q.device and v_cache.device == q.device
            and block_table.device == q.device and seq_lens.device == q.device
            and block_table.shape[0] == q.shape[0] == seq_lens.shape[0] and k_cache.shape[3] == q.shape[-1] >= 1
            and k_cache.shape[1] >= 1 and k_cache.shape[2] >= 1 and q.shape[-2] % k_cache.shape[2] == 0)


def check_attention(q, k_cache, v_cache, block_table, seq_lens, scale, backend, k_scale, v_scale,
                    window_left) -> Call:
    """The arguments of :func:`tinyattn.paged_attention` but the table values (:func:`check_step_values`, run when
    a plan is made for new tables): shapes, dtypes, devices, KV format, scale, backend, window."""
    if k_scale is None and v_scale is None and _plain_pools(q, k_cache, v_cache, block_table, seq_lens):
        num_pages, page_size, Hkv, _ = k_cache.shape
    else:
        _, shapes = check_paged_inputs(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, values=False)
        num_pages, page_size, Hkv = shapes.num_pages, shapes.page_size, shapes.num_kv_heads
    call = _call(q, num_pages, page_size, Hkv, block_table.shape[1], scale, backend, window_left)
    if call.backend == "triton":
        check_kv_backend(k_cache, call.backend)
    return call


def check_sparse_attention(q, k_cache, v_cache, block_table, seq_lens, page_indices, k_min, k_max, page_budget,
                           num_sink_pages, num_recent_pages, scale, backend, k_scale, v_scale, window_left,
                           gamma=1.0, top_p=None, rerank=None, candidates=1.0, k_code=None) -> Call:
    """The arguments of :func:`tinyattn.sparse_paged_attention` but the table values: those of
    :func:`check_attention`, the pages (listed, or boxes of the pool's shape and a budget that holds the forced
    pages) and the window rule (no sink pages with a window and a selection by boxes). With ``page_indices`` the
    plan has no budget: the list's width is the budget, and the forced-page counts only describe how the list was
    chosen. The boxes' values are checked by :func:`check_boxes_filled`, the tables' by :func:`check_step_values`."""
    if (page_indices is None and k_scale is None and v_scale is None and type(k_min) is _T
            and type(k_max) is _T and type(page_budget) is int and type(num_sink_pages) is int
            and type(num_recent_pages) is int and num_sink_pages >= 0 and num_recent_pages >= 0
            and num_sink_pages + max(num_recent_pages, 1) <= page_budget
            and (window_left == -1 or num_sink_pages == 0)
            and _plain_pools(q, k_cache, v_cache, block_table, seq_lens) and k_min.dtype == k_max.dtype
            and (k_min.dtype == k_cache.dtype or k_min.dtype in _FLOATS)
            and k_min.shape == k_max.shape == (k_cache.shape[0], k_cache.shape[2], k_cache.shape[3])
            and k_min.device == q.device and k_max.device == q.device
            and type(gamma) is float and 0.0 <= gamma <= 1.0 and rerank is None and k_code is None
            and candidates == 1.0 and type(candidates) in (float, int)
            and (top_p is None or (type(top_p) is float and 0.0 < top_p <= 1.0))):
        num_pages, page_size, Hkv, _ = k_cache.shape
        rules = dict(page_budget=page_budget, num_sink_pages=num_sink_pages, num_recent_pages=num_recent_pages,
                     gamma=gamma, top_p=top_p)
    else:
        gamma, top_p = check_gamma(gamma), check_top_p(top_p)
        _, shapes = check_paged_inputs(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, values=False)
        rules = check_sparse_selection(shapes, q, k_cache, seq_lens, page_indices, k_min, k_max, page_budget,
                                       num_sink_pages, num_recent_pages, values=False)
        rerank, candidates = check_rerank(rerank, candidates)
        if page_indices is None:
            check_window_selection(check_window_left(window_left), rules["num_sink_pages"])
            rules.update(gamma=gamma, top_p=top_p, rerank=rerank, candidates=candidates)
            check_key_codes(k_code, rerank, k_cache, q)
        else:
            check_no_box_rules(gamma, top_p, "with page_indices", "pass k_min, k_max and page_budget", rerank)
            check_key_codes(k_code, None, k_cache, q)
            rules["page_budget"] = None
        num_pages, page_size, Hkv = shapes.num_pages, shapes.page_size, shapes.num_kv_heads
    call = _call(q, num_pages, page_size, Hkv, block_table.shape[1], scale, backend, window_left, **rules)
    if call.backend == "triton":
        check_kv_backend(k_cache, call.backend)
    return call


def check_step_values(block_table, seq_lens, call: Call) -> None:
    """The data-dependent checks of an attention call (one host sync; skipped under :func:`value_checks`
    ``(False)`` and while ``torch.compile`` traces): ``seq_lens`` within the table, the block-table ids of valid
    pages within the pool, and a budget that holds the pages of the ``Tq`` queries."""
    check_table_values(block_table, seq_lens, call.plan_args["page_size"], call.num_pages)
    if call.plan_args["page_budget"] is not None:
        check_query_pages_fit(seq_lens, call.plan_args["num_query_tokens"], call.plan_args["page_size"],
                              call.plan_args["page_budget"])
