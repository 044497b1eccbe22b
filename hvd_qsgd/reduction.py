"""The scatter_allgather reduction of QSGD payloads: the algorithm, on NumPy buffers.

An allgather of b-bit payloads makes every rank receive (n-1) * P bytes, which grows with n. This
reduction keeps a rank's traffic near 2 (n-1)/n * P, flat in n, like a ring allreduce:

For a tensor of d elements on n ranks, split into n chunks of whole buckets
(``chunk_ranges``: chunk j holds buckets floor(j nb / n) .. floor((j+1) nb / n) - 1, nb = ceil(d / B)),
with rank r's step seed sigma_r (``protocol.payload_seed``):

    phase 1 (alltoall)   rank r encodes chunk j of its g_r with seed chunk_seed(sigma_r, j, 0) and
                         sends that payload p_rj to rank j;
    reduce               rank j decodes and sums what it received, S_j = sum_r decode(p_rj) (fp32,
                         in rank order), and re-quantizes it with fresh randomness:
                         q_j = encode(S_j, seed chunk_seed(sigma_j, j, 1));
    phase 2 (allgather)  every rank receives q_0 .. q_{n-1} and writes chunk j of the result as
                         alpha * decode(q_j)  (alpha = 1/n for Average, 1 for Sum).

Unbiased: E[decode(q_j) | S_j] = S_j and E[S_j] = sum_r g_r[chunk j], so E[result] = alpha sum_r g_r.
Every rank decodes the same q_j with the same kernel, so every rank ends bit-identical. The reduced
chunk is quantized twice, so its variance is that of one quantization of each rank's chunk plus one
of their sum (QSGD's Lemma 3.1 bound applies to each).

A rank that cannot reduce its chunk (a payload failed its checks) sends an empty phase-2 payload;
every rank sees the empty slot and raises, so nobody waits on a collective another rank skipped.

The chunk steps are the kernels' ``qsgd_encode_chunks_cpu``, ``qsgd_reduce_chunk_cpu`` and
``qsgd_decode_chunks_cpu`` (kernels/qsgd_chunks.cc), which the TensorFlow ops call too. ``simulate``
runs both phases for all ranks in one process: the reference the multi-rank tests compare with.
"""
import ctypes
import functools
from types import SimpleNamespace

import numpy as np

from hvd_qsgd import _native, codec, codec_segments, error_feedback, protocol
from hvd_qsgd.errors import EncodeError, PayloadError


def chunk_ranges(numel, bucket_size, n):
    """((begin, end), ...) of the n chunks of a numel-element tensor (whole buckets; some may be empty)."""
    return _chunk_ranges(int(numel), int(bucket_size), int(n))


@functools.lru_cache(maxsize=4096)   # (a tensor's chunks are the same at every step and stage: found once)
def _chunk_ranges(numel, bucket_size, n):
    lib = _native.load()
    b, e = ctypes.c_uint64(), ctypes.c_uint64()
    out = []
    for j in range(n):
        st = lib.qsgd_chunk_range(numel, bucket_size, n, j, ctypes.byref(b), ctypes.byref(e))
        if st != _native.OK:
            raise ValueError(f"chunk_ranges({numel}, {bucket_size}, {n}): {_native.status_string(st)}")
        out.append((b.value, e.value))
    return tuple(out)


def check_chunk(payloads, j, expect, where):
    """Check the n ranks' payloads of chunk j against ``expect``, the header fields of the whole
    tensor (bits, bucket_size, norm, coding, numel, dtype, fingerprint): a chunk payload has them
    all, with the chunk's own numel. Raises ``protocol.MismatchError`` naming the field and ranks."""
    begin, end = chunk_ranges(expect.numel, expect.bucket_size, len(payloads))[j]
    protocol.check_payloads(payloads, SimpleNamespace(**{**vars(expect), "numel": end - begin}),
                            f"{where}: chunk {j}")


def chunk_seed(step_seed, j, phase):
    """The seed of chunk j's payload in phase 0 (a rank's share) or 1 (the reduced chunk)."""
    return int(_native.load().qsgd_chunk_seed(int(step_seed), int(j), int(phase)))


