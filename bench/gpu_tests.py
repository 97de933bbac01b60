"""Run ``tests/gpu/test_gpu_kernels.py`` without pytest (for a GPU image that lacks it); used by ``bench/gpu.sh``.

A stand-in ``pytest`` module provides what the test file uses (``mark.parametrize``, ``mark.skipif``,
``skip``); every parametrised case runs in turn and a ``N passed, N failed, N skipped`` line closes the
run. With pytest installed, ``gpu.sh`` runs ``python -m pytest tests/gpu`` instead.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class _Skip(Exception):
    pass


def _stub_pytest() -> types.ModuleType:
    mod = types.ModuleType("pytest")

    class _Mark:
        def parametrize(self, names, values):
            names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)

            def deco(fn):
                fn.__dict__.setdefault("_params", []).insert(0, (names, list(values)))
                return fn
            return deco

        def skipif(self, condition, reason=""):
            return _SkipIf(condition, reason)

        def __getattr__(self, name):           # other marks: no-ops
            return lambda *a, **k: (lambda fn: fn)

    class _SkipIf:
        """Like pytest's mark: ``.args`` / ``.kwargs``, and a decorator that skips a test function."""

        def __init__(self, condition, reason):
            self.args, self.kwargs = (condition,), {"reason": reason}

        def __call__(self, fn):
            if self.args[0]:
                fn._skip = self.kwargs["reason"]
            return fn

    def skip(reason=""):
        raise _Skip(reason)

    mod.mark = _Mark()
    mod.skip = skip
    return mod


def main() -> int:
    try:
        importlib.import_module("pytest")
    except ImportError:
        sys.modules["pytest"] = _stub_pytest()
    sys.path.insert(0, str(ROOT))
    path = ROOT / "tests" / "gpu" / "test_gpu_kernels.py"
    spec = importlib.util.spec_from_file_location("test_gpu_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module_skip = None
    for mark in getattr(module, "pytestmark", []):
        args = getattr(mark, "args", ())
        if args and args[0]:
            module_skip = getattr(mark, "kwargs", {}).get("reason", "skipped")
    passed = failed = skipped = 0
    for name in sorted(n for n in dir(module) if n.startswith("test_")):
        fn = getattr(module, name)
        params = getattr(fn, "_params", [])
        combos = [{}]
        for names, values in params:
            combos = [dict(c, **dict(zip(names, v if len(names) > 1 else (v,)))) for c in combos for v in values]
        for kwargs in combos:
            label = f"{name}[{'-'.join(map(str, kwargs.values()))}]" if kwargs else name
            t0 = time.perf_counter()
            if module_skip:
                print(f"SKIP {label}: {module_skip}")
                skipped += 1
                continue
            if getattr(fn, "_skip", None):
                print(f"SKIP {label}: {fn._skip}")
                skipped += 1
                continue
            try:
                fn(**kwargs)
                print(f"PASS {label} ({time.perf_counter() - t0:.1f}s)")
                passed += 1
            except _Skip as exc:
                print(f"SKIP {label}: {exc}")
                skipped += 1
            except Exception:
                print(f"FAIL {label}")
                traceback.print_exc()
                failed += 1
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
