"""What a CUDA graph capture forbids, watched on the CPU: host syncs (a tensor's value read on the host) and tensor
allocations made by tinyattn's own code. Shared by the plan's graph-mode tests (tests/ops/test_plan.py) and the
runtime's captured decode body (tests/models/test_graphs.py)."""

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
