"""Ctrl-C and a scheduler's SIGTERM, handled so that no record is left half-written.

Both become :class:`KeyboardInterrupt` (:func:`sigterm_as_interrupt`), which every run path turns
into a KILLED MLflow run. While a run is being closed (:func:`deferred_interrupts`) a signal waits:
torchrun sends SIGTERM to the surviving ranks right after one dies, and that signal must not land
between "the run folder says FAILED" and "the store says FAILED".
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def signal_name(err: KeyboardInterrupt) -> str:
    """What interrupted: ``SIGTERM`` for a scheduler's stop, ``Ctrl-C (SIGINT)`` otherwise."""
    return str(err.args[0]) if err.args else "Ctrl-C (SIGINT)"


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt("SIGTERM" if signum == signal.SIGTERM else "Ctrl-C (SIGINT)")


def sigterm_as_interrupt() -> None:
    """A scheduler's SIGTERM ends a run like Ctrl-C does: KILLED in MLflow, nothing lost."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupt)


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block is done, then raise KeyboardInterrupt for the first.

    For closing records (the run folder, the MLflow run): they finish together or not at all. Only
    the main thread receives signals; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    for sig in _SIGNALS:
        signal.signal(sig, lambda signum, _frame: received.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if received:
            name = "SIGTERM" if received[0] == signal.SIGTERM else "Ctrl-C (SIGINT)"
            raise KeyboardInterrupt(name)
