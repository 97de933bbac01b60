"""The stories260K model and its tokenizer as module-scoped fixtures (tests/models/, tests/engine/, ...).

Import them into a test module, ``from model_fixtures import model, tok``: each module loads its own copy.
"""

import pytest

from paths import CKPT, TOKENIZER
from tinyattn.models import LlamaModel, Tokenizer


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel.from_llama2c(CKPT)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(TOKENIZER)
