"""The one way a test waits: poll a condition the system under test reaches on its own, with a
deadline (readiness polling). Never a fixed sleep as synchronisation: the condition is what the
test waits for, the interval only how often it looks, and on a loaded machine it is the deadline,
not the test, that stretches."""

from __future__ import annotations

import time
from collections.abc import Callable

TIMEOUT_S = 60.0  # generous: a passing test returns at the first true poll, only a failing one waits it out


def wait_until(condition: Callable[[], object], timeout_s: float = TIMEOUT_S, interval_s: float = 0.01) -> bool:
    """True as soon as `condition()` is truthy; False once `timeout_s` has passed without it. Use as
    `assert wait_until(lambda: ...)`, so a failure names the condition."""
    end = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(interval_s)
    return True
