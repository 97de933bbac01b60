"""The stories260K model and its tokenizer as module-scoped fixtures (tests/models/, tests/engine/, ...), and the
same model cut to a 32-token training context.

Import them into a test module, ``from model_fixtures import model, tok``: each module loads its own copy.
"""

import struct
from pathlib import Path

import pytest

from paths import CKPT, TOKENIZER
from tinyattn.models import LlamaModel, Tokenizer


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel.from_llama2c(CKPT)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def short_context_model(tmp_path_factory) -> Path:
    """stories260K with a 32-token training context (its header's seq_len and RoPE tables cut to 32): a llama2.c
    file, for the warnings past the training context."""
    from tinyattn.models.llama2c import _prod, _tensor_shapes, read_llama2c_header

    cfg = read_llama2c_header(CKPT)
    raw = CKPT.read_bytes()
    floats = {name: _prod(shape) for name, shape in _tensor_shapes(cfg)}
    head_dim_half = cfg.head_dim // 2
    weights_end = 28 + 4 * (sum(floats.values()) - floats["freq_cis_real"] - floats["freq_cis_imag"])
    real = raw[weights_end: weights_end + 4 * floats["freq_cis_real"]]
    imag = raw[weights_end + 4 * floats["freq_cis_real"]: weights_end + 8 * floats["freq_cis_real"]]
    keep = 4 * 32 * head_dim_half
    header = struct.pack("<7i", cfg.dim, cfg.hidden_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size, 32)
    path = tmp_path_factory.mktemp("short") / "short_context.bin"
    path.write_bytes(header + raw[28:weights_end] + real[:keep] + imag[:keep])
    assert read_llama2c_header(path).max_seq_len == 32
    return path
