"""One codec interface, one backend per device: ``CpuBackend`` on NumPy arrays (the CPU kernels) and
``CudaBackend`` on PyTorch CUDA tensors (the CUDA kernels, current stream). Same methods, same
signatures, same payload bytes for the same input, settings and seed:

    encode(x32, settings, seed, fingerprint, source_dtype, where, residual)       -> payload
    encode_chunks(x32, settings, step_seed, n, fingerprint, source_dtype, where, residual)
                                                                -> (the n chunk payloads, their lengths)
    decode(payload, where), decode_sum(payloads, alpha, where, headers, expect) -> float32 values
    decode_gathered(gathered, count, own_len, alpha, expect, where) -> (checked alpha * sum, lengths)
    decode_report(buffer, lens, count, expect, where)           -> (checked sum or nothing, error)
    reduce_chunk(...), reduce_received(...)                     -> scatter_allgather's reduce step
    unframe, part_bytes, decode_chunks(..., error)              -> its phase 2
    split, split_by, read_headers; length, total, sizes, slice, check_size, checked_sizes,
    raise_if_failed, scaled; float32, repeat, concat, empty_bytes, zeros, place, place_bytes, host
What both share is ``hvd_qsgd.backend_host.HostCountedBackend``.

``encode`` and ``encode_chunks`` take an error-feedback ``residual`` (float32, where the backend reads)
and update it in place: the one error-feedback path, on the CPU as on the device (without one, the
CPU's also take a fusion buffer's members where they are: ``encodes_members``).

``choose(device, settings, reduction)`` picks the backend of one exchange, once: ``CudaBackend`` for
a CUDA tensor when every step of its exchange has a CUDA kernel; else the host (copied down, run by
``CpuBackend``, copied back), and the reason, counted in ``stats["host_fallbacks"]`` and logged once
per process by ``note_fallback``. Nothing goes through the host silently.
"""
import logging
import threading
from types import SimpleNamespace
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from hvd_qsgd import _native, codec, codec_segments, cuda, cuda_headers, error_feedback, protocol, reduction
from hvd_qsgd.backend_host import HostCountedBackend
from hvd_qsgd.errors import MismatchError
from hvd_qsgd.result_pool import ResultPool

log = logging.getLogger("hvd_qsgd")


