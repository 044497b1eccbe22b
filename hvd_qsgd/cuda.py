"""The CUDA kernels on PyTorch CUDA tensors, on the current stream.

Same payloads as ``hvd_qsgd.codec`` (bit-identical for the same input, settings and seed), fixed
coding only, and the chunk steps of scatter_allgather (``encode_chunks``, ``reduce_chunk``,
``decode_chunks``: those of ``hvd_qsgd.reduction``, on the device). ``available()`` says whether the
CUDA library was built and a device is visible.

Where the host waits for the device: ``decode_sum``, ``reduce_chunk`` and ``decode_chunks`` read the
device's verdict on the payloads (checksums, scales, padding) before they return, one small
device-to-host copy each, so that a corrupt payload raises in the call that decoded it (within
``deferred_verdicts``, the verdicts of ``decode_sum`` and ``decode_chunks``, whose results nothing
reads before ``settle``, are kept and read together there, one copy for all:
``hvd_qsgd.cuda_verdicts``); and a decode parses the payloads' headers on the host (one copy of
their first 56 bytes), once: the headers a caller read to check them (``read_headers``) are the ones
the kernels are given. A decode that knows what the headers must say (``expect``, the fixed coding:
``decode_sum``, ``reduce_chunk``, ``decode_chunks``) has the device check them instead, with its
verdict, and reads none. Encoding never waits.
"""
import ctypes

from hvd_qsgd import _native, codec, cuda_headers
from hvd_qsgd.cuda_verdicts import deferred_verdicts, settle, verdict as _verdict   # noqa: F401 (the backends')
from hvd_qsgd.errors import EncodeError


def available():
    """Whether the CUDA library was built and a device is visible."""
    return _native.load_cuda() is not None


def built():
    """Whether the CUDA library was built (nvcc was found at install time)."""
    return _native.cuda_built()


def _lib():
    lib = _native.load_cuda()
    if lib is None:
        raise RuntimeError("hvd_qsgd's CUDA kernels are not available: " + (
            "no CUDA device is visible" if _native.cuda_built() else
            "the CUDA library was not built (nvcc was not found at install time)"))
    return lib


def _stream_handle(torch, device):
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


def _is_device(t):
    """Whether the tensor is where the kernels read it (a CUDA tensor). ``_lib``, ``_stream_handle``
    and this function are the three points where the wrappers meet the device; the tests' emulation
    (``tests/emulated_cuda.on_host``) replaces them to run every wrapper, with host tensors, on the
    CUDA source compiled for the host."""
    return t.is_cuda


_DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2}  # qsgd_dtype


def encode(x, bits=4, bucket_size=512, norm="max", seed=0, fingerprint=0, checksum=True, name="tensor",
           source_dtype=None, residual=None, residual_valid=True, coding="fixed", encoder=codec.DEFAULT_ENCODER):
    """Encode a CUDA tensor (float32, float16 or bfloat16, read natively: no fp32 copy) into a uint8
    CUDA tensor holding the payload. ``source_dtype`` overrides the dtype recorded in the header.

    With ``residual`` (a contiguous float32 CUDA tensor of x's size), error feedback in the same pass:
    the payload is that of v = x + residual (of x alone when ``residual_valid`` is False: a new
    residual), and ``residual`` becomes v - decode(payload) wherever that is finite (keeping its
    value, or 0 when it was not valid, elsewhere): the values ``decode_sum`` of the payload gives.

    ``coding="elias"``: the Elias coding. Its length depends on the data, so the call waits for the
    device once to learn it; error feedback then runs as separate steps on the device."""
    import torch
    if coding == "elias":
        return _encode_elias(x, bits, bucket_size, norm, seed, fingerprint, checksum, name, source_dtype, residual,
                             residual_valid, encoder)
    if coding != "fixed":
        raise ValueError(f"{name}: coding must be 'fixed' or 'elias', got {coding!r}")
    if not _is_device(x):
        raise ValueError(f"{name}: hvd_qsgd.cuda.encode needs a CUDA tensor, got device {x.device}")
    dtype_name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(x.dtype)
    if dtype_name is None:
        raise TypeError(f"{name}: dtype {x.dtype} is not supported; QSGD encodes float32, float16 and bfloat16")
    cfg = _config(bits, bucket_size, norm, 0, fingerprint, checksum, source_dtype or dtype_name, encoder)
    cfg.seed = codec._check_u64("seed", seed)
    flat = x.detach().reshape(-1).contiguous()
    n = flat.numel()
    if residual is not None and (not _is_device(residual) or residual.dtype != torch.float32 or residual.numel() != n
                                 or not residual.is_contiguous() or residual.device != flat.device):
        raise ValueError(f"{name}: residual must be a contiguous float32 tensor of {n} elements on {flat.device}")
    cap = codec.payload_nbytes(n, cfg.bits, cfg.bucket_size)
    out = torch.empty(cap, dtype=torch.uint8, device=x.device)
    st = _lib().qsgd_encode_ex_cuda(ctypes.c_void_p(flat.data_ptr()), _DTYPES[dtype_name], n, ctypes.byref(cfg),
                                    None if residual is None else ctypes.c_void_p(residual.data_ptr()),
                                    int(bool(residual_valid)), ctypes.c_void_p(out.data_ptr()), cap,
                                    _stream_handle(torch, x.device))
    if st != _native.OK:
        raise EncodeError(f"{name}: CUDA encode failed: {_native.status_string(st)}", st)
    return out