def _config(settings, step_seed, fingerprint, source_dtype):
    cfg = codec.make_config(settings.bits, settings.bucket_size, settings.norm, 0, settings.coding, fingerprint,
                            settings.checksum, dtype=source_dtype, encoder=settings.encoder)
    cfg.seed = int(step_seed) & (2 ** 64 - 1)
    return cfg


def _raise(st, where, payloads=()):
    for i, p in enumerate(payloads):  # name the payload that fails, when one does
        if p.size and _native.load().qsgd_validate_cpu(_native.address(p), p.size) != _native.OK:
            codec.validate(p, f"{where}: payload {i}")
    codec.raise_status(st, where)


def encode_chunks(x32, settings, step_seed, n, fingerprint=0, source_dtype="float32", where="encode_chunks",
                  residual=None, residual_valid=True):
    """Phase 1 on one rank: the payloads of the n chunks of float32 ``x32`` back to back, and their
    lengths (the alltoall's splits). ``x32`` may also be a fusion buffer's ``codec_segments.Members``
    (the fixed coding: ``codec_segments.takes``), encoded without assembling it: the same bytes.
    With ``residual`` (a writeable contiguous float32 array of x32's size) error feedback, as
    ``error_feedback.encode`` does it for each chunk, in one native call
    (``qsgd_encode_chunks_ef_cpu``); with members, ``residual`` is their residuals, one per part
    (``error_feedback.encode_members`` for each chunk)."""
    members = type(x32) is codec_segments.Members
    x = x32 if members else np.ascontiguousarray(x32, dtype=np.float32).reshape(-1)
    numel = x.numel if members else x.size
    lib = _native.load()
    cfg = _config(settings, step_seed, fingerprint, source_dtype)
    cap = lib.qsgd_chunks_max_nbytes(numel, cfg.bits, cfg.bucket_size, cfg.coding, int(n))
    out = np.empty(cap, dtype=np.uint8)
    if members:
        lens = _encode_member_chunks(x, cfg, step_seed, n, out, where, residual, residual_valid)
    else:
        lens = np.zeros(n, dtype=np.uint64)
        if residual is not None:
            error_feedback.check_residual(residual, x, where)
            st = lib.qsgd_encode_chunks_ef_cpu(_native.address(x), x.size, ctypes.byref(cfg), int(n),
                                               _native.address(residual), 1 if residual_valid else 0,
                                               _native.address(out), cap, _native.address(lens))
        else:
            st = lib.qsgd_encode_chunks_cpu(_native.address(x), x.size, ctypes.byref(cfg), int(n),
                                            _native.address(out), cap, _native.address(lens))
        if st != _native.OK:
            raise EncodeError(f"{where}: encode failed: {_native.status_string(st)}", st)
        lens = [int(v) for v in lens]
    total = sum(lens)
    return (out if total == cap else out[:total].copy()), lens


def _encode_member_chunks(members, cfg, step_seed, n, out, where, residuals=None, valid=True):
    """The chunk payloads of the tensor ``members`` into ``out``, and their lengths: chunk j, elements
    [b_j, e_j), encoded from the parts of the members inside it (``qsgd_encode_segments_cpu``, or
    with ``residuals``, one per part, ``qsgd_encode_segments_ef_cpu`` on the same slices of them)
    with chunk j's phase-1 seed."""
    parts, offsets, numel = members
    if residuals is not None and len(residuals) != len(parts):
        raise ValueError(f"{where}: {len(residuals)} error-feedback residuals for {len(parts)} parts")
    lens, at, first = [], 0, 0
    for j, (b, e) in enumerate(chunk_ranges(numel, cfg.bucket_size, n)):
        inside = ([], [], [])   # chunk j's parts: each member's elements in [b, e), at its offset from b; residuals
        while first < len(parts) and offsets[first] + parts[first].size <= b:
            first += 1   # (members end before the chunk: done with)
        for i in range(first, len(parts)):
            p, o = parts[i], offsets[i]
            if o >= e:
                break
            lo, hi = max(b, o), min(e, o + p.size)
            if hi > lo:
                inside[0].append(p[lo - o:hi - o])
                inside[1].append(lo - b)
                if residuals is not None:
                    inside[2].append(residuals[i][lo - o:hi - o])
        chunk, prepared, seed = codec_segments.Members(*inside[:2], e - b), (cfg, e - b, None), chunk_seed(step_seed, j, 0)
        q = (codec_segments.encode(prepared, chunk, seed, where, out=out[at:]) if residuals is None else
             error_feedback.encode_members(prepared, chunk, inside[2], seed, valid, where, out=out[at:]))
        lens.append(q.size)
        at += q.size
    return lens


