"""A warm call of the public ops runs few tinyattn Python functions (per-call overhead counts as much as kernel time:
an op runs once per layer per token). Counted with ``sys.setprofile`` on the README's snippet, CPU: validated once,
the plan of the last call reused, one call into its implementation. Deterministic (no timing)."""

import os
import sys

import pytest
import torch

import tinyattn

ROOT = os.path.dirname(tinyattn.__file__)


def _functions(fn):
    """Distinct tinyattn functions (file, name) one call of ``fn`` runs."""
    seen = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(ROOT):
            seen.add((os.path.relpath(frame.f_code.co_filename, ROOT), frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("op", ["sparse", "dense"])
def test_a_warm_call_of_the_readme_snippet_runs_at_most_16_functions_in_5_files(op):
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(256, 16, 8, 128), torch.randn(256, 16, 8, 128)
    block_table = torch.randperm(256, dtype=torch.int32)[None]
    seq_lens = torch.tensor([4096], dtype=torch.int32)
    k_min, k_max = torch.empty(256, 8, 128), torch.empty(256, 8, 128)
    tinyattn.update_page_metadata(k_cache, block_table, seq_lens, k_min, k_max, backend="torch")
    q = torch.randn(1, 32, 128)
    if op == "sparse":
        def call():
            return tinyattn.sparse_paged_attention(q, k_cache, v_cache, block_table, seq_lens, k_min=k_min,
                                                   k_max=k_max, page_budget=64, backend="torch")
    else:
        def call():
            return tinyattn.paged_attention(q, k_cache, v_cache, block_table, seq_lens, backend="torch")
    first = call()
    functions = _functions(call)
    files = {f for f, _ in functions}
    assert len(functions) <= 16 and len(files) <= 5, sorted(functions)
    torch.testing.assert_close(call(), first)                   # the reused plan computes the same
    block_table[0, :2] = block_table[0, :2].flip(0)             # new tables: planned (and checked) again
    assert len(_functions(call)) > len(functions)
