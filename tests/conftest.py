"""Test-wide setup: the Triton interpreter on the CPU, one BLAS thread, NaN-filled allocations.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at collection.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
MODEL_DIR = SHARED / "models" / "stories260K"     # its README (the known-good text's source) only

# the model, tokenizer and texts the package ships: every test runs in a clone with nothing beside it
from tinyattn import assets as _assets  # noqa: E402

CKPT = _assets.default_model_path()
TOKENIZER = _assets.default_tokenizer_path()
VALID = _assets.default_text_path()
SAMPLE = _assets.default_finetune_text_path()
KNOWN_GOOD = Path(__file__).resolve().parent / "known_good_stories260K.txt"

@pytest.fixture(autouse=True)
def nan_poisoned_allocations(monkeypatch):
    """Fill every float tensor the library allocates with torch.empty* with NaN (flash-linear-attention's trick).

    A tile a kernel forgets to write then shows up as NaN in the output instead of passing by luck.
    """
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))
