"""The model and text shipped inside the package (``tinyattn/data/``), so that every command runs with no path.

- :func:`default_model_path`: ``stories260K.bin``, Andrej Karpathy's 260K-parameter TinyStories model
  (llama2.c legacy checkpoint, MIT).
- :func:`default_tokenizer_path`: ``tok512.bin``, its tokenizer (MIT).
- :func:`default_text_path`: 7 TinyStories validation stories (CDLA-Sharing-1.0), the ``eval`` default.
- :func:`default_finetune_text_path`: about 254 TinyStories stories (197 KB, CDLA-Sharing-1.0), the
  ``finetune`` default.

Attribution and licences: ``tinyattn/data/README.md``, ``LICENSE-stories260K``, ``LICENSE-TinyStories``.
The files are located with :mod:`importlib.resources`, so they are found wherever the package is installed
(a checkout, an editable install, a wheel), never relative to the working directory.

:func:`resolve_file` is the rule every command (and any new one, e.g. a serving benchmark) applies to a
path option: the given file after an existence check, or the shipped default when the option is omitted.

::

    from tinyattn.assets import default_model_path, default_tokenizer_path
    from tinyattn.models import LlamaModel, Tokenizer
    model = LlamaModel.from_llama2c(default_model_path())
    tok = Tokenizer(default_tokenizer_path())
"""

from __future__ import annotations

import atexit
import contextlib
import os
from importlib import resources
from pathlib import Path

__all__ = ["DATA_FILES", "data_path", "default_model_path", "default_tokenizer_path", "default_text_path",
           "default_finetune_text_path", "resolve_file"]

#: the files of ``tinyattn/data/`` that :func:`data_path` serves
DATA_FILES = ("stories260K.bin", "tok512.bin", "tinystories_valid_excerpt.txt", "tinystories_sample.txt",
              "README.md", "LICENSE-stories260K", "LICENSE-TinyStories", "book_of_mormon_1nephi.txt")

_extracted = contextlib.ExitStack()      # only used when the package is not on a file system (a zip)
atexit.register(_extracted.close)


def data_path(name: str) -> Path:
    """The file system path of ``tinyattn/data/<name>`` (one of :data:`DATA_FILES`)."""
    if name not in DATA_FILES:
        raise ValueError(f"name: expected one of {', '.join(DATA_FILES)}, got {name!r}")
    ref = resources.files("tinyattn") / "data" / name
    if isinstance(ref, Path):
        path = ref
    else:                                   # zipped install: extract once, kept until the process exits
        path = _extracted.enter_context(resources.as_file(ref))
    if not path.is_file():
        raise FileNotFoundError(f"tinyattn's data file {name} is missing from the installed package ({path}); "
                                f"reinstall tinyattn")
    return path


def default_model_path() -> Path:
    """``stories260K.bin``: the default ``--model`` (llama2.c legacy checkpoint, 1 MB)."""
    return data_path("stories260K.bin")


def default_tokenizer_path() -> Path:
    """``tok512.bin``: the default ``--tokenizer`` (the llama2.c tokenizer of stories260K)."""
    return data_path("tok512.bin")


def default_text_path() -> Path:
    """``tinystories_valid_excerpt.txt``: 7 TinyStories validation stories, the default ``eval --data``."""
    return data_path("tinystories_valid_excerpt.txt")


def default_finetune_text_path() -> Path:
    """``tinystories_sample.txt``: about 254 TinyStories stories, the default ``finetune --data``."""
    return data_path("tinystories_sample.txt")


def resolve_file(value: str | os.PathLike | None, option: str, default=None) -> Path:
    """The path a command should open for ``option``.

    ``value`` None: ``default()`` (a function such as :func:`default_model_path`), or a ``ValueError`` saying
    the option is required when there is no default. Otherwise ``value`` itself, after checking that it is an
    existing file: ``FileNotFoundError("--model: file not found: x.bin")`` or ``IsADirectoryError`` naming
    the option, never a bare errno.
    """
    if value is None:
        if default is None:
            raise ValueError(f"{option} is required")
        return default()
    path = Path(value)
    if not path.exists():
        raise FileNotFoundError(f"{option}: file not found: {value}")
    if not path.is_file():
        raise IsADirectoryError(f"{option}: not a file: {value}")
    return path
