"""Memory measurements shared by the soak workers (tests/test_soak.py states the rules)."""
import ctypes
import statistics


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


_mallinfo2 = ctypes.CDLL(None).mallinfo2
_mallinfo2.restype = _Mallinfo2


def malloc_in_use():
    """Bytes that glibc's malloc has handed out and not had back (all arenas, mmapped chunks too)."""
    m = _mallinfo2()
    return m.uordblks + m.hblkhd


def window_medians(series, fraction=0.2):
    """Medians of the first, the middle and the last ``fraction`` of the series, and the steps
    between the centres of neighbouring windows."""
    n, k = len(series), max(1, int(len(series) * fraction))
    mid = (n - k) // 2
    return ([float(statistics.median(w)) for w in (series[:k], series[mid:mid + k], series[n - k:])],
            (n - k) // 2)