def _pointers(payloads):
    ps = [codec._as_bytes(p, "payload") for p in payloads]
    return ps, (ctypes.c_void_p * len(ps))(*[_native.address(p) for p in ps]), \
        (ctypes.c_uint64 * len(ps))(*[p.size for p in ps])


def reduce_chunk(payloads, j, settings, step_seed, fingerprint=0, source_dtype="float32", where="reduce_chunk",
                 residual=None):
    """The reduce step on rank j: re-quantize the sum of the ranks' chunk-j payloads (in rank order).

    With ``residual`` (a C-contiguous, writeable float32 NumPy array of the chunk's numel elements):
    error feedback on the reducing rank (kernel ``qsgd_reduce_chunk_ef_cpu``). With S the fp32 sum of
    the decoded payloads in rank order, v = S + residual (fp32), q = encode(v) with the seed of the
    plain reduce step, and ``residual`` is updated in place to v - decode(q) wherever that is finite
    (elsewhere -- v non-finite, its bucket decoded non-finite, or an overflow -- it keeps its value).
    ``residual`` is left untouched when the step fails."""
    ps, ptrs, lens = _pointers(payloads)
    numel = codec.read_header(ps[0], f"{where}: payload 0").numel
    if residual is not None and (not isinstance(residual, np.ndarray) or residual.dtype != np.float32
                                 or residual.size != numel or not residual.flags.c_contiguous
                                 or not residual.flags.writeable):
        got = (f"{residual.dtype} with {residual.size} elements" if isinstance(residual, np.ndarray)
               else type(residual).__name__)
        raise ValueError(f"{where}: residual must be a C-contiguous, writeable float32 NumPy array of the chunk's "
                         f"{numel} elements, got {got}")
    lib = _native.load()
    cfg = _config(settings, step_seed, fingerprint, source_dtype)
    scratch = np.empty(numel, dtype=np.float32)
    cap = codec.max_payload_nbytes(numel, cfg.bits, cfg.bucket_size, settings.coding)
    out = np.empty(cap, dtype=np.uint8)
    out_len = ctypes.c_uint64(0)
    if residual is None:
        st = lib.qsgd_reduce_chunk_cpu(ptrs, lens, len(ps), ctypes.byref(cfg), int(j), _native.address(scratch), numel,
                                       _native.address(out), cap, ctypes.byref(out_len))
    else:
        st = lib.qsgd_reduce_chunk_ef_cpu(ptrs, lens, len(ps), ctypes.byref(cfg), int(j), _native.address(scratch),
                                          numel, _native.address(out), cap, ctypes.byref(out_len),
                                          _native.address(residual), residual.size)
    if st != _native.OK:
        _raise(st, where, ps)
    return out if out_len.value == cap else out[:out_len.value].copy()


def decode_chunks(payloads, alpha, numel, bucket_size, out=None, where="decode_chunks"):
    """Phase 2's result: chunk j of ``out`` = alpha * decode(payload j), for the n reduced chunks."""
    if out is None:
        out = np.empty(numel, dtype=np.float32)
    if out.dtype != np.float32 or out.size != numel or not out.flags.c_contiguous:
        raise ValueError(f"{where}: out must be a C-contiguous float32 array of {numel} elements")
    empty = [j for j, p in enumerate(payloads) if len(p) == 0]
    if empty:
        raise PayloadError(f"{where}: rank(s) {empty} sent no reduced chunk: they could not reduce their "
                           "chunk (see the error on those ranks)", _native.E_TRUNCATED)
    ps, ptrs, lens = _pointers(payloads)
    st = _native.load().qsgd_decode_chunks_cpu(ptrs, lens, len(ps), float(alpha), _native.address(out), int(numel),
                                               int(bucket_size))
    if st != _native.OK:
        if st == _native.E_MISMATCH:
            ranges = chunk_ranges(numel, bucket_size, len(ps))
            got = [codec.read_header(p, f"{where}: chunk {j}").numel for j, p in enumerate(ps)]
            raise PayloadError(f"{where}: reduced chunks have {got} elements, expected "
                               f"{[e - b for b, e in ranges]} (bucket size {bucket_size})", st)
        _raise(st, where, ps)
    return out


