"""A signal that asks a run to stop at the next step boundary, as a flag the loop reads.

Slurm sends one before a job's time limit when asked (`#SBATCH --signal=B:USR1@120`, the launcher forwards it
to the driver): the trainer finishes the step under way, checkpoints it and returns, so the process exits 0
and a rerun of the same command resumes there. The handler only records the signal; all the work happens in
the loop that reads `received`.
"""

from __future__ import annotations

import signal
import threading
from typing import Optional

# the signals that stop a run at a step boundary -> what they mean, for the log line (SIGTERM could join)
STOP_SIGNALS = {signal.SIGUSR1: "a time limit"}


class StopSignal:
    """`with StopSignal() as stop:` -- while inside, STOP_SIGNALS set `stop.received` (the signal number)
    instead of their usual effect; on exit the previous handlers are back. Python runs handlers in the main
    thread only, so entered in any other thread it installs nothing (and `received` stays None). Entered inside
    another StopSignal, it starts with what that one received (the entry point listens from the start: a signal
    during the run's start-up stops it at its first step boundary)."""

    def __init__(self, signals: Optional[dict] = None):
        self.signals = STOP_SIGNALS if signals is None else signals
        self.received: Optional[int] = None
        self._previous: dict = {}

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
                outer = getattr(self._previous[signum], "__self__", None)
                if isinstance(outer, StopSignal) and outer.received is not None and self.received is None:
                    self.received = outer.received  # came while an enclosing one listened (the run's start-up)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            # None: a handler installed outside Python, which signal.signal cannot put back; the default instead
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        self.received = signum  # a flag only: the loop does the work, at a step boundary

    @property
    def name(self) -> str:
        """The received signal's name ("SIGUSR1"); "" when none was received."""
        return signal.Signals(self.received).name if self.received is not None else ""

    @property
    def meaning(self) -> str:
        """What the received signal means ("a time limit"); "" when none was received."""
        return self.signals.get(self.received, "") if self.received is not None else ""
