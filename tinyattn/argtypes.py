"""argparse ``type=`` parsers shared by the command-line tools: each rejects bad text with a message
that names the expected and the actual value (argparse prefixes the option)."""

from __future__ import annotations

import argparse
import math

from .layer import DEFAULT_GAMMA


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


def _fraction(*, open_low: bool):
    bound = "in (0, 1]" if open_low else "in [0, 1]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number {bound}, got {text!r}") from None
        if not (0.0 < value <= 1.0 if open_low else 0.0 <= value <= 1.0):      # NaN fails both
            raise argparse.ArgumentTypeError(f"expected a number {bound}, got {text}")
        return value
    return parse


unit_interval = _fraction(open_low=False)      # --gamma: [0, 1]
top_p_fraction = _fraction(open_low=True)      # --top-p: (0, 1]

GAMMA_HELP = ("page estimate of the quest selection, in [0, 1]: q·c + gamma·|q|·r over each page's key box "
              "(centre c, half-width r); 1 = Quest's upper bound, 0.25 measured best on RULER niah_single_1 (issue 35) "
              f"(default: {DEFAULT_GAMMA:g})")
TOP_P_HELP = ("adaptive budget of the quest selection, in (0, 1]: after the forced pages, keep the fewest best pages "
              "whose estimated attention mass reaches P (Twilight), --page-budget being the most pages kept; "
              "1 keeps the budget (default: off, a fixed --page-budget)")


def add_selection_options(group, applies_to: str | None = None) -> None:
    """``--gamma`` and ``--top-p`` (settings of the quest selection) on an argparse group; ``applies_to`` says
    which runs of a comparing command take them (eval: the quest passes)."""
    also = f"; applies to {applies_to}" if applies_to else ""
    group.add_argument("--gamma", type=unit_interval, default=DEFAULT_GAMMA, metavar="G",
                       help=GAMMA_HELP[:-1] + also + ")")
    group.add_argument("--top-p", type=top_p_fraction, default=None, metavar="P", help=TOP_P_HELP[:-1] + also + ")")
