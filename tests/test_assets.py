"""tinyattn.assets: the model, tokenizer and texts shipped in tinyattn/data/ (sizes and hashes from the data
README), and the file-argument errors that name the option."""

from __future__ import annotations

import hashlib
import re

import pytest

from paths import REPO
from tinyattn import assets

DATA = REPO / "tinyattn" / "data"


def test_shipped_files_match_the_data_readme():
    """Every file the data README lists is there, with its size and sha256, and assets finds it in the package."""
    readme = (DATA / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([^`]+)` \| ([\d,]+) \| ([0-9a-f]{64}) \|", readme, re.M)
    assert {name for name, _, _ in rows} == {"stories260K.bin", "tok512.bin", "tinystories_valid_excerpt.txt",
                                             "tinystories_sample.txt", "book_of_mormon_1nephi.txt"}
    for name, size, sha in rows:
        path = assets.data_path(name)
        assert path == DATA / name
        data = path.read_bytes()
        assert len(data) == int(size.replace(",", "")), name
        assert hashlib.sha256(data).hexdigest() == sha, name
    assert assets.default_model_path().name == "stories260K.bin"
    assert assets.default_tokenizer_path().name == "tok512.bin"
    assert assets.default_text_path().name == "tinystories_valid_excerpt.txt"
    assert assets.default_finetune_text_path().name == "tinystories_sample.txt"
    for licence in ("LICENSE-stories260K", "LICENSE-TinyStories"):
        assert assets.data_path(licence).is_file()
    assert "MIT License" in assets.data_path("LICENSE-stories260K").read_text()
    assert "CDLA-Sharing-1.0" in assets.data_path("LICENSE-TinyStories").read_text()
    assert "Eldan" in assets.data_path("LICENSE-TinyStories").read_text()


def test_resolve_file_names_the_option(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^--model: file not found: no/such\.bin$"):
        assets.resolve_file("no/such.bin", "--model", assets.default_model_path)
    with pytest.raises(IsADirectoryError, match=r"^--data: not a file: "):
        assets.resolve_file(tmp_path, "--data")
    assert assets.resolve_file(None, "--model", assets.default_model_path) == assets.default_model_path()
    with pytest.raises(ValueError, match="--json is required"):
        assets.resolve_file(None, "--json")