def _encode_elias(x, bits, bucket_size, norm, seed, fingerprint, checksum, name, source_dtype, residual,
                  residual_valid, encoder):
    import torch
    if not _is_device(x):
        raise ValueError(f"{name}: hvd_qsgd.cuda.encode needs a CUDA tensor, got device {x.device}")
    dtype_name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(x.dtype)
    if dtype_name is None:
        raise TypeError(f"{name}: dtype {x.dtype} is not supported; QSGD encodes float32, float16 and bfloat16")
    flat = x.detach().reshape(-1).contiguous()
    if residual is not None:  # the unfused steps of error feedback, each on the device
        v = flat.float() + residual if residual_valid else flat.float()
        q = _encode_elias(v, bits, bucket_size, norm, seed, fingerprint, checksum, name, source_dtype or dtype_name,
                          None, True, encoder)
        d = v - decode_sum([q], where=name)
        keep = residual if residual_valid else torch.zeros((), dtype=torch.float32, device=v.device)
        residual.copy_(torch.where(torch.isfinite(d), d, keep))
        return q
    cfg = codec.make_config(bits, bucket_size, norm, seed, "elias", fingerprint, checksum, source_dtype or dtype_name,
                            encoder=encoder)
    n = flat.numel()
    cap = int(_native.load().qsgd_elias_max_nbytes(n, cfg.bits, cfg.bucket_size))
    out = torch.empty(cap, dtype=torch.uint8, device=x.device)
    out_len = ctypes.c_uint64()
    st = _lib().qsgd_encode_elias_cuda(ctypes.c_void_p(flat.data_ptr()), _DTYPES[dtype_name], n, ctypes.byref(cfg),
                                       ctypes.c_void_p(out.data_ptr()), cap, ctypes.byref(out_len),
                                       _stream_handle(torch, x.device))
    if st != _native.OK:
        raise EncodeError(f"{name}: CUDA Elias encode failed: {_native.status_string(st)}", st)
    return out[: out_len.value]


