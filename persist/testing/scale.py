"""How long the harness runs: ``PERSIST_TEST_SCALE`` multiplies every count it uses.

The default (1) is a modest run that fits CI; ``PERSIST_TEST_SCALE=20`` is a soak run. Counts
only ever scale the number of examples, rounds, processes' attempts and kills: never a timeout.
"""

from __future__ import annotations

import math
import os

__all__ = ["ENV_SCALE", "scale", "scaled"]

ENV_SCALE = "PERSIST_TEST_SCALE"


def scale() -> float:
    """The factor in ``PERSIST_TEST_SCALE`` (a positive float; 1 when unset)."""
    raw = os.environ.get(ENV_SCALE, "").strip()
    if not raw:
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_SCALE} must be a positive number, not {raw!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{ENV_SCALE} must be a positive number, not {raw!r}")
    return value


def scaled(count: int, *, minimum: int = 1) -> int:
    """``count`` times the scale, rounded, and at least ``minimum``."""
    return max(minimum, round(count * scale()))