def split_by(buffer, lens):
    """Views of ``buffer`` cut at the given lengths (received splits, in rank order)."""
    buf = codec._as_bytes(buffer, "buffer")
    if sum(lens) != buf.size:
        raise PayloadError(f"received {buf.size} bytes, but the splits {list(lens)} add up to {sum(lens)}",
                           _native.E_LENGTH)
    offs = np.cumsum([0] + list(lens))
    return [buf[offs[i]: offs[i + 1]] for i in range(len(lens))]


def simulate(xs, settings, step_seeds, alpha, fingerprint=0, source_dtype="float32"):
    """Both phases for all n = len(xs) ranks in one process, with rank r's step seed step_seeds[r].

    Returns (result, phase-1 payloads [r][j], reduced chunks [j])."""
    n = len(xs)
    sent = []
    for r, x in enumerate(xs):
        buf, lens = encode_chunks(x, settings, step_seeds[r], n, fingerprint, source_dtype)
        sent.append(split_by(buf, lens))
    reduced = [reduce_chunk([sent[r][j] for r in range(n)], j, settings, step_seeds[j], fingerprint, source_dtype)
               for j in range(n)]
    numel = np.asarray(xs[0]).size
    return decode_chunks(reduced, alpha, numel, settings.bucket_size), sent, reduced


# -- the reduce phase on the reducing rank, and the frames of phase 2 ---------------------------------
#
# Phase 2 travels as one allgather of frames [8-byte little-endian length of q][q], one per rank
# (length 0 and no payload when that rank could not reduce its chunk), so every rank learns every
# reduced chunk's length without parsing headers, and an empty slot tells every rank that rank j
# failed.

def reduce_received(received, splits, j, settings, step_seed, expect, where, server_residual=None):
    """Rank j's reduce step on what its alltoall received: check every rank's payload of chunk j
    against ``expect`` (``check_chunk``), re-quantize their sum (``reduce_chunk``; with
    ``server_residual()``, a function returning the chunk's server residual, error feedback on the
    reducing rank). Returns (frame, error): the phase-2 frame, and the exception that made it empty
    (None when the step succeeded). Never raises: the other ranks must still see this rank's frame."""
    try:
        payloads = split_by(received, splits)
        check_chunk(payloads, j, expect, where)
        residual = server_residual() if server_residual is not None else None
        q = reduce_chunk(payloads, j, settings, step_seed, expect.fingerprint, expect.dtype,
                         where=f"{where}: chunk {j}", residual=residual)
        error = None
    except Exception as e:  # raised on this rank by its decompress; the others see the empty frame
        q, error = np.zeros(0, dtype=np.uint8), e
    return frame(q), error


def frame(q):
    """The phase-2 frame of a reduced chunk payload ``q``."""
    out = np.empty(8 + q.size, dtype=np.uint8)
    out[:8] = np.frombuffer(int(q.size).to_bytes(8, "little"), dtype=np.uint8)
    out[8:] = q
    return out


def unframe(gathered, n, where):
    """The n reduced chunk payloads of an allgather of frames (an empty one where a rank failed);
    ``protocol.MismatchError`` when the frames end early."""
    buf = codec._as_bytes(gathered, "reduced chunks")
    chunks, off = [], 0
    for r in range(n):
        if off + 8 > buf.size:
            raise protocol.MismatchError(f"{where}: the reduced chunks' frames end after {r} of {n} ranks")
        size = int.from_bytes(buf[off: off + 8].tobytes(), "little")
        chunks.append(buf[off + 8: off + 8 + size])
        off += 8 + size
    return chunks
