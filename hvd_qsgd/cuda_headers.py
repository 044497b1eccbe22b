"""The payload headers the CUDA wrappers (``hvd_qsgd.cuda``) hand to the kernels, made on the host:
parsed from host copies of the payloads' first bytes (``parse``, ``ParsedHeaders``), or made from
what an exchange expects (``expected``, ``expected_chunks``), for the kernels to check the payloads'
own headers against on the device."""
import ctypes

from hvd_qsgd import _native, codec


def parse(heads, lens, where):
    """The C headers of host copies ``heads`` of payloads of ``lens`` bytes, each parsed and checked
    against its payload's length (``codec.raise_status`` naming the payload that fails)."""
    cheads = (_native.CHeader * len(lens))()
    lib_cpu = _native.load()
    for i, n in enumerate(lens):
        if n < codec.HEADER_BYTES:
            codec.raise_status(_native.E_TRUNCATED, f"{where}: payload {i} of {len(lens)}")
        st = lib_cpu.qsgd_parse_header(heads[i].ctypes.data, n, ctypes.byref(cheads[i]))
        if st == _native.OK and cheads[i].payload_len != n:
            st = _native.E_LENGTH
        if st != _native.OK:
            codec.raise_status(st, f"{where}: payload {i} of {len(lens)}", heads[i])
    return cheads


class ParsedHeaders(list):
    """The parsed headers (``codec.Header``) of uint8 CUDA payload tensors, and in ``c`` the C headers
    the kernels take: read from the device once for the host's checks and the decode alike."""

    def __init__(self, cheads):
        super().__init__(codec._header_from_c(h) for h in cheads)
        self.c = cheads


def expected(expect, numel=None):
    """``codec.expected_header`` of the exchange's expectation (bits, bucket_size, norm, coding, numel,
    dtype, fingerprint; ``numel``: another count, a chunk's), for a decode whose headers the device
    checks (fixed coding; it checks the magic and version against its own, and reads each payload's
    flags and checksum)."""
    return codec.expected_header(expect.bits, expect.bucket_size, expect.norm, expect.coding,
                                 expect.numel if numel is None else numel, expect.dtype, expect.fingerprint)


def expected_chunks(expect, ranges):
    """``expected`` of each chunk of scatter_allgather, at its (begin, end) in ``ranges``
    (``reduction.chunk_ranges``)."""
    return [expected(expect, e - b) for b, e in ranges]


def array(headers):
    """A C array of the headers (``qsgd_header*``)."""
    return (_native.CHeader * len(headers))(*headers)