class CpuBackend(HostCountedBackend):
    """The CPU kernels on NumPy arrays (``hvd_qsgd.codec``, ``hvd_qsgd.reduction``); results in ``pool``."""

    name = "cpu"
    pool = ResultPool()

    def encode(self, x32: np.ndarray, settings, seed: int, fingerprint: int, source_dtype: str, where: str,
               residual: Optional[np.ndarray] = None, residual_valid: bool = True):
        """The payload of x32; with ``residual`` (float32, x32's size) error feedback: the payload of
        v = x32 + residual (x32 alone when not ``residual_valid``), and residual = v - decode(payload)
        where that is finite (else it keeps its value; 0 when it was not valid), updated in place.
        x32 may also be a fusion buffer's members where they are (``encodes_members``), ``residual``
        then their residuals, one per part."""
        if type(x32) is codec_segments.Members:
            prepared = self._prepared(settings, fingerprint, source_dtype, x32.numel)
            if residual is None:
                return codec_segments.encode(prepared, x32, seed, where)
            return error_feedback.encode_members(prepared, x32, residual, seed, residual_valid, where)
        prepared = self._prepared(settings, fingerprint, source_dtype, x32.size)
        if residual is None:
            return codec.encode_prepared(prepared, x32, seed, where)
        return error_feedback.encode(prepared, x32, seed, residual, residual_valid, where)

    encodes_members = staticmethod(codec_segments.takes)
    _kept = {}   # codec.prepare's of each tensor: (its settings, what was prepared), by their ids and size

    @classmethod
    def _prepared(cls, s, fingerprint: int, source_dtype: str, numel: int):
        """``codec.prepare`` of a tensor's encode, made once (its settings held, so that their id stays theirs)."""
        key = (id(s), fingerprint, source_dtype, numel)
        kept = cls._kept.get(key)
        if kept is None or kept[0] is not s:
            if len(cls._kept) >= 4096:   # (DQSGD's settings vary by step: start again)
                cls._kept.clear()
            kept = cls._kept[key] = (s, codec.prepare(numel, s.bits, s.bucket_size, s.norm, s.coding, fingerprint,
                                                      s.checksum, source_dtype, s.encoder))
        return kept[1]

    def decode(self, payload, where: str) -> np.ndarray:
        return codec.decode(payload, where)

    @staticmethod
    def length(x) -> int:
        """The number of elements of ``x`` (bytes of a payload)."""
        return int(x.size)

    def float32(self, x) -> np.ndarray:
        """A float32 copy of ``x``, flat."""
        return np.array(x, dtype=np.float32).reshape(-1)

    def repeat(self, x, times: int) -> np.ndarray:
        """``x`` (flat) ``times`` times back to back."""
        return np.tile(x, times)

    def concat(self, arrays: Sequence) -> np.ndarray:
        """The arrays (flat, one dtype) back to back."""
        return np.concatenate([np.reshape(a, -1) for a in arrays])

    def split_fused(self, gathered, count: int, lens: Sequence[int], by_headers: bool, where: str) -> List[np.ndarray]:
        """The payloads of a fused allgather's result, rank after rank, each rank's ``len(lens)``
        payloads in order (``hvd_qsgd.exchange.fused``): cut at this rank's lengths (which every
        rank's share with the fixed coding, unless the ranks' tensors differ), or ``by_headers`` at
        each header's length."""
        return self.split_fused_by(gathered, count, lens, by_headers, gathered.size,
                            lambda: codec.split_payloads(gathered, count=count * len(lens),
                                                         where=f"{where}: gathered payloads"))

    def empty_bytes(self, like) -> np.ndarray:
        """An empty payload where this backend reads ``like``."""
        return np.zeros(0, dtype=np.uint8)

    def zeros(self, size: int, like) -> np.ndarray:
        """A float32 array of ``size`` zeros where this backend reads ``like``."""
        return np.zeros(size, dtype=np.float32)

    def place(self, array, like) -> np.ndarray:
        """``array`` (a residual kept here, or loaded from a checkpoint: a NumPy array or a tensor) as a
        contiguous float32 array this backend reads: no copy for what is one already."""
        if not isinstance(array, np.ndarray) and callable(getattr(array, "cpu", None)):
            array = array.detach().cpu()   # a framework's tensor, maybe on a device: its host copy
        return np.ascontiguousarray(array, dtype=np.float32)

    def host(self, x) -> np.ndarray:
        """``x`` as a NumPy array on the host."""
        return x

    def place_bytes(self, payload: np.ndarray, like) -> np.ndarray:
        """A host payload (uint8) where this backend reads ``like``."""
        return payload

    def split(self, gathered, count: int, own_len: int, where: str, headers=None, coding=None) -> List[np.ndarray]:
        """The ranks' payloads in an allgather's result, cut at each header's length (put in ``headers``;
        ``coding``, the one the exchange expects: the host reads the headers anyway)."""
        return codec.split_payloads(gathered, count=count, where=f"{where}: gathered payloads", headers=headers)

    def read_headers(self, payloads: Sequence, where: str) -> List[codec.Header]:
        return [codec.read_header(p, f"{where} from rank {r}") for r, p in enumerate(payloads)]

    def decode_gathered(self, gathered, count: int, own_len: int, alpha: float, expect, where: str):
        """As the host-counted backends', in one native call (``codec.decode_gathered``): where that
        fails, their path names the payload and the field that do (the same checks)."""
        try:
            return codec.decode_gathered(gathered, count, expect, alpha, self.pool.take(expect.numel))
        except codec.PayloadError:
            return super().decode_gathered(gathered, count, own_len, alpha, expect, where)

    def decode_report(self, buffer, lens, count: int, expect, where: str):
        """As the host-counted backends', in one native call where the payloads' headers cut the
        buffer at ``lens`` (those not 0); else their path names what fails."""
        try:
            out, cut = codec.decode_gathered(buffer, count, expect, 1.0, self.pool.take(expect.numel))
            if cut == [int(v) for v in lens if v]:
                return out, None
        except codec.PayloadError:
            pass
        return super().decode_report(buffer, lens, count, expect, where)

    def decode_sum(self, payloads: Sequence, alpha: float, where: str, headers=None, expect=None) -> np.ndarray:
        headers = self.checked_headers(payloads, headers, expect, where)
        out = self.pool.take(headers[0].numel) if headers else self.pool.take_for(payloads)
        return codec.decode_sum(payloads, alpha, out=out, where=where, headers=headers)

    def encode_chunks(self, x32: np.ndarray, settings, step_seed: int, n: int, fingerprint: int,
                      source_dtype: str, where: str, residual: Optional[np.ndarray] = None,
                      residual_valid: bool = True) -> Tuple[np.ndarray, List[int]]:
        """The n chunk payloads of x32 (or a fusion buffer's members) back to back and their lengths; with
        ``residual`` error feedback as ``encode`` has it, the residual being v - decode of the n chunk payloads."""
        return reduction.encode_chunks(x32, settings, step_seed, n, fingerprint, source_dtype, where, residual,
                                       residual_valid)

    def split_by(self, buffer, lens) -> List[np.ndarray]:
        return reduction.split_by(buffer, lens)

    def reduce_chunk(self, payloads: Sequence, j: int, settings, step_seed: int, fingerprint: int,
                     source_dtype: str, where: str, residual: Optional[np.ndarray] = None) -> np.ndarray:
        return reduction.reduce_chunk(payloads, j, settings, step_seed, fingerprint, source_dtype, where=where,
                                      residual=residual)

    def reduce_received(self, received, splits, j: int, settings, step_seed: int, expect, where: str,
                        server_residual=None):
        return reduction.reduce_received(received, splits, j, settings, step_seed, expect, where,
                                         server_residual=server_residual)

    def decode_chunks(self, payloads: Sequence, alpha: float, numel: int, bucket_size: int,
                      where: str, error=None, expect=None) -> np.ndarray:
        """alpha * the decoded chunks back to back (``error``: this rank's failed reduce step, raised
        before by ``raise_if_failed``; ``expect``: the tensor's header fields, which a device backend
        checks the chunks' headers against; the host reads them anyway)."""
        return reduction.decode_chunks(payloads, alpha, numel, bucket_size, out=self.pool.take(numel), where=where)


