"""One call of a user's code (a reward function) in the main thread, bounded: cut short once it has run ``timeout``
seconds, or as soon as ``stop()`` turns true (a preemption signal arrived), by an exception raised into it.

Why the main thread and a signal, not a worker thread that the caller abandons on timeout: the reward runs where it
always ran, so what works there keeps working. math_verify's ``parse``/``verify`` (TRL's accuracy reward) time
themselves with ``signal.alarm``, which only the main thread may set: in a worker thread they fail, and ``parse``
then answers ``[]`` for every completion, every reward 0, silently. A cut call also unwinds (its ``finally`` blocks
run, its files close) instead of running on beside the checkpoint save and the interpreter's exit, and a subprocess
pool would have to pickle the user's functions and their data.

How: a watchdog thread waits for the deadline or ``stop()`` (polling every ``POLL_S``), then sends ``SIGNAL`` to
the main thread (``pthread_kill``); its handler, installed for the call only, raises ``_Cut`` (a BaseException, so
a reward's ``except Exception`` does not swallow it) wherever the call is: a sleep, a socket or lock wait, an event
loop, a pure-Python busy loop (handlers run between bytecodes; the watchdog gets the GIL at the switch interval).
The watchdog repeats the signal every ``RESEND_S`` until the call is over, and the outcome is decided by why it
fired, not by whether the exception got through: a reward that catches it and returns still ends as cut.

The limit: C code that holds the GIL (a regular expression backtracking without end) runs until it returns; nothing
inside the process can stop it (the scheduler's SIGKILL after its grace period does; the newest checkpoint stays).
Off the main thread, where no signal handler can be set (or without ``pthread_kill``: Windows), the call runs
unbounded.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

POLL_S = 0.05
RESEND_S = 1.0  # time for an event loop to cancel its tasks before the next cut
# a real-time signal no library sets (math_verify uses SIGALRM); SIGVTALRM where there are none (macOS)
SIGNAL = signal.SIGRTMAX - 1 if hasattr(signal, "SIGRTMAX") else signal.SIGVTALRM


class TimedOut(Exception):
    """The call ran past its ``timeout`` and was cut short."""


class Interrupted(Exception):
    """``stop()`` turned true (a preemption signal) before the call was over; it was cut short."""


class _Cut(BaseException):
    """Raised into the call by the watchdog's signal."""


class _Watchdog:
    def __init__(self, timeout: float | None, stop: Callable[[], bool] | None) -> None:
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.stop, self.reason, self.armed = stop, None, True
        self._over = threading.Event()
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._watch, name="waypoint-reward-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _watch(self) -> None:
        sent = None
        while not self._over.wait(POLL_S if self.deadline is None or self.reason is not None else
                                  max(0.0, min(POLL_S, self.deadline - time.monotonic()))):
            if self.reason is None:
                if self.stop is not None and self.stop():
                    self.reason = Interrupted
                elif self.deadline is not None and time.monotonic() >= self.deadline:
                    self.reason = TimedOut
            if self.reason is not None and (sent is None or time.monotonic() - sent >= RESEND_S):
                sent = time.monotonic()
                signal.pthread_kill(self._main, SIGNAL)

    def handle(self, signum, frame) -> None:
        if self.armed:
            raise _Cut

    def disarm(self) -> None:
        """No exception raised into the main thread from here on, and no signal sent once this returns."""
        self.armed = False
        self._over.set()
        self._thread.join()


def bounded_call(call: Callable[[], Any], timeout: float | None, stop: Callable[[], bool] | None = None) -> Any:
    """``call()``'s result or exception; ``TimedOut`` once it has run ``timeout`` seconds, ``Interrupted`` once
    ``stop()`` is true (polled from another thread while the call runs). None: no such bound."""
    if (timeout is None and stop is None) or threading.current_thread() is not threading.main_thread() \
            or not hasattr(signal, "pthread_kill"):
        return call()
    watchdog = _Watchdog(timeout, stop)
    previous = signal.signal(SIGNAL, watchdog.handle)
    result = error = None
    try:
        try:
            try:
                watchdog.start()
                result = call()
            except BaseException as e:  # noqa: BLE001 (the cut, or the call's own error: decided below)
                error = e
        except _Cut:  # one landing in the handler above: the reason is set, which decides
            pass
        while True:  # one may land on the way out, until the watchdog is disarmed
            try:
                watchdog.disarm()
                break
            except _Cut:
                continue
    finally:
        # a signal sent before disarm() returned has reached the main thread by now; setting the handler runs
        # pending handlers first, and this one, disarmed, does nothing
        signal.signal(SIGNAL, previous if previous is not None else signal.SIG_DFL)
    if watchdog.reason is not None:
        raise watchdog.reason() from None
    if error is not None:
        raise error
    return result
