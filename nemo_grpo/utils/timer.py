"""Wall-clock timing of named sections: `with timer.time("generation"): ...`.

Sections may nest (a "step" section around "generation" and "training"); each name is measured on its own,
so a parent's time includes its children's. A name entered several times (generation once per rollout turn)
collects one measurement per entry, reduced by get_timing_metrics.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

REDUCTIONS: dict[str, Callable[[list[float]], float]] = {
    "sum": sum,
    "mean": lambda xs: sum(xs) / len(xs),
    "max": max,
    "min": min,
    "count": lambda xs: float(len(xs)),
}


class Timer:
    """Collects the durations (seconds) of named, possibly nested, sections.

    `clock` returns seconds as a float (time.perf_counter by default; tests pass a fake one).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._durations: dict[str, list[float]] = {}
        self._open: list[str] = []  # names of the sections entered and not yet left, outermost first

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        """Measure the enclosed block under `name`; the time is recorded even if the block raises.

        Entering a name that is already open (a section inside itself) is an error: its time would be
        counted twice.
        """
        if name in self._open:
            raise ValueError(f"timer section '{name}' is already open (open: {' > '.join(self._open)})")
        self._open.append(name)
        start = self._clock()
        try:
            yield
        finally:
            self._durations.setdefault(name, []).append(self._clock() - start)
            self._open.remove(name)

    def record(self, name: str, seconds: float) -> None:
        """Add a measurement taken elsewhere (another thread's timer) under `name`."""
        self._durations.setdefault(name, []).append(seconds)

    def get_timing_metrics(self, reduction: str = "sum") -> dict[str, float]:
        """name -> the reduction (sum | mean | max | min | count) of that name's measurements, in seconds."""
        if reduction not in REDUCTIONS:
            raise ValueError(f"unknown timer reduction '{reduction}'; allowed: {', '.join(REDUCTIONS)}")
        reduce = REDUCTIONS[reduction]
        return {name: float(reduce(xs)) for name, xs in self._durations.items()}

    def reset(self) -> None:
        """Forget every completed measurement (a section still open is recorded when it closes)."""
        self._durations = {}
