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


def _float_in(what: str, ok):
    """A float parser: ``ok(value)`` or the error "expected <what>, got <text>" (NaN fails every range)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value
    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)
positive_float = _float_in("a finite number > 0", lambda v: math.isfinite(v) and v > 0)
non_negative_float = _float_in("a finite number >= 0", lambda v: math.isfinite(v) and v >= 0)


def positive_int_list(text: str) -> list[int]:
    """``"2,4,8"`` -> ``[2, 4, 8]``, each an integer >= 1."""
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or not all(items):          # "", "2,,4", "2,": an empty item is a typo, not a skip
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers >= 1, got {text!r}")
    return [positive_int(t) for t in items]


unit_interval = _float_in("a number in [0, 1]", lambda v: 0.0 <= v <= 1.0)       # --gamma
top_p_fraction = _float_in("a number in (0, 1]", lambda v: 0.0 < v <= 1.0)      # --top-p


GAMMA_HELP = ("page estimate of the quest selection, in [0, 1]: q·c + gamma·|q|·r over each page's key box "
              "(centre c, half-width r); 1 = Quest's upper bound, 0.25 measured best on RULER niah_single_1 (issue 35)")
TOP_P_HELP = ("adaptive budget of the quest selection, in (0, 1]: after the forced pages, keep the fewest best pages "
              "whose estimated attention mass reaches P (Twilight), --page-budget being the most pages kept; "
              "1 keeps the budget")


RERANK_HELP = ("second stage of the quest selection: int4 ranks the estimate's best pages again by their attention "
               "mass estimated from 4-bit key codes (Twilight's INT4 keys; the cache keeps D/2 bytes of codes per key "
               "and head); with --top-p, top-p prunes by that mass (issue 35, docs/design_rerank.md)")
CANDIDATES_HELP = "candidates the estimate hands to --rerank, as a multiple of --page-budget (>= 1)"
at_least_one = _float_in("a number >= 1", lambda v: 1.0 <= v < float("inf"))       # --candidates


def add_selection_options(group, applies_to: str | None = None) -> None:
    """``--gamma``, ``--top-p``, ``--rerank`` and ``--candidates`` (settings of the quest selection) on an argparse
    group; ``applies_to`` says which runs of a comparing command take them (eval: the quest passes)."""
    also = f"; applies to {applies_to}" if applies_to else ""
    group.add_argument("--gamma", type=unit_interval, default=DEFAULT_GAMMA, metavar="G",
                       help=f"{GAMMA_HELP} (default: {DEFAULT_GAMMA:g}{also})")
    group.add_argument("--top-p", type=top_p_fraction, default=None, metavar="P",
                       help=f"{TOP_P_HELP} (default: off, a fixed --page-budget{also})")
    group.add_argument("--rerank", choices=("int4",), default=None,
                       help=f"{RERANK_HELP} (default: off, the estimate alone{also})")
    group.add_argument("--candidates", type=at_least_one, default=1.0, metavar="C",
                       help=f"{CANDIDATES_HELP} (default: 1, the budget itself{also})")