def split_fixed(gathered, count, size):
    """The ``count`` payloads of ``size`` bytes back to back in the uint8 CUDA tensor ``gathered`` (an
    allgather's result), each 4-byte aligned as the kernels read them: views of it where ``size`` is a
    multiple of 4, else rows of one copy of it at 16-byte strides (one copy for all the payloads,
    where ``aligned`` would copy each but the first)."""
    if size % 4 == 0 or count == 1:
        return list(gathered.split(size))
    stride = -(-size // 16) * 16
    rows = gathered.new_empty((count, stride))
    rows[:, :size].copy_(gathered.reshape(count, size))
    return list(rows[:, :size].unbind(0))


def split_payloads(gathered, count, where="gathered payloads"):
    """The ``count`` payloads of a uint8 CUDA tensor holding them back to back (an allgather's
    result), cut at each header's length: one small device-to-host copy per payload (the lengths of
    Elias payloads are in their headers only)."""
    lib, out, off = _native.load(), [], 0
    for r in range(count):
        where_r = f"{where}: payload {r} of {count}"
        rest = gathered.numel() - off
        if rest < codec.HEADER_BYTES:
            codec.raise_status(_native.E_TRUNCATED, where_r)
        head = gathered[off: off + codec.HEADER_BYTES].cpu().numpy()
        h = _native.CHeader()
        st = lib.qsgd_parse_header(head.ctypes.data, rest, ctypes.byref(h))  # reads the header's 56 bytes only
        if st != _native.OK:
            codec.raise_status(st, where_r, head)
        out.append(gathered[off: off + h.payload_len])
        off += h.payload_len
    if off != gathered.numel():
        codec.raise_status(_native.E_LENGTH, f"{where}: {gathered.numel() - off} bytes after {count} payloads")
    return out


def _config(bits, bucket_size, norm, seed, fingerprint, checksum, source_dtype, encoder):
    """``codec.make_config``'s configuration of the fixed coding, copied from the checked template of its
    settings (``codec.config_template``, as ``codec.encode`` does): a tensor's encodes differ by their seed."""
    cfg = _native.Config.from_buffer_copy(codec.config_template(bits, bucket_size, norm, "fixed", checksum, encoder))
    cfg.fingerprint = codec._check_u64("fingerprint", fingerprint)
    cfg.dtype = codec._check_choice("dtype", source_dtype, codec.DTYPES)
    cfg.seed = int(seed) & (2 ** 64 - 1)
    return cfg


def _flat32(x, name):
    import torch
    if not _is_device(x):
        raise ValueError(f"{name}: needs a CUDA tensor, got device {x.device}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{name}: dtype {x.dtype} is not supported; QSGD encodes float32, float16 and bfloat16")
    return x.detach().reshape(-1).to(torch.float32).contiguous()


def encode_chunks(x, n, bits=4, bucket_size=512, norm="max", step_seed=0, fingerprint=0, checksum=True,
                  source_dtype="float32", name="tensor", encoder=codec.DEFAULT_ENCODER):
    """(buffer, lens): the n chunk payloads of the CUDA tensor x back to back in one uint8 CUDA tensor
    and their lengths; bit-identical to ``hvd_qsgd.reduction.encode_chunks``."""
    import torch
    flat = _flat32(x, name)
    cfg = _config(bits, bucket_size, norm, step_seed, fingerprint, checksum, source_dtype, encoder)
    total = int(_native.load().qsgd_chunks_max_nbytes(flat.numel(), int(bits), int(bucket_size), 0, int(n)))
    if total == 0:
        raise ValueError(f"{name}: no chunk layout for n={n}, bits={bits}, bucket_size={bucket_size}")
    out = torch.empty(total, dtype=torch.uint8, device=flat.device)
    lens = (ctypes.c_uint64 * int(n))()
    st = _lib().qsgd_encode_chunks_cuda(ctypes.c_void_p(flat.data_ptr()), flat.numel(), ctypes.byref(cfg), int(n),
                                        ctypes.c_void_p(out.data_ptr()), total, lens,
                                        _stream_handle(torch, flat.device))
    if st != _native.OK:
        raise EncodeError(f"{name}: CUDA encode_chunks failed: {_native.status_string(st)}", st)
    return out, [int(v) for v in lens]


def aligned(payloads):
    """The payloads, each 4-byte aligned as the kernels read them: a payload cut from a received
    buffer at an odd offset is copied (on the device) to a tensor of its own."""
    return [p if p.data_ptr() % 4 == 0 else p.clone() for p in payloads]


def reduce_chunk(payloads, j, bits=4, bucket_size=512, norm="max", step_seed=0, fingerprint=0, checksum=True,
                 source_dtype="float32", residual=None, where="reduce_chunk", encoder=codec.DEFAULT_ENCODER,
                 headers=None, expect=None, explain=None):
    """Chunk j's reduce step on the device (``hvd_qsgd.reduction.reduce_chunk``): the sum of the
    ranks' payloads (uint8 CUDA tensors, rank order) re-quantized with the chunk's phase-1 seed; with
    ``residual`` (a contiguous float32 CUDA tensor of the chunk's numel elements) error feedback on
    the reducing rank, the residual updated in place (left as it was when the step fails); ``headers``,
    ``expect`` and ``explain``: as ``decode_sum``'s (its verdict read in the call)."""
    import torch
    payloads = aligned(payloads)
    cheads, status, heads, named = _headers_for(torch, payloads, headers, expect, explain, where)
    n, device = cheads[0].numel, payloads[0].device
    if residual is not None and (not _is_device(residual) or residual.dtype != torch.float32 or residual.numel() != n
                                 or not residual.is_contiguous() or residual.device != device):
        raise ValueError(f"{where}: residual must be a contiguous float32 tensor of {n} elements on {device}")
    cfg = _config(bits, bucket_size, norm, step_seed, fingerprint, checksum, source_dtype, encoder)
    cap = codec.payload_nbytes(n, cfg.bits, cfg.bucket_size)
    out = torch.empty(cap, dtype=torch.uint8, device=device)
    scratch = torch.empty(n, dtype=torch.float32, device=device)
    ptrs = (ctypes.c_void_p * len(payloads))(*[p.data_ptr() for p in payloads])
    out_len = ctypes.c_uint64()
    st = _lib().qsgd_reduce_chunk_cuda(ptrs, cheads, len(payloads), ctypes.byref(cfg), int(j),
                                       ctypes.c_void_p(scratch.data_ptr()), n, ctypes.c_void_p(out.data_ptr()), cap,
                                       ctypes.byref(out_len),
                                       None if residual is None else ctypes.c_void_p(residual.data_ptr()),
                                       0 if residual is None else n, ctypes.c_void_p(status.data_ptr()), heads,
                                       _stream_handle(torch, device))
    _verdict(st, status, where, explain=named)
    return out[: out_len.value]


def decode_chunks(payloads, alpha, numel, bucket_size, where="decode_chunks", expect=None):
    """``alpha * decode`` of the n reduced chunk payloads (uint8 CUDA tensors) into one float32 CUDA
    tensor of numel elements (``hvd_qsgd.reduction.decode_chunks``); ``expect``: as ``decode_sum``'s
    (``cuda_headers.expected_chunks``), a header that differs named by its status."""
    import torch
    payloads = aligned(payloads)
    cheads, status, heads, named = _headers_for(torch, payloads, None, expect, None, where)
    device = payloads[0].device
    out = torch.empty(int(numel), dtype=torch.float32, device=device)
    ptrs = (ctypes.c_void_p * len(payloads))(*[p.data_ptr() for p in payloads])
    st = _lib().qsgd_decode_chunks_cuda(ptrs, cheads, len(payloads), float(alpha), ctypes.c_void_p(out.data_ptr()),
                                        int(numel), int(bucket_size), ctypes.c_void_p(status.data_ptr()), heads,
                                        _stream_handle(torch, device))
    _verdict(st, status, where, deferrable=True, explain=named)
    return out


def decode_sum(payloads, scale=1.0, out=None, accumulate=False, where="decode_sum", headers=None, expect=None,
               explain=None):
    """``out = [out +] scale * sum_p decode(p)`` for uint8 CUDA payload tensors (same arithmetic as
    ``codec.decode_sum``). Headers are checked on the host (``headers``: those ``read_headers`` gave
    for these payloads, else read here); checksums, scales and padding on the device, before ``out``
    is written. Synchronizes with the device to report errors (within ``deferred_verdicts``: at
    ``settle``). ``expect`` and ``explain``: see ``_headers_for`` (the headers checked on the device,
    nothing read here)."""
    import torch
    if not payloads:
        raise ValueError(f"{where}: no payloads")
    device = payloads[0].device
    payloads = aligned(payloads)
    cheads, status, heads, named = _headers_for(torch, payloads, headers, expect, explain, where)
    out = _out(torch, out, accumulate, cheads[0].numel, device, where)
    ptrs = (ctypes.c_void_p * len(payloads))(*[p.data_ptr() for p in payloads])
    st = _lib().qsgd_decode_sum_cuda(ptrs, cheads, len(payloads), float(scale), ctypes.c_void_p(out.data_ptr()),
                                     cheads[0].numel, int(bool(accumulate)), ctypes.c_void_p(status.data_ptr()),
                                     heads, _stream_handle(torch, device))
    _verdict(st, status, where, deferrable=True, explain=named)
    return out


def _out(torch, out, accumulate, n, device, where):
    """``out``, checked, or a new float32 tensor of n elements on ``device``."""
    if out is None:
        if accumulate:
            raise ValueError(f"{where}: accumulate=True needs out=")
        return torch.empty(n, dtype=torch.float32, device=device)
    if out.dtype != torch.float32 or out.numel() != n or not out.is_contiguous() or out.device != device:
        raise ValueError(f"{where}: out must be a contiguous float32 tensor of {n} elements on {device}")
    return out


def _headers_for(torch, payloads, headers, expect, explain, where):
    """(the C headers a kernel takes, its status tensor, where the device copies the payloads'
    headers or None, what names a header's failure or None).

    ``expect`` (``cuda_headers.expected``: the fixed-coding header each payload must have, one per
    payload), without ``headers``, where each payload has its expected length: the expected headers,
    which the device checks the payloads' own against with the checksums, so that nothing is read
    here; a header that differs is the verdict's failure, named by ``explain(headers)`` (the parsed
    headers the device copied beside the status, read once the verdict says they failed), else by
    its status. Otherwise the payloads' own headers (``headers``, or read here and given to
    ``explain``)."""
    device = payloads[0].device
    if expect is not None and headers is None:
        if all(p.numel() == e.payload_len for p, e in zip(payloads, expect)):
            status = torch.zeros(4 + len(payloads) * codec.HEADER_BYTES // 4, dtype=torch.int32, device=device)

            def named(code):   # (after a failure only: the copied headers, parsed as ``device_headers`` parses them)
                copies = status[4:].cpu().numpy().view("uint8").reshape(len(expect), codec.HEADER_BYTES)
                parsed = cuda_headers.parse(copies, [e.payload_len for e in expect], where)
                if explain is not None:
                    explain([codec._header_from_c(h) for h in parsed])
            return cuda_headers.array(expect), status, ctypes.c_void_p(status.data_ptr() + 16), named
        headers = read_headers(payloads, where)   # (lengths that differ: checked on the host, as before)
        if explain is not None:
            explain(headers)
    return _c_headers(payloads, headers, where), torch.zeros(1, dtype=torch.int32, device=device), None, None


def device_headers(payloads, where="payloads"):
    """Host copies of the headers of uint8 CUDA payload tensors, parsed and checked against each
    tensor's length (what qsgd_decode_sum_cuda takes); one device-to-host copy for all of them."""
    import torch
    for i, p in enumerate(payloads):
        if p.dtype != torch.uint8 or p.dim() != 1 or not _is_device(p):
            raise TypeError(f"{where}: payload {i} must be a 1-D uint8 CUDA tensor")
    device = payloads[0].device
    heads = torch.stack([p[: codec.HEADER_BYTES] if p.numel() >= codec.HEADER_BYTES else
                         torch.zeros(codec.HEADER_BYTES, dtype=torch.uint8, device=device)
                         for p in payloads]).cpu().numpy()
    return cuda_headers.parse(heads, [p.numel() for p in payloads], where)


def read_headers(payloads, where="payloads"):
    """The parsed headers (``codec.Header``) of uint8 CUDA payload tensors (a ``ParsedHeaders``)."""
    return cuda_headers.ParsedHeaders(device_headers(payloads, where))


def _c_headers(payloads, headers, where):
    """The C headers of ``payloads``: those read with them (``headers``, the ``read_headers`` of the
    same payloads), else read from the device now."""
    if isinstance(headers, cuda_headers.ParsedHeaders) and len(headers.c) == len(payloads):
        return headers.c
    return device_headers(payloads, where)
