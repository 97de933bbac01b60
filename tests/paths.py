"""Paths the tests share: the repository root, and the model, tokenizer and texts the package ships.

Every test runs in a clone with nothing beside it, so the model files come from the package
(:mod:`tinyattn.assets`), never from ``../shared``.
"""

import importlib.util
import sys
from pathlib import Path

from tinyattn import assets

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

CKPT = assets.default_model_path()
TOKENIZER = assets.default_tokenizer_path()
VALID = assets.default_text_path()
SAMPLE = assets.default_finetune_text_path()
KNOWN_GOOD = TESTS / "known_good_stories260K.txt"     # also read by .ci/fresh_clone.sh


def load_bench(name: str):
    """Import ``bench/<name>.py`` (``name`` may name a sub-folder: ``prototypes/int4_rerank``) as module
    ``bench_<file stem>``, with bench/ on ``sys.path`` (the scripts import ``common``) and the module registered in
    ``sys.modules`` (dataclasses look their module up). Each call executes the script afresh."""
    bench = REPO / "bench"
    if str(bench) not in sys.path:
        sys.path.insert(0, str(bench))
    path = bench / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
