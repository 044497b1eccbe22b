"""The driver of exchanges whose collectives run in stages, framework-free.

An exchange may need several collectives one after another, each started only once the one before
has completed on this rank:

* every compressed exchange first allreduces a presence vector (``protocol.presence_vector``): only
  once it is known that no rank of the set has joined (``hvd.join``) may the payloads' allgather or
  alltoall start, which Horovod cannot carry through a join;
* a scatter_allgather exchange then has the alltoall of chunk payloads and the allgather of the
  reduced chunks, which can only start once this rank's chunk is reduced.

Many exchanges are in flight at once (every gradient of a step), finishing in any order, and
Horovod gives no callback. So:

* ``decompress`` (``finish``) ``advance``s: the next stage of every exchange whose current
  collective has completed starts now (the PyTorch adapter does not advance from ``compress``: see
  its comment there);
* waiting for a collective (``wait``), or for an exchange's last stage (``finish``), is a poll loop
  that keeps advancing the other exchanges, with a sleep that doubles from 20 us to ``MAX_SLEEP_S``;
  the library's own wait is entered only for a collective that has completed (Horovod's PyTorch
  ``synchronize`` spins, yielding the GIL in a loop: on a machine of few cores per rank that spin
  took the core the rank's background thread and the other ranks needed).

Stages start as soon as the stage before finishes, in whatever order, and no rank waits on a
collective another rank has not started. The collectives (``poll``, ``synchronize``) and the stage
itself (``next_stage(exchange)``, which returns True when it started another collective that the
exchange now waits on, in ``exchange.handle``) are the adapter's; an exchange needs a ``handle``
and gets a ``started`` event, which the driver sets once its last stage has run.
"""
import threading
import time
from typing import Any, Callable, List

MAX_SLEEP_S = 2.5e-4   # the longest sleep between two polls of a collective waited on


class StagedDriver:
    """Exchanges with a stage in flight (see the module docstring). Thread-safe."""

    def __init__(self, poll: Callable[[Any], bool], synchronize: Callable[[Any], Any],
                 next_stage: Callable[[Any], bool]):
        self._poll, self._synchronize, self._next_stage = poll, synchronize, next_stage
        self._lock = threading.Lock()
        self._waiting: List[Any] = []

    def __len__(self) -> int:
        with self._lock:
            return len(self._waiting)

    def add(self, exchange: Any) -> None:
        """An exchange whose first collective (``exchange.handle``) has been started."""
        exchange.started = threading.Event()
        with self._lock:
            self._waiting.append(exchange)

    def forget(self, exchange: Any) -> None:
        """Drop an exchange whose next stage will never run (its control check failed)."""
        with self._lock:
            self._waiting = [e for e in self._waiting if e is not exchange]

    def reset(self) -> None:
        with self._lock:
            self._waiting = []

    def advance(self) -> None:
        """Run the next stage of every exchange whose collective has completed."""
        with self._lock:
            ready = [e for e in self._waiting if self._poll(e.handle)]
            self._waiting = [e for e in self._waiting if e not in ready]
        for e in ready:
            again = False
            try:
                again = self._next_stage(e)
            finally:
                if again:
                    with self._lock:
                        self._waiting.append(e)
                else:
                    e.started.set()

    def wait(self, handle: Any) -> Any:
        """The result of ``handle``, advancing the other exchanges meanwhile. It is polled, with
        sleeps from 20 to ``MAX_SLEEP_S`` seconds, and synchronized once complete: a library's own
        wait may spin (Horovod's PyTorch ``synchronize`` yields in a loop until the handle is done),
        taking a core from the rank's background thread and from the other ranks on a small
        machine."""
        delay = 2e-5
        while True:
            with self._lock:
                others = bool(self._waiting)
            if others:
                self.advance()
            if self._poll(handle):
                return self._synchronize(handle)
            time.sleep(delay)
            delay = min(2 * delay, MAX_SLEEP_S)

    def finish(self, exchange: Any) -> None:
        """Block until ``exchange``'s last stage has run (by this thread or another): the stages of
        the exchanges whose collectives have completed are run, with sleeps from 20 to
        ``MAX_SLEEP_S`` seconds between polls (as ``wait``: not the library's wait, which may spin)."""
        delay = 2e-5
        while not exchange.started.is_set():
            self.advance()
            if exchange.started.wait(delay):  # (set by this thread's advance, or another thread's)
                return
            delay = min(2 * delay, MAX_SLEEP_S)
