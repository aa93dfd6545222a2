"""A deadline for tests that could hang: a regression fails instead of stalling CI."""

import contextlib
import signal
import threading


class Hang(BaseException):
    """Raised in the main thread when a deadline passes (a BaseException: nothing eats it)."""


@contextlib.contextmanager
def deadline(seconds: float, what: str = "the block"):
    """Raise Hang if the block runs longer than `seconds` (SIGALRM; main thread, POSIX)."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not \
            threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise Hang(f"{what} did not finish in {seconds} s (a hang)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
