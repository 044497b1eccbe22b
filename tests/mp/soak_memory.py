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


def malloc_heap():
    """Bytes glibc's malloc holds from the system (all arenas' heaps and its mmapped chunks), in use
    or free: what it may have made resident."""
    m = _mallinfo2()
    return m.arena + m.hblkhd


def resident_outside_malloc():
    """This process's resident anonymous and shared memory (``RssAnon`` + ``RssShmem``: every
    resident page but mapped files' pages) less malloc's heap: what is resident and not malloc's
    (pymalloc's arenas, other mappings). Malloc's own growth is the malloc rule's to judge: a heap
    that grows while its bytes in use do not is the allocator's fragmentation, not a leak (seen: +11
    MiB in 800 uncompressed allreduces, bytes in use flat). Read without allocating anything that
    outlives the call."""
    kib = 0
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith((b"RssAnon:", b"RssShmem:")):
                kib += int(line.split()[1])
    return kib * 1024 - malloc_heap()


def window_medians(series, windows=5):
    """Medians of ``windows`` consecutive equal parts of the series, and the steps between the centres
    of neighbouring parts."""
    k = max(1, len(series) // windows)
    return [float(statistics.median(series[i * k:(i + 1) * k])) for i in range(windows)], k


def memory_fields(rss, outside):
    """The per-step RSS and resident-outside-malloc series (lists of ints) as a result's fields: the
    window medians (``window_medians``) and the steps between them, the RSS's extremes, and 20-point
    curves of both."""
    rss_windows, distance = window_medians(rss)
    every = max(1, len(rss) // 20)
    return dict(distance=distance, rss_windows=rss_windows, outside_windows=window_medians(outside)[0],
                rss_min=min(rss), rss_max=max(rss), rss_curve=rss[::every], outside_curve=outside[::every])
