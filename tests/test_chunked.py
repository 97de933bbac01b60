"""Large steps attend in cache-sized chunks of keys (tinyattn.ops.chunked): the same output and lse as the
reference, with the thresholds shrunk so that small hypothesis problems take the chunked path."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import tinyattn
from tinyattn import reference as R
from tinyattn.ops.attention import torch_impl as chunked
from tinyattn.ops.plan import PagedAttentionPlan

from paged_problems import make_problem


def _tiny_chunks(mp):
    """Every gather is 'large' and a chunk holds 16 keys (one to a few pages)."""
    mp.setattr(chunked, "MIN_BYTES", 0)
    mp.setattr(chunked, "CHUNK_BYTES", 1)
    mp.setattr(chunked, "MAX_THREADS", 1 << 20)       # whatever torch's thread count


@pytest.fixture
def tiny_chunks(monkeypatch):
    _tiny_chunks(monkeypatch)


def _chunk_calls(monkeypatch):
    calls = []
    real = chunked.attend_chunked

    def counting(*args, **kwargs):
        calls.append(args[-1])
        return real(*args, **kwargs)

    monkeypatch.setattr(chunked, "attend_chunked", counting)
    return calls


@settings(deadline=None, max_examples=30)
@given(seed=st.integers(0, 2**31 - 1), lens=st.lists(st.integers(0, 70), min_size=1, max_size=3),
       page_size=st.sampled_from([4, 16]), group=st.sampled_from([1, 3]), Tq=st.sampled_from([1, 2]),
       budget=st.sampled_from([None, 2, 3]), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_chunked_steps_match_the_reference(seed, lens, page_size, group, Tq, budget, dtype):
    """Dense and Quest-sparse steps, rows of unequal and zero length, NaN in every unowned slot, Tq = 1 or 2,
    fp32 / fp64: out and lse equal the reference's, and the chunked path really ran."""
    if Tq > 1:
        lens = [max(n, Tq) for n in lens]
        budget = None if budget is None else max(budget, 2 + -(-Tq // page_size))
    p = make_problem(seed, batch=len(lens), seq_lens=lens, page_size=page_size, num_kv_heads=2, group=group,
                     head_dim=8, num_query_tokens=Tq, dtype=dtype)
    with pytest.MonkeyPatch.context() as mp:
        _tiny_chunks(mp)
        calls = _chunk_calls(mp)
        _check_against_reference(p, Tq, budget, dtype)
    assert calls or max(lens) == 0, "the chunked path did not run"


def _check_against_reference(p, Tq, budget, dtype):
    q = p.q[:, 0] if Tq == 1 else p.q
    if budget is None:
        out, lse = tinyattn.paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, return_lse=True,
                                            backend="torch")
        want, want_lse = R.paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, return_lse=True)
    else:
        k_min = torch.zeros(p.k_cache.shape[0], 2, 8, dtype=dtype)
        k_max = torch.zeros_like(k_min)
        R.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, k_min, k_max)
        kw = dict(k_min=k_min, k_max=k_max, page_budget=budget)
        out, lse = tinyattn.sparse_paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens,
                                                   return_lse=True, backend="torch", **kw)
        want, want_lse = R.sparse_paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens,
                                                  return_lse=True, **kw)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(out, want, **tol)
    torch.testing.assert_close(lse, want_lse, **tol)


def test_fast_path_chunks_too(tiny_chunks, monkeypatch):
    """The decode fast path (no lse) of a plan, dense and sparse, also runs in chunks and matches the reference."""
    p = make_problem(3, batch=2, seq_lens=[150, 97], page_size=16, num_kv_heads=2, group=4, head_dim=16)
    k_min = torch.zeros(p.k_cache.shape[0], 2, 16)
    k_max = torch.zeros_like(k_min)
    R.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, k_min, k_max)
    plan = PagedAttentionPlan(backend="torch").plan(p.block_table, p.seq_lens, num_q_heads=8, num_kv_heads=2,
                                                    head_dim=16, page_size=16, page_budget=4)
    calls = _chunk_calls(monkeypatch)
    q = p.q[:, 0]
    torch.testing.assert_close(plan.run(q, p.k_cache, p.v_cache),
                               R.paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens),
                               atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(plan.run(q, p.k_cache, p.v_cache, k_min=k_min, k_max=k_max),
                               R.sparse_paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens,
                                                        k_min=k_min, k_max=k_max, page_budget=4),
                               atol=1e-5, rtol=1e-4)
    assert calls == [16, 16]


def test_chunk_size_from_bytes():
    """Below MIN_BYTES of keys: one piece; above: chunks of about CHUNK_BYTES, whole pages of 16."""
    assert chunked.chunk_keys(1024, 4, 64) is None                       # 1 MiB of K
    c = chunked.chunk_keys(4096, 64, 128)                                # 128 MiB of K
    assert c % 16 == 0 and c * 64 * 128 * 4 <= chunked.CHUNK_BYTES
    assert chunked.chunk_keys(10**6, 10**4, 128) == 16                   # never below one page of 16


def test_no_chunks_above_max_threads(monkeypatch):
    """A large gather is chunked with torch on MAX_THREADS threads or fewer, and runs in one piece above."""
    threads = torch.get_num_threads()
    monkeypatch.setattr(chunked, "MAX_THREADS", threads)
    assert chunked.chunk_keys(4096, 64, 128) is not None                 # 128 MiB of K
    monkeypatch.setattr(chunked, "MAX_THREADS", threads - 1)
    assert chunked.chunk_keys(4096, 64, 128) is None


def test_one_piece_above_max_threads_matches_the_reference(monkeypatch):
    """The same large dense and sparse steps without chunks (more threads than MAX_THREADS) equal the reference."""
    monkeypatch.setattr(chunked, "MIN_BYTES", 0)
    monkeypatch.setattr(chunked, "MAX_THREADS", 0)
    calls = _chunk_calls(monkeypatch)
    p = make_problem(7, batch=2, seq_lens=[150, 0], page_size=16, num_kv_heads=2, group=4, head_dim=8)
    _check_against_reference(p, 1, None, torch.float32)
    _check_against_reference(p, 1, 3, torch.float32)
    assert calls == []


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_chunks_of_a_quantized_pool(tiny_chunks, monkeypatch, fmt):
    """An int8 / fp8 pool in chunks: each chunk dequantizes what it gathers; equal to the reference on the
    dequantized pool (garbage codes and NaN scales where no row owns a slot)."""
    from test_kv_formats import dequantized_args, quantize_problem

    p = make_problem(5, batch=2, seq_lens=[61, 0], page_size=8, num_kv_heads=2, group=2, head_dim=8)
    kq, vq, ks, vs = quantize_problem(p, fmt)
    calls = _chunk_calls(monkeypatch)
    q, k, v, table, sl = dequantized_args(p, kq, vq, ks, vs)
    out, lse = tinyattn.paged_attention(q[:, 0], kq, vq, table, sl, k_scale=ks, v_scale=vs, return_lse=True,
                                        backend="torch")
    want, want_lse = R.paged_attention(q[:, 0], k, v, table, sl, return_lse=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-4)
    assert calls
