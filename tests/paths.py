"""Paths the tests share: the repository root, and the model, tokenizer and texts the package ships.

Every test runs in a clone with nothing beside it, so the model files come from the package
(:mod:`tinyattn.assets`), never from ``../shared``.
"""

from pathlib import Path

from tinyattn import assets

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

CKPT = assets.default_model_path()
TOKENIZER = assets.default_tokenizer_path()
VALID = assets.default_text_path()
SAMPLE = assets.default_finetune_text_path()
KNOWN_GOOD = TESTS / "known_good_stories260K.txt"     # also read by .ci/fresh_clone.sh
