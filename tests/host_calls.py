"""What a CUDA graph capture forbids, watched on the CPU: host syncs (a tensor's value read on the host) and tensor
allocations made by tinyattn's own code. Shared by the plan's graph-mode tests (tests/ops/test_plan.py, test_top_p.py,
test_rerank.py: their pool, tables and per-step check are here too) and the runtime's captured decode body
(tests/models/test_graphs.py)."""

from __future__ import annotations

import sys

import torch

SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero")
FACTORIES = ("empty", "empty_like", "zeros", "zeros_like", "full", "full_like", "ones", "ones_like", "tensor",
             "arange", "empty_strided")
METHOD_FACTORIES = ("new_empty", "new_zeros", "new_full", "new_ones", "new_tensor", "clone")


def _from_tinyattn() -> bool:
    """Whether the frame that called the patched function is tinyattn's own code (the Triton interpreter itself
    moves launch arguments through numpy: that is the stand-in for a GPU, not a host sync of tinyattn's)."""
    name = sys._getframe(2).f_globals.get("__name__", "")
    return name == "tinyattn" or name.startswith("tinyattn.")


def watch_host_calls(monkeypatch, seen: list) -> None:
    """Patch the host-sync methods and the tensor factories so that each call from tinyattn's code appends its name
    to ``seen`` (the call itself still runs). ``monkeypatch.undo()`` ends the watch."""
    for name in SYNCS:
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _r=real, _n=name, **k:
                            (_from_tinyattn() and seen.append(_n), _r(self, *a, **k))[1])
    for name in FACTORIES:
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _r=real, _n=name, **k:
                            (_from_tinyattn() and seen.append(_n), _r(*a, **k))[1])
    for name in METHOD_FACTORIES:
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _r=real, _n=name, **k:
                            (_from_tinyattn() and seen.append(_n), _r(self, *a, **k))[1])


def graph_mode_pool(g: torch.Generator, *, page_size: int, key_scale: float = 1.0, num_pages: int = 64,
                    codes: bool = False):
    """The pool of the plan's graph-mode tests: ``num_pages`` random pages of 2 KV heads x 16 channels, boxes from the
    reference, and (``codes``) 4-bit key codes: ``(k, v, k_min, k_max, k_code or None)``."""
    from tinyattn import reference

    k = torch.randn(num_pages, page_size, 2, 16, generator=g) * key_scale
    v = torch.randn(num_pages, page_size, 2, 16, generator=g)
    k_min, k_max = torch.empty(num_pages, 2, 16), torch.empty(num_pages, 2, 16)
    every = torch.arange(num_pages, dtype=torch.int32)[None].contiguous()
    reference.update_page_metadata(k, every, torch.tensor([num_pages * page_size]), k_min, k_max)
    code = None
    if codes:
        code = torch.zeros(num_pages, page_size, 2, 8, dtype=torch.uint8)
        reference.encode_key_codes(k, torch.arange(num_pages * page_size), k_min, k_max, code)
    return k, v, k_min, k_max, code


def graph_mode_step(g: torch.Generator, step: int, *, batch: int, page_size: int, num_pages: int = 64):
    """One step's new tables and queries: ``(table, lens, q)``, lengths 9-59, the table's width changing too."""
    lens = torch.randint(9, 60, (batch,), generator=g, dtype=torch.int32)
    width = int(lens.max()) // page_size + 1 + step % 2
    table = torch.randperm(num_pages, generator=g, dtype=torch.int32)[: batch * width].view(batch, width)
    return table, lens, torch.randn(batch, 4, 16, generator=g)


def check_graph_step(step: int, seen: list, got, out, plans, ptrs):
    """The graph-mode contract after a step: nothing watched was called, the output is ``out``, and every buffer
    kept its storage (a captured CUDA graph stays valid). Returns the buffers' addresses for the next step."""
    assert seen == [], f"step {step}: tinyattn called {seen}"
    assert got is out
    now = {n: b.data_ptr() for n, b in plans._impl._buffers.items()}
    assert ptrs is None or now == ptrs                                 # same storage every step
    return now
