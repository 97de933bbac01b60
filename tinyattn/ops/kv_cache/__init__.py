"""The page pool's upkeep: each page's key box (``k_min`` / ``k_max``, recomputed or grown by a write, rounded
outward when narrower than the keys), the int8 / fp8 scales, and the KV write that stores a step's K/V and keeps
both up to date.

Three forms of each rule, side by side: :mod:`.reference` (loops, the tests' oracle), :mod:`.torch_impl` (the
vectorised CPU path) and :mod:`.triton_impl` (launchers of ``kernels/metadata.py`` and ``kernels/kv_write.py``).
The public entry points are :func:`tinyattn.update_page_metadata` and :func:`tinyattn.ops.api.write_kv`
(:meth:`tinyattn.PagedKVCache.write` calls it). Source: Quest (Tang et al., ICML 2024, §3.2).
"""
