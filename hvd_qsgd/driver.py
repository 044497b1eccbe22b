"""The two-phase driver of scatter_allgather exchanges, framework-free.

A scatter_allgather exchange has two collectives: the alltoall of chunk payloads (phase 1,
started by ``compress``) and the allgather of the reduced chunks (phase 2), which can only start
once this rank's alltoall has completed and its chunk is reduced. Many exchanges are in flight at
once (every gradient of a step), finishing in any order, and Horovod gives no callback. So:

* every ``compress`` and ``decompress`` first ``advance``s: the second phase of every exchange whose
  alltoall has completed starts now;
* waiting for a collective is a poll loop (``wait``) that keeps advancing the other exchanges, with
  a sleep that doubles from 20 us to 1 ms;
* ``advance(block_on=ex)`` starts ex's second phase even if its alltoall is still running (the
  control check has proved that every rank started it, so waiting on it cannot hang).

Second phases start as soon as their first phases finish, in whatever order, and no rank waits
on a phase another rank has not started. The collectives (``poll``, ``synchronize``) and the
second phase itself (``second_phase(exchange)``) are the adapter's; an exchange needs a ``handle``
(its alltoall) and a ``started`` event, which the driver sets once its second phase has run.
"""
import threading
import time
from typing import Any, Callable, List


class TwoPhaseDriver:
    """Exchanges whose first phase is in flight (see the module docstring). Thread-safe."""

    def __init__(self, poll: Callable[[Any], bool], synchronize: Callable[[Any], Any],
                 second_phase: Callable[[Any], None]):
        self._poll, self._synchronize, self._second_phase = poll, synchronize, second_phase
        self._lock = threading.Lock()
        self._waiting: List[Any] = []

    def __len__(self) -> int:
        with self._lock:
            return len(self._waiting)

    def add(self, exchange: Any) -> None:
        """An exchange whose alltoall has been started."""
        exchange.started = threading.Event()
        with self._lock:
            self._waiting.append(exchange)

    def forget(self, exchange: Any) -> None:
        """Drop an exchange whose second phase will never run (its control check failed)."""
        with self._lock:
            self._waiting = [e for e in self._waiting if e is not exchange]

    def reset(self) -> None:
        with self._lock:
            self._waiting = []

    def advance(self, block_on: Any = None) -> None:
        """Start the second phase of every exchange whose alltoall has completed (and of
        ``block_on``, waiting for its alltoall)."""
        with self._lock:
            ready = [e for e in self._waiting if e is block_on or self._poll(e.handle)]
            self._waiting = [e for e in self._waiting if e not in ready]
        for e in ready:
            try:
                self._second_phase(e)
            finally:
                e.started.set()

    def wait(self, handle: Any) -> Any:
        """The result of ``handle``, advancing the other exchanges meanwhile."""
        delay = 2e-5
        while True:
            with self._lock:
                others = bool(self._waiting)
            if not others:
                return self._synchronize(handle)
            self.advance()
            if self._poll(handle):
                return self._synchronize(handle)
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)

    def finish(self, exchange: Any) -> None:
        """Block until ``exchange``'s second phase has started (by this thread or another)."""
        self.advance(block_on=exchange)
        exchange.started.wait()
