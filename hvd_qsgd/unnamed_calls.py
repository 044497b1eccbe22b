"""The unnamed Horovod calls in progress, by thread. Horovod's ``hvd.allreduce(t, compression=...)``
raises between compress and decompress at a mismatch between ranks (one rank's tensor of another
dtype, or not compressed): the exchanges of that call keep what they hold (a numbered slot the other
ranks do not hold, a deferred start), and every later call of the compressor would fail or wait.
``UnnamedCalls`` notes, per thread, the frame of Horovod's last unnamed call and what its exchanges
hold until their decompress; a new call on that thread (another frame), or a decompress on it once
that frame has left its stack (``ended``), is handed what the earlier one left, to let go of.
"""
import logging
import sys
import threading
from typing import Any, Dict

log = logging.getLogger("hvd_qsgd")


def warn_left(count: int, owner: Any, outcome: str) -> None:
    """Log that ``count`` exchanges an earlier unnamed call of ``owner`` left were let go of
    (``outcome``: what became of them)."""
    log.warning("hvd_qsgd: %d exchange(s) of an earlier unnamed call of %s on this thread were never decompressed "
                "(its collective raised, as at a mismatch between ranks); %s", count, owner, outcome)


class UnnamedCalls:
    """What each thread's last unnamed Horovod call holds (see the module docstring). Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._calls: Dict[int, tuple] = {}   # thread -> (Horovod's frame of its call, what it holds)

    def begin(self, frame: Any) -> list:
        """Before a tensor of the call running in ``frame`` opens: what this thread's earlier call
        left (another frame's), now forgotten; [] where nothing was left."""
        thread = threading.get_ident()
        with self._lock:
            call = self._calls.get(thread)
            if call is None or call[0] is frame:
                return []
            del self._calls[thread]
            return call[1]

    def __bool__(self) -> bool:
        return bool(self._calls)

    def ended(self) -> list:
        """What this thread's last call holds where that call has ended (its frame is no longer on
        this thread's stack: it raised before a decompress), now forgotten; else []."""
        thread = threading.get_ident()
        with self._lock:
            call = self._calls.get(thread)
        if call is None:
            return []
        frame = sys._getframe(1)
        while frame is not None:
            if frame is call[0]:
                return []
            frame = frame.f_back
        with self._lock:
            if self._calls.get(thread) is call:
                del self._calls[thread]
        return call[1]

    def held(self, frame: Any) -> int:
        """How many items the call running in ``frame`` holds on this thread (0 for another's)."""
        call = self._calls.get(threading.get_ident())
        return len(call[1]) if call is not None and call[0] is frame else 0

    def hold(self, frame: Any, item: Any) -> None:
        """The call running in ``frame`` holds ``item`` until ``end(item)``."""
        with self._lock:
            self._calls.setdefault(threading.get_ident(), (frame, []))[1].append(item)

    def end(self, item: Any) -> None:
        """``item`` is let go of at its decompress (on the thread of its call, which is synchronous);
        the call's frame with the last of them."""
        if self._calls:
            thread = threading.get_ident()
            with self._lock:
                call = self._calls.get(thread)
                if call is not None and item in call[1]:
                    call[1].remove(item)
                    if not call[1]:
                        del self._calls[thread]

    def clear(self) -> None:
        with self._lock:
            self._calls = {}
