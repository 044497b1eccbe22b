"""The CUDA kernels on PyTorch CUDA tensors, on the current stream.

Same payloads as ``hvd_qsgd.codec`` (bit-identical for the same input, settings and seed), fixed
coding only. ``available()`` says whether the CUDA library was built and a device is visible.
"""
import ctypes

from hvd_qsgd import _native, codec
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


def encode(x, bits=4, bucket_size=512, norm="max", seed=0, fingerprint=0, checksum=True, name="tensor",
           source_dtype=None):
    """Encode a CUDA tensor (float32, float16 or bfloat16; converted to float32) into a uint8 CUDA
    tensor holding the payload. ``source_dtype`` overrides the dtype recorded in the header."""
    import torch
    if not x.is_cuda:
        raise ValueError(f"{name}: hvd_qsgd.cuda.encode needs a CUDA tensor, got device {x.device}")
    dtype_name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(x.dtype)
    if dtype_name is None:
        raise TypeError(f"{name}: dtype {x.dtype} is not supported; QSGD encodes float32, float16 and bfloat16")
    cfg = codec.make_config(bits, bucket_size, norm, seed, "fixed", fingerprint, checksum,
                            source_dtype or dtype_name)
    flat = x.detach().reshape(-1).to(torch.float32).contiguous()
    n = flat.numel()
    cap = codec.payload_nbytes(n, cfg.bits, cfg.bucket_size)
    out = torch.empty(cap, dtype=torch.uint8, device=x.device)
    st = _lib().qsgd_encode_cuda(ctypes.c_void_p(flat.data_ptr()), n, ctypes.byref(cfg),
                                 ctypes.c_void_p(out.data_ptr()), cap, _stream_handle(torch, x.device))
    if st != _native.OK:
        raise EncodeError(f"{name}: CUDA encode failed: {_native.status_string(st)}", st)
    return out


def decode_sum(payloads, scale=1.0, out=None, accumulate=False, where="decode_sum"):
    """``out = [out +] scale * sum_p decode(p)`` for uint8 CUDA payload tensors (same arithmetic as
    ``codec.decode_sum``). Headers are checked on the host; checksums, scales and padding on the
    device, before ``out`` is written. Synchronizes with the device to report errors."""
    import torch
    if not payloads:
        raise ValueError(f"{where}: no payloads")
    device = payloads[0].device
    cheads = device_headers(payloads, where)
    n = cheads[0].numel
    if out is None:
        if accumulate:
            raise ValueError(f"{where}: accumulate=True needs out=")
        out = torch.empty(n, dtype=torch.float32, device=device)
    elif out.dtype != torch.float32 or out.numel() != n or not out.is_contiguous() or out.device != device:
        raise ValueError(f"{where}: out must be a contiguous float32 tensor of {n} elements on {device}")
    ptrs = (ctypes.c_void_p * len(payloads))(*[p.data_ptr() for p in payloads])
    status = torch.zeros(1, dtype=torch.int32, device=device)
    st = _lib().qsgd_decode_sum_cuda(ptrs, cheads, len(payloads), float(scale), ctypes.c_void_p(out.data_ptr()),
                                     n, int(bool(accumulate)), ctypes.c_void_p(status.data_ptr()),
                                     _stream_handle(torch, device))
    if st == _native.OK:
        st = int(status.item())
    if st != _native.OK:
        codec.raise_status(st, where)
    return out


def device_headers(payloads, where="payloads"):
    """Host copies of the headers of uint8 CUDA payload tensors, parsed and checked against each
    tensor's length (what qsgd_decode_sum_cuda takes); one device-to-host copy for all of them."""
    import torch
    for i, p in enumerate(payloads):
        if p.dtype != torch.uint8 or p.dim() != 1 or not p.is_cuda:
            raise TypeError(f"{where}: payload {i} must be a 1-D uint8 CUDA tensor")
    device = payloads[0].device
    heads = torch.stack([p[: codec.HEADER_BYTES] if p.numel() >= codec.HEADER_BYTES else
                         torch.zeros(codec.HEADER_BYTES, dtype=torch.uint8, device=device)
                         for p in payloads]).cpu().numpy()
    cheads = (_native.CHeader * len(payloads))()
    lib_cpu = _native.load()
    for i, p in enumerate(payloads):
        if p.numel() < codec.HEADER_BYTES:
            codec.raise_status(_native.E_TRUNCATED, f"{where}: payload {i} of {len(payloads)}")
        st = lib_cpu.qsgd_parse_header(heads[i].ctypes.data, p.numel(), ctypes.byref(cheads[i]))
        if st == _native.OK and cheads[i].payload_len != p.numel():
            st = _native.E_LENGTH
        if st != _native.OK:
            codec.raise_status(st, f"{where}: payload {i} of {len(payloads)}", heads[i])
    return cheads


def read_headers(payloads, where="payloads"):
    """The parsed headers (``codec.Header``) of uint8 CUDA payload tensors."""
    return [codec._header_from_c(h) for h in device_headers(payloads, where)]