class CudaBackend(HostCountedBackend):
    """The CUDA kernels on PyTorch CUDA tensors (``hvd_qsgd.cuda``): the fixed coding's encode and
    decode-sum, and the chunk steps of scatter_allgather, with server error feedback (the reducing rank's
    residual a CUDA tensor the reduce kernel updates in place), and the Elias coding's encode and
    decode-sum (its cases in tests/test_cuda.py passed on an H200, docs/gpu.md); the Elias coding has
    no chunk kernels. ``missing`` names what an exchange would need that is not here."""

    name = "cuda"

    @staticmethod
    def deferred_verdicts(pending):
        return cuda.deferred_verdicts(pending)   # an exchange's result: its verdict read with the step's others

    @staticmethod
    def settle(pending) -> None:
        cuda.settle(pending)   # once, where the step's last result is handed over

    @staticmethod
    def missing(settings, exchange_reduction: str) -> Optional[str]:
        """Why an exchange with these settings cannot run on the device, or None."""
        if not cuda.available():
            return "the CUDA kernels are not available (" + (
                "no CUDA device is visible" if cuda.built() else "the CUDA library was not built") + ")"
        if settings.coding != "fixed" and exchange_reduction == "scatter_allgather":
            return f"the {settings.coding} coding's chunk steps have no CUDA kernel"
        return None

    def encode(self, x32, settings, seed: int, fingerprint: int, source_dtype: str, where: str,
               residual=None, residual_valid: bool = True):
        """As CpuBackend.encode, in one pass on the device; x32 may also be float16 or bfloat16 (read
        natively, without an fp32 copy)."""
        s = settings
        return cuda.encode(x32, s.bits, s.bucket_size, s.norm, seed, fingerprint, s.checksum, name=where,
                           source_dtype=source_dtype, residual=residual, residual_valid=residual_valid,
                           coding=s.coding, encoder=s.encoder)

    def decode(self, payload, where: str):
        return cuda.decode_sum([payload], where=where)

    @staticmethod
    def length(x) -> int:
        return int(x.numel())

    def float32(self, x):
        import torch
        return x.detach().reshape(-1).to(torch.float32, copy=True)

    def repeat(self, x, times: int):
        return x.repeat(times)

    def concat(self, arrays: Sequence):
        import torch
        return torch.cat([a.reshape(-1) for a in arrays])

    def split_fused(self, gathered, count: int, lens: Sequence[int], by_headers: bool, where: str) -> list:
        """As CpuBackend.split_fused, on the device (by headers: ``cuda.split_payloads``)."""
        return self.split_fused_by(gathered, count, lens, by_headers, gathered.numel(),
                            lambda: cuda.split_payloads(gathered, count * len(lens), f"{where}: gathered payloads"))

    def empty_bytes(self, like):
        import torch
        return torch.zeros(0, dtype=torch.uint8, device=like.device)

    def zeros(self, size: int, like):
        import torch
        return torch.zeros(size, dtype=torch.float32, device=like.device)

    def place(self, array, like):
        """``array`` as a contiguous float32 tensor on ``like``'s device: no copy for what is one already."""
        import torch
        return torch.as_tensor(array).to(device=like.device, dtype=torch.float32).contiguous()

    def host(self, x) -> np.ndarray:
        return x.detach().cpu().numpy()

    def place_bytes(self, payload: np.ndarray, like):
        import torch
        return torch.from_numpy(payload).to(like.device, non_blocking=True)

    def split(self, gathered, count: int, own_len: int, where: str, headers=None, coding=None) -> list:
        """Fixed coding: every rank's payload has the length of this rank's. Elias coding (lengths
        differ): cut at each header's length (``cuda.split_payloads``). ``coding``: the one the
        exchange expects (which every rank's control vector agreed on): the fixed one cuts without
        reading the device where the result has ``count`` payloads of this rank's length, else at each
        header's length, whose checks name what differs. Without it, the coding is read from the
        first payload's header (one byte of a small device-to-host copy)."""
        if coding is not None:
            if coding == "fixed" and gathered.numel() == count * own_len:
                return cuda.split_fixed(gathered, count, own_len)
            return cuda.split_payloads(gathered, count, f"{where}: gathered payloads")
        if gathered.numel() >= codec.HEADER_BYTES and int(gathered[5:6].cpu()[0]) == 1:  # byte 5: coding
            return cuda.split_payloads(gathered, count, f"{where}: gathered payloads")
        if gathered.numel() != count * own_len:
            raise MismatchError(f"{where}: gathered {gathered.numel()} bytes from {count} ranks, "
                                f"expected {count} payloads of {own_len} bytes")
        return cuda.split_fixed(gathered, count, own_len)

    def read_headers(self, payloads: Sequence, where: str) -> List[codec.Header]:
        return cuda.read_headers(payloads, where)

    def decode_sum(self, payloads: Sequence, alpha: float, where: str, headers=None, expect=None):
        if expect is not None and not headers and expect.coding == "fixed":   # (checked on the device)
            return cuda.decode_sum(payloads, alpha, where=where, expect=[cuda_headers.expected(expect)] * len(payloads),
                                   explain=lambda got: protocol.check_gathered(got, expect, where))
        return cuda.decode_sum(payloads, alpha, where=where, headers=self.checked_headers(payloads, headers, expect, where))

    def encode_chunks(self, x32, settings, step_seed: int, n: int, fingerprint: int, source_dtype: str, where: str,
                      residual=None, residual_valid: bool = True):
        """As CpuBackend.encode_chunks, on the device (x32 may also be float16 or bfloat16)."""
        import torch
        s = settings
        if residual is None:
            return cuda.encode_chunks(x32, n, s.bits, s.bucket_size, s.norm, step_seed, fingerprint, s.checksum,
                                      source_dtype, name=where, encoder=s.encoder)
        v = x32.detach().reshape(-1).float()
        v = v + residual if residual_valid else v.clone()
        buf, lens = cuda.encode_chunks(v, n, s.bits, s.bucket_size, s.norm, step_seed, fingerprint, s.checksum,
                                       source_dtype, name=where, encoder=s.encoder)
        ours = SimpleNamespace(bits=s.bits, bucket_size=s.bucket_size, norm=s.norm, coding="fixed", numel=v.numel(),
                               dtype=source_dtype, fingerprint=fingerprint)   # (their headers: no read of them)
        d = v - self.decode_chunks(self.split_by(buf, lens), 1.0, v.numel(), s.bucket_size, where, expect=ours)
        residual.copy_(torch.where(torch.isfinite(d), d, residual if residual_valid else torch.zeros_like(d)))
        return buf, lens

    def split_by(self, buffer, lens) -> list:
        if sum(lens) != buffer.numel():
            raise codec.PayloadError(f"received {buffer.numel()} bytes, but the splits {list(lens)} add up to "
                                     f"{sum(lens)}", _native.E_LENGTH)
        return list(buffer.split([int(v) for v in lens]))

    def reduce_chunk(self, payloads: Sequence, j: int, settings, step_seed: int, fingerprint: int,
                     source_dtype: str, where: str, residual=None):
        return self._reduce_chunk(payloads, j, settings, step_seed, fingerprint, source_dtype, where, residual)

    @staticmethod
    def _reduce_chunk(payloads, j, settings, step_seed, fingerprint, source_dtype, where, residual, expect=None):
        s, want = settings, expect and [cuda_headers.expected(expect)] * len(payloads)   # (checked on the device)
        return cuda.reduce_chunk(payloads, j, s.bits, s.bucket_size, s.norm, step_seed, fingerprint, s.checksum,
                                 source_dtype, residual=residual, where=where, encoder=s.encoder, expect=want,
                                 explain=expect and (lambda got: protocol.check_gathered(got, expect, where)))

    def reduce_received(self, received, splits, j: int, settings, step_seed: int, expect, where: str,
                        server_residual=None):
        """``reduction.reduce_received`` on the device: (the phase-2 frame as a uint8 CUDA tensor, the
        error that emptied it or None). Never raises. ``server_residual()``, where given, returns the
        chunk's server residual as a float32 CUDA tensor, updated in place (unchanged on failure)."""
        import torch
        try:
            payloads = self.split_by(received, splits)
            begin, end = reduction.chunk_ranges(expect.numel, expect.bucket_size, len(payloads))[j]
            chunk = SimpleNamespace(**{**vars(expect), "numel": end - begin})
            residual = server_residual() if server_residual is not None else None
            q, error = self._reduce_chunk(payloads, j, settings, step_seed, expect.fingerprint, expect.dtype,
                                          f"{where}: chunk {j}", residual, chunk), None
        except Exception as e:  # raised on this rank by its decompress; the others see the empty frame
            q, error = received.new_zeros(0), e
        head = torch.tensor(list(int(q.numel()).to_bytes(8, "little")), dtype=torch.uint8, device=received.device)
        return torch.cat([head, q]), error

    def decode_chunks(self, payloads: Sequence, alpha: float, numel: int, bucket_size: int, where: str, error=None,
                      expect=None):   # (expect, fixed coding: the chunks' headers checked on the device)
        fixed = expect is not None and expect.coding == "fixed"
        want = fixed and cuda_headers.expected_chunks(expect, reduction.chunk_ranges(numel, bucket_size, len(payloads)))
        return cuda.decode_chunks(payloads, alpha, numel, bucket_size, where, expect=want or None)

    def unframe(self, gathered, n: int, where: str, expect=None) -> list:
        """As the host-counted backends', but cut on the device, without the frames' round trip
        through the host, where the fixed coding fixes each reduced chunk's length (``expect``) and
        the frames of those lengths add up to what was gathered: then every rank sent its chunk (a
        rank that could not sends an empty frame), and each chunk's header, checked by its decode,
        still says its own length."""
        if expect is not None and expect.coding == "fixed":
            lens = [codec.payload_nbytes(e - b, expect.bits, expect.bucket_size)
                    for b, e in reduction.chunk_ranges(expect.numel, expect.bucket_size, n)]
            if gathered.numel() == sum(lens) + 8 * n:
                offsets = np.cumsum([0] + [8 + v for v in lens[:-1]])
                return [gathered[o + 8: o + 8 + v] for o, v in zip(offsets.tolist(), lens)]
        return super().unframe(gathered, n, where)


CPU, CUDA = CpuBackend(), CudaBackend()


def choose(device_type: str, settings, exchange_reduction: str) -> Tuple[Any, Optional[str]]:
    """(backend, None) for a tensor on ``device_type`` ("cpu" or "cuda"), or (CPU, why) where it goes through the host."""
    if device_type != "cuda":
        return CPU, None
    reason = CudaBackend.missing(settings, exchange_reduction)
    return (CPU, reason) if reason else (CUDA, None)


_logged, _logged_lock = set(), threading.Lock()   # the fallback reasons logged so far


def note_fallback(reason: str, stats) -> None:
    """Count one exchange that went through the host in ``stats`` and log the reason (once per reason
    and process, at WARNING on the ``hvd_qsgd`` logger)."""
    stats.add(host_fallbacks=1)
    with _logged_lock:
        first = reason not in _logged
        _logged.add(reason)
    if first:
        log.warning("hvd_qsgd: CUDA tensors go through the host: %s (counted in stats['host_fallbacks'])", reason)
