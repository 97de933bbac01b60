"""A minimal stand-in for ``einops.rearrange``, used by ``bench/gpu.sh`` only when einops is not installed.

Supports what tinyattn uses: axis names, parenthesised groups on either side (split on the left with
sizes given as keyword arguments, merge on the right), no ellipsis, no reductions, no repeats.
"""

from __future__ import annotations

import math

__all__ = ["rearrange"]


def _parse(side: str) -> list[list[str]]:
    groups, current, depth = [], None, False
    for tok in side.replace("(", " ( ").replace(")", " ) ").split():
        if tok == "(":
            depth, current = True, []
        elif tok == ")":
            groups.append(current)
            depth, current = False, None
        elif depth:
            current.append(tok)
        else:
            groups.append([tok])
    return groups


def rearrange(x, pattern: str, **sizes):
    left, right = (s.strip() for s in pattern.split("->"))
    lgroups, rgroups = _parse(left), _parse(right)
    if len(lgroups) != x.dim():
        raise ValueError(f"rearrange: pattern {left!r} has {len(lgroups)} axes, tensor has {x.dim()}")
    dims = dict(sizes)
    for group, n in zip(lgroups, x.shape):
        unknown = [a for a in group if a not in dims]
        known = math.prod(dims[a] for a in group if a in dims)
        if len(unknown) == 1:
            dims[unknown[0]] = n // known
        elif unknown:
            raise ValueError(f"rearrange: cannot infer the sizes of {unknown}")
    flat_left = [a for g in lgroups for a in g]
    x = x.reshape([dims[a] for a in flat_left])
    flat_right = [a for g in rgroups for a in g]
    x = x.permute([flat_left.index(a) for a in flat_right])
    return x.reshape([math.prod(dims[a] for a in g) for g in rgroups])
