"""argparse ``type=`` parsers shared by the command-line tools: each rejects bad text with a message
that names the expected and the actual value (argparse prefixes the option)."""

from __future__ import annotations

import argparse
import math


DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}   # --dtype -> torch attribute name


class CLIError(Exception):
    """A user error: printed as ``tinyattn COMMAND: error: ...`` with exit status 2."""


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value
    return parse


def _finite_float(*, positive: bool):
    bound = "> 0" if positive else ">= 0"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number {bound}, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"expected a finite number {bound}, got {text}")
        return value
    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)
positive_float = _finite_float(positive=True)
non_negative_float = _finite_float(positive=False)


def positive_int_list(text: str) -> list[int]:
    """``"2,4,8"`` -> ``[2, 4, 8]``, each an integer >= 1."""
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or not all(items):          # "", "2,,4", "2,": an empty item is a typo, not a skip
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers >= 1, got {text!r}")
    return [positive_int(t) for t in items]
