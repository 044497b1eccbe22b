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
* waiting for a collective is a poll loop (``wait``) that keeps advancing the other exchanges, with
  a sleep that doubles from 20 us to 1 ms;
* ``advance(block_on=ex)`` runs ex's next stage even if its collective is still running (the
  caller has proved that every rank started it, so waiting on it cannot hang).

A collective nothing else is waiting beside is waited for by the library's own wait, which may spin
(Horovod's PyTorch ``synchronize`` polls and yields the GIL in a loop): a poll loop with sleeps
instead saved CPU on a 2-core machine shared by two ranks, but made a 64-gradient step 28% slower
on a quiet 16-core host, where the spin takes a core nobody needed and the sleeps add latency to
every stage (docs/performance.md, "Waiting on a collective").

Stages start as soon as the stage before finishes, in whatever order, and no rank waits on a
collective another rank has not started. The collectives (``poll``, ``synchronize``) and the stage
itself (``next_stage(exchange)``, which returns True when it started another collective that the
exchange now waits on, in ``exchange.handle``) are the adapter's; an exchange needs a ``handle``
and gets a ``started`` event, which the driver sets once its last stage has run.
"""
import threading
import time
from typing import Any, Callable, List


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

    def advance(self, block_on: Any = None) -> None:
        """Run the next stage of every exchange whose collective has completed (and of ``block_on``,
        waiting for its collective)."""
        with self._lock:
            ready = [e for e in self._waiting if e is block_on or self._poll(e.handle)]
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
        """Block until ``exchange``'s last stage has run (by this thread or another)."""
        while not exchange.started.is_set():
            self.advance(block_on=exchange)
            exchange.started.wait(1e-3)  # another thread may be running one of its stages
