"""Result arrays of the CPU backend's decodes, reused once nothing else holds them.

A decode's float32 result of a few MiB or more is, freshly allocated, memory the kernel maps anew:
every page faults and is zeroed on its first write, at every step. Measured in the job of
``python -m benchmarks overhead`` (64 gradients of 20,000 elements in one fusion buffer, 2 ranks):
the buffer's decode-sum took 2.7 ns an element into a fresh array and 1.3 into a reused one, and the
step 54 ms against 32 (docs/performance.md, "Per-tensor cost").

``ResultPool.take(numel)`` returns an array of numel float32 elements: one it made before whose only
holder is the pool (no tensor, view or caller holds it: CPython's reference count says so), else a
new one, which the pool keeps (at most ``KEEP`` arrays, the least recently taken dropped first).
Arrays under ``MIN_ELEMENTS`` are not pooled: the allocator's heap reuses those already.
"""
import sys
import threading

import numpy as np

from hvd_qsgd import codec

MIN_ELEMENTS = 1 << 16   # 256 KiB of float32
KEEP = 16


class ResultPool:
    """See the module docstring. Thread-safe."""

    def __init__(self, keep: int = KEEP):
        self._keep = keep
        self._lock = threading.Lock()
        self._arrays = []   # least recently taken first

    def take(self, numel: int) -> np.ndarray:
        numel = int(numel)
        if numel < MIN_ELEMENTS:
            return np.empty(numel, dtype=np.float32)
        with self._lock:
            for i in range(len(self._arrays)):
                # held by the list and getrefcount's argument only: free
                if self._arrays[i].size == numel and sys.getrefcount(self._arrays[i]) == 2:
                    a = self._arrays.pop(i)
                    self._arrays.append(a)
                    return a
            a = np.empty(numel, dtype=np.float32)
            self._arrays.append(a)
            if len(self._arrays) > self._keep:
                del self._arrays[0]
            return a

    def take_for(self, payloads):
        """An array for the decoded sum of ``payloads``, of the size their first header says; None
        where that header cannot be read (``codec.decode_sum`` then says which payload fails)."""
        try:
            return self.take(codec.read_header(payloads[0]).numel)
        except Exception:
            return None

    def __len__(self) -> int:
        with self._lock:
            return len(self._arrays)
