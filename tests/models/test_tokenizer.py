"""llama2.c tokenizer: the heap merge equals run.c's naive loop, round trips, byte fallback, file errors."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinyattn.models.tokenizer import Tokenizer

from paths import SAMPLE, TOKENIZER  # noqa: E402  (shipped with the package)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def sample_text() -> str:
    if not SAMPLE.exists():
        pytest.skip(f"{SAMPLE} is missing")
    return SAMPLE.read_text(encoding="utf-8")


def test_vocab_layout(tok):
    assert tok.vocab_size == 512 and len(tok) == 512
    assert tok.pieces[tok.bos_id] == b"\n<s>\n" and tok.pieces[tok.eos_id] == b"\n</s>\n"
    assert tok.pieces[3] == b"<0x00>" and tok.pieces[258] == b"<0xFF>"


def test_encode_basics(tok):
    assert tok.encode("") == [1]
    assert tok.encode("", bos=False) == []
    assert tok.encode("", bos=True, eos=True) == [1, 2]
    ids = tok.encode("Once upon a time")
    assert ids[0] == 1
    assert tok.encode("Once upon a time", bos=False, eos=True) == ids[1:] + [2]
    # the dummy prefix: the first piece starts with a space
    assert tok.pieces[ids[1]].startswith(b" ")


def test_byte_fallback(tok):
    # '\n' is not in this vocabulary: it becomes the byte token 0x0A + 3
    ids = tok.encode("a\nb", bos=False)
    assert 0x0A + 3 in ids
    # a character missing from the vocabulary: one token per UTF-8 byte
    ids = tok.encode("日", bos=False)
    assert ids[1:] == [b + 3 for b in "日".encode()]
    assert tok.decode([1] + ids) == "日"


def test_decode_strips_space_after_bos_only(tok):
    ids = tok.encode("Hello world", bos=False)
    assert tok.decode([1] + ids) == "Hello world"
    assert tok.decode(ids) == " Hello world"  # no BOS: the dummy prefix stays
    assert tok.decode([1] + ids + [2]) == "Hello world"  # specials are dropped
    assert tok.decode([1] + ids + [2], skip_special=False).endswith("\n</s>\n")


def test_heap_equals_naive_on_whole_paragraphs(tok, sample_text):
    paragraphs = [p for p in sample_text.split("\n\n") if p.strip()][:20]
    for p in paragraphs:
        assert tok.encode(p) == tok.encode_naive(p)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_heap_equals_naive_on_random_substrings(tok, sample_text, data):
    start = data.draw(st.integers(0, len(sample_text) - 1), label="start")
    length = data.draw(st.integers(0, 400), label="length")
    text = sample_text[start : start + length]
    fast = tok.encode(text)
    assert fast == tok.encode_naive(text)
    assert tok.decode(fast) == text


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60))
def test_heap_equals_naive_on_arbitrary_unicode(tok, text):
    fast = tok.encode(text, bos=True, eos=True)
    assert fast == tok.encode_naive(text, bos=True, eos=True)
    assert tok.decode(fast) == text


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.sampled_from(list(" aaab.\"'\n")), max_size=80))
def test_heap_equals_naive_on_tie_heavy_text(tok, text):
    # few distinct characters: many equal-score candidate pairs, so the leftmost tie-break matters
    assert tok.encode(text) == tok.encode_naive(text)


def test_whole_sample_round_trip(tok, sample_text):
    ids = tok.encode(sample_text)
    assert tok.decode(ids) == sample_text
    assert len(ids) < len(sample_text.encode()) // 1.5  # the merges really compress


def test_bad_files(tmp_path):
    short = tmp_path / "short.bin"
    short.write_bytes(b"\x01")
    with pytest.raises(ValueError, match="too short"):
        Tokenizer(short)
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(struct.pack("<i", 7) + struct.pack("<fi", 0.0, 100) + b"abc")
    with pytest.raises(ValueError, match="truncated"):
        Tokenizer(truncated)
    with pytest.raises(ValueError, match="vocab_size"):
        Tokenizer(TOKENIZER, vocab_size=600)
