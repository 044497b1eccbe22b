"""CUDA kernels: built wherever nvcc is, and byte-identical to the CPU kernels.

Two backends run the same checks:
- "gpu": the CUDA library on a CUDA device (skipped, and reported as skipped, where there is none);
- "emulated": kernels/qsgd_cuda.cu compiled as host C++ against tests/cuda_emu/cuda_runtime.h (lanes
  as threads, real shuffles and atomics), which checks the kernels' arithmetic, indexing, packing,
  reduction order and validation on any machine, but not the GPU's memory model or streams.
"""
import ctypes
import os
import re
import shutil

import numpy as np
import pytest

from types import SimpleNamespace

from hvd_qsgd import _native, codec, protocol, reduction
from tests import emulated_cuda
from tests.references import documented_sign_decode, error_feedback_steps, fold_order_bucket, l1_fold_order_bucket

torch = pytest.importorskip("torch")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_library_is_built_where_nvcc_is():
    assert _native.cuda_built(), "setup.py must build hvd_qsgd/_lib_cuda*.so when nvcc is present"


class GpuBackend:
    def __init__(self):
        from hvd_qsgd import cuda
        self.cuda = cuda

    def encode(self, x, **kw):
        return self.cuda.encode(torch.from_numpy(x).cuda(), **kw).cpu().numpy()

    def decode_sum(self, payloads, scale, out=None, accumulate=False):
        t_out = None if out is None else torch.from_numpy(out).cuda()
        y = self.cuda.decode_sum([torch.from_numpy(p).cuda() for p in payloads], scale=scale, out=t_out,
                                 accumulate=accumulate)
        if out is not None:
            out[:] = y.cpu().numpy()
            return out
        return y.cpu().numpy()


    def encode_ex(self, x, dtype, residual=None, valid=True, **kw):
        """x: float32/float16 array, or uint16 bit patterns of bfloat16 (dtype says which)."""
        t = torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16) if dtype == "bfloat16" else \
            torch.from_numpy(x).cuda()
        r = None if residual is None else torch.from_numpy(residual).cuda()
        p = self.cuda.encode(t, residual=r, residual_valid=valid, **kw)
        if residual is not None:
            residual[:] = r.cpu().numpy()
        return p.cpu().numpy()

    def encode_elias(self, x, **kw):
        return self.cuda.encode(torch.from_numpy(x).cuda(), coding="elias", **kw).cpu().numpy()

    def encode_chunks(self, x, n, **kw):
        buf, lens = self.cuda.encode_chunks(torch.from_numpy(x).cuda(), n, **kw)
        return buf.cpu().numpy(), lens

    def reduce_chunk(self, payloads, j, residual=None, **kw):
        r = None if residual is None else torch.from_numpy(residual).cuda()
        try:
            q = self.cuda.reduce_chunk([torch.from_numpy(p).cuda() for p in payloads], j, residual=r, **kw)
        finally:
            if residual is not None:
                residual[:] = r.cpu().numpy()
        return q.cpu().numpy()

    def decode_chunks(self, payloads, alpha, numel, bucket_size):
        return self.cuda.decode_chunks([torch.from_numpy(p).cuda() for p in payloads], alpha, numel,
                                       bucket_size).cpu().numpy()


class EmulatedBackend:
    """The CUDA library's C entry points, compiled for the host: 'device' pointers are host pointers."""

    def __init__(self, lib):
        self.lib = lib

    def encode(self, x, bits=4, bucket_size=512, norm="max", seed=0, fingerprint=0, checksum=True, encoder=2):
        cfg = codec.make_config(bits, bucket_size, norm, seed, "fixed", fingerprint, checksum, encoder=encoder)
        x = np.ascontiguousarray(x, dtype=np.float32)
        cap = codec.payload_nbytes(x.size, bits, bucket_size)
        out = np.zeros(cap + 8, np.uint8)[:cap]  # a 4-byte aligned buffer
        st = self.lib.qsgd_encode_cuda(x.ctypes.data, x.size, ctypes.byref(cfg), out.ctypes.data, cap, None)
        assert st == 0, _native.status_string(st)
        return out

    def decode_sum(self, payloads, scale, out=None, accumulate=False):
        heads = (_native.CHeader * len(payloads))()
        for i, p in enumerate(payloads):
            st = _native.load().qsgd_parse_header(p.ctypes.data, p.size, ctypes.byref(heads[i]))
            if st != 0:
                codec.raise_status(st, f"payload {i}", p)
        n = heads[0].numel
        if out is None:
            out = np.empty(n, np.float32)
        status = np.zeros(1, np.int32)
        ptrs = (ctypes.c_void_p * len(payloads))(*[p.ctypes.data for p in payloads])
        st = self.lib.qsgd_decode_sum_cuda(ptrs, heads, len(payloads), float(scale), out.ctypes.data, n,
                                           int(accumulate), status.ctypes.data, None, None)
        if st == 0:
            st = int(status[0])
        if st != 0:
            codec.raise_status(st, "decode_sum")
        return out

    @staticmethod
    def _heads(payloads):
        payloads = [np.array(p) for p in payloads]  # own, aligned buffers (as hvd_qsgd.cuda.aligned)
        heads = (_native.CHeader * len(payloads))()
        for i, p in enumerate(payloads):
            st = _native.load().qsgd_parse_header(p.ctypes.data, p.size, ctypes.byref(heads[i]))
            if st != 0:
                codec.raise_status(st, f"payload {i}", p)
        return payloads, heads, (ctypes.c_void_p * len(payloads))(*[p.ctypes.data for p in payloads])

    @staticmethod
    def _cfg(bits, bucket_size, norm="max", step_seed=0, fingerprint=0, checksum=True, encoder=2):
        cfg = codec.make_config(bits, bucket_size, norm, 0, "fixed", fingerprint, checksum, encoder=encoder)
        cfg.seed = step_seed
        return cfg

    def encode_ex(self, x, dtype, residual=None, valid=True, bits=4, bucket_size=512, norm="max", seed=0,
                  source_dtype=None, encoder=2):
        cfg = codec.make_config(bits, bucket_size, norm, seed, "fixed", 0, True, source_dtype or dtype, encoder=encoder)
        cap = codec.payload_nbytes(x.size, bits, bucket_size)
        out = np.zeros(cap + 8, np.uint8)[:cap]
        st = self.lib.qsgd_encode_ex_cuda(x.ctypes.data, {"float32": 0, "float16": 1, "bfloat16": 2}[dtype], x.size,
                                          ctypes.byref(cfg), None if residual is None else residual.ctypes.data,
                                          int(valid), out.ctypes.data, cap, None)
        assert st == 0, _native.status_string(st)
        return out

    def encode_elias(self, x, bits=4, bucket_size=512, norm="max", seed=0, fingerprint=0, checksum=True, encoder=2):
        cfg = codec.make_config(bits, bucket_size, norm, seed, "elias", fingerprint, checksum, encoder=encoder)
        x = np.ascontiguousarray(x, dtype=np.float32)
        cap = int(_native.load().qsgd_elias_max_nbytes(x.size, bits, bucket_size))
        out, out_len = np.zeros(cap + 8, np.uint8)[:cap], ctypes.c_uint64()
        st = self.lib.qsgd_encode_elias_cuda(x.ctypes.data, 0, x.size, ctypes.byref(cfg), out.ctypes.data, cap,
                                             ctypes.byref(out_len), None)
        assert st == 0, _native.status_string(st)
        return out[: out_len.value]

    def encode_chunks(self, x, n, **kw):
        cfg = self._cfg(**kw)
        total = _native.load().qsgd_chunks_max_nbytes(x.size, cfg.bits, cfg.bucket_size, 0, n)
        out = np.zeros(total + 8, np.uint8)[:total]
        lens = (ctypes.c_uint64 * n)()
        st = self.lib.qsgd_encode_chunks_cuda(x.ctypes.data, x.size, ctypes.byref(cfg), n, out.ctypes.data, total,
                                              lens, None)
        assert st == 0, _native.status_string(st)
        return out, [int(v) for v in lens]

    def reduce_chunk(self, payloads, j, residual=None, **kw):
        cfg = self._cfg(**kw)
        payloads, heads, ptrs = self._heads(payloads)
        n = heads[0].numel
        cap = codec.payload_nbytes(n, cfg.bits, cfg.bucket_size)
        out, scratch = np.zeros(cap + 8, np.uint8)[:cap], np.empty(n, np.float32)
        status, out_len = np.zeros(1, np.int32), ctypes.c_uint64()
        st = self.lib.qsgd_reduce_chunk_cuda(ptrs, heads, len(payloads), ctypes.byref(cfg), j, scratch.ctypes.data, n,
                                             out.ctypes.data, cap, ctypes.byref(out_len),
                                             None if residual is None else residual.ctypes.data,
                                             0 if residual is None else residual.size, status.ctypes.data, None, None)
        st = st or int(status[0])
        if st != 0:
            codec.raise_status(st, "reduce_chunk")
        return out[: out_len.value]

    def decode_chunks(self, payloads, alpha, numel, bucket_size):
        payloads, heads, ptrs = self._heads(payloads)
        out, status = np.empty(numel, np.float32), np.zeros(1, np.int32)
        st = self.lib.qsgd_decode_chunks_cuda(ptrs, heads, len(payloads), float(alpha), out.ctypes.data, numel,
                                              bucket_size, status.ctypes.data, None, None)
        st = st or int(status[0])
        if st != 0:
            codec.raise_status(st, "decode_chunks")
        return out


@pytest.fixture(scope="module")
def emulated_lib_path(tmp_path_factory):
    try:
        return emulated_cuda.build(tmp_path_factory.mktemp("cuda_emu"))
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def emulated_lib(emulated_lib_path):
    return emulated_cuda.load(emulated_lib_path)


@pytest.fixture(params=["gpu", "emulated"])
def backend(request):
    if request.param == "gpu":
        if _native.load_cuda() is None or not torch.cuda.is_available():
            if os.environ.get("HVD_QSGD_REQUIRE_GPU") == "1":  # make gpu-check: a skip would hide a broken build
                pytest.fail("HVD_QSGD_REQUIRE_GPU=1 but the CUDA library or device is not usable: "
                            f"built={_native.cuda_built()} torch.cuda={torch.cuda.is_available()}")
            pytest.skip("no CUDA device on this machine: CPU/CUDA byte identity on a GPU not checked here")
        return GpuBackend()
    return EmulatedBackend(request.getfixturevalue("emulated_lib"))


def _inputs(small):
    rng = np.random.default_rng(0)
    sizes = (0, 1, 7, 513, 3001) if small else (0, 1, 7, 513, 100_003)
    cases = []
    for n in sizes:
        x = (rng.standard_normal(n) * rng.choice([1e-30, 1e-3, 1, 1e30], size=n)).astype(np.float32)
        cases.append(x)
    x = rng.standard_normal(5000).astype(np.float32)
    x[17], x[1500], x[3000] = np.nan, np.inf, 1e-45
    x[4000:4600] = 1e-44
    cases.append(x)
    return cases


@pytest.mark.parametrize("encoder", [1, 2])
def test_encode_is_byte_identical_to_cpu(backend, encoder):
    emulated = isinstance(backend, EmulatedBackend)
    for bits in range(1, 9):
        for norm in ("max", "l2", "sign") if bits == 1 else ("max", "l2"):
            for bucket in (1, 7, 128, 512, 4096):
                for i, x in enumerate(_inputs(small=emulated)):
                    if emulated and bucket < 128 and x.size > 64:
                        x = x[:64]  # one warp per bucket, ~1 ms each emulated: 64 elements are 64 or 10
                        # buckets, the NaN at 17 among them (600 elements cost most of a minute)
                    kw = dict(bits=bits, bucket_size=bucket, norm=norm, seed=1234 + i, fingerprint=99, encoder=encoder)
                    cpu = codec.encode(x, **kw)
                    dev = backend.encode(x, **kw)
                    np.testing.assert_array_equal(dev, cpu, err_msg=f"bits={bits} norm={norm} bucket={bucket} case={i} "
                                                                    f"encoder={encoder}")


def test_fused_checksum_variant_is_byte_identical_to_cpu(tmp_path_factory):
    """The kernels built with QSGD_FUSED_CHECKSUM=1 (the fused encoder adds the checksum terms of the
    words whole in its buckets' data, checksum_kernel the rest; not the GPU build's default until it is
    measured on a GPU), emulated: the payloads of every bit width, buckets whose data are whole words
    (bucket_size * bits a multiple of 64) and not, even and odd bucket counts (data starting on a word
    or 4 bytes past one), a short last bucket, the held and re-reading paths, error feedback and
    float16 input, equal the CPU library's, checksums included (a term left out or counted twice
    changes the checksum)."""
    try:
        lib = emulated_cuda.load(emulated_cuda.build(tmp_path_factory.mktemp("cuda_emu_fused_ck"),
                                                     ("QSGD_FUSED_CHECKSUM=1",)))
    except RuntimeError as e:
        pytest.skip(str(e))
    dev = EmulatedBackend(lib)
    rng = np.random.default_rng(21)
    for bits in range(1, 9):
        for bucket, n in ((512, 512 * 6), (512, 512 * 5 + 100), (1024, 1024 * 3), (8, 8 * 9), (16, 16 * 7 + 8), (24, 24 * 5)):
            x = rng.standard_normal(n).astype(np.float32)
            kw = dict(bits=bits, bucket_size=bucket, seed=bits * 7 + n)
            np.testing.assert_array_equal(dev.encode(x, **kw), codec.encode(x, **kw), err_msg=f"{kw} n={n}")
    x = rng.standard_normal(512 * 7 + 64).astype(np.float32)
    for bits in (2, 4, 8):
        kw = dict(bits=bits, bucket_size=512, seed=5)
        r0 = (rng.standard_normal(x.size) * 0.01).astype(np.float32)
        want_q, want_r = error_feedback_steps(x, r0, True, **kw)
        r = r0.copy()
        np.testing.assert_array_equal(dev.encode_ex(x, "float32", residual=r, **kw), want_q,
                                      err_msg=f"error feedback, bits={bits}")
        np.testing.assert_array_equal(r.view(np.uint32), want_r.view(np.uint32), err_msg=f"residual, bits={bits}")
        half = _half_inputs("float16", x.size, rng)
        np.testing.assert_array_equal(dev.encode_ex(half, "float16", **kw),
                                      codec.encode(_as_fp32(half, "float16"), source_dtype="float16", **kw),
                                      err_msg=f"float16, bits={bits}")


def test_l2_scale_summation_order_matches_cpu(backend):
    """The bucket whose L2 scale exposes the order in which squares are summed (see
    tests/test_codec_format.py): the device must fold its 32 lanes exactly as the CPU does."""
    x = np.concatenate([fold_order_bucket(), -fold_order_bucket()[::-1]])
    cpu = codec.encode(x, bits=8, bucket_size=32, norm="l2")
    assert cpu[56:64].view(np.float32)[0] == np.float32(1) + np.finfo(np.float32).eps
    np.testing.assert_array_equal(backend.encode(x, bits=8, bucket_size=32, norm="l2"), cpu)


def test_sign_scale_summation_order_matches_cpu(backend):
    """The bucket whose sign-norm scale (mean |x|) exposes the order in which |x| is summed (see
    tests/test_codec_format.py): the device must use the CPU's lanes and fold."""
    x = np.concatenate([l1_fold_order_bucket(), -l1_fold_order_bucket()[::-1], l1_fold_order_bucket()[:20]])
    cpu = codec.encode(x, bits=1, bucket_size=32, norm="sign")
    assert cpu[56:60].view(np.float32)[0] == np.float32((1 + 2.0 ** -23) / 32)
    np.testing.assert_array_equal(backend.encode(x, bits=1, bucket_size=32, norm="sign"), cpu)


@pytest.mark.parametrize("bucket", [1, 32, 100, 512, 4096])
def test_sign_norm_signs_zeros_and_non_finite_buckets_match_cpu(backend, bucket):
    """-0, +0, zero buckets, NaN and Inf buckets, a short last bucket; any seed gives the same bytes."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal(5003).astype(np.float32)
    x[::7], x[3::11] = 0.0, -0.0
    x[1024:1536] = 0.0
    x[2100], x[3000], x[3001] = np.nan, np.inf, -np.inf
    x = x[:700] if isinstance(backend, EmulatedBackend) and bucket < 100 else x
    cpu = codec.encode(x, bits=1, bucket_size=bucket, norm="sign", seed=5)
    np.testing.assert_array_equal(backend.encode(x, bits=1, bucket_size=bucket, norm="sign", seed=77), cpu)
    np.testing.assert_array_equal(backend.decode_sum([cpu], 1.0), documented_sign_decode(x, bucket))


def test_decode_sum_is_bit_identical_to_cpu(backend):
    rng = np.random.default_rng(1)
    for bits in (1, 3, 4, 8):
        xs = [rng.standard_normal(20_001).astype(np.float32) for _ in range(5)]
        xs[2][100] = np.nan
        ps = [codec.encode(x, bits=bits, seed=k) for k, x in enumerate(xs)]
        if bits == 1:
            ps += [codec.encode(x, bits=1, seed=k, norm="sign") for k, x in enumerate(xs)]
        want = codec.decode_sum(ps[:5], scale=0.2)
        if bits == 1:
            np.testing.assert_array_equal(backend.decode_sum(ps[5:], 0.2), codec.decode_sum(ps[5:], scale=0.2))
        np.testing.assert_array_equal(backend.decode_sum(ps[:5], 0.2), want)
        out = np.full(20_001, 3.0, np.float32)
        backend.decode_sum(ps[:5], 0.2, out=out, accumulate=True)
        np.testing.assert_array_equal(out, np.float32(3.0) + want)


@pytest.mark.parametrize("corrupt,match", [
    (lambda p: p.__setitem__(200, p[200] ^ 4), "checksum"),
    (lambda p: p.__setitem__(-1, p[-1] | 0x80), "checksum"),
])
def test_decode_sum_detects_corruption_and_leaves_out_untouched(backend, corrupt, match):
    p = codec.encode(np.ones(1001, np.float32), bits=3)
    corrupt(p)
    out = np.full(1001, 5.0, np.float32)
    with pytest.raises(codec.PayloadError, match=match):
        backend.decode_sum([p], 1.0, out=out, accumulate=True)
    assert np.all(out == 5.0)


def test_decode_sum_checks_scales_and_padding_behind_the_checksum(backend):
    from tests.references import reseal as _reseal
    p = codec.encode(np.ones(1001, np.float32), bits=3)
    neg = p.copy()
    neg[56 + 3] |= 0x80
    with pytest.raises(codec.PayloadError, match="negative bucket scale"):
        backend.decode_sum([_reseal(neg)], 1.0)
    pad = p.copy()
    pad[-1] |= 0x80
    with pytest.raises(codec.PayloadError, match="padding"):
        backend.decode_sum([_reseal(pad)], 1.0)


# ---- the chunk steps of scatter_allgather ------------------------------------------------------------
# (bits, bucket, n ranks, numel): whole and short last buckets, bucket sizes that are and are not
# multiples of 8, chunk payloads of odd length (then the next chunk is encoded at an unaligned offset),
# and more ranks than buckets (empty chunks).
CHUNK_CASES = [(4, 512, 4, 3001, "max"), (2, 128, 3, 2000, "max"), (8, 100, 5, 1234, "max"),
               (3, 7, 3, 700, "max"), (1, 64, 4, 1000, "max"), (5, 512, 6, 1100, "max"),
               (1, 64, 3, 1000, "sign"), (4, 128, 3, 2000, "l2")]  # the sign norm: BlockSign's two-way steps


def _settings(bits, bucket, norm="max"):
    return SimpleNamespace(bits=bits, bucket_size=bucket, norm=norm, coding="fixed", checksum=True, encoder=2)


@pytest.mark.parametrize("bits,bucket,n,numel,norm", CHUNK_CASES)
def test_chunk_steps_are_identical_to_cpu(backend, bits, bucket, n, numel, norm):
    """scatter_allgather on n simulated ranks: every rank's chunk payloads, every reduced chunk (plain
    and with server error feedback, residual included) and the decoded result equal the CPU library's."""
    rng = np.random.default_rng(bits * 1000 + n)
    xs = [rng.standard_normal(numel).astype(np.float32) for _ in range(n)]
    xs[1][5] = np.nan  # one bucket's reduced value is NaN: error feedback keeps its residual there
    s, seeds = _settings(bits, bucket, norm), [1000 + r for r in range(n)]
    kw = dict(bits=bits, bucket_size=bucket, norm=norm)
    bufs = []
    for r in range(n):
        want, want_lens = reduction.encode_chunks(xs[r], s, seeds[r], n, fingerprint=7)
        got, lens = backend.encode_chunks(xs[r], n, step_seed=seeds[r], fingerprint=7, **kw)
        assert lens == want_lens
        np.testing.assert_array_equal(got, want, err_msg=f"rank {r}'s chunk payloads")
        bufs.append(reduction.split_by(want, want_lens))
    reduced, changed = [], 0
    for j in range(n):
        payloads = [bufs[r][j] for r in range(n)]
        want = reduction.reduce_chunk(payloads, j, s, seeds[j], fingerprint=7)
        np.testing.assert_array_equal(backend.reduce_chunk(payloads, j, step_seed=seeds[j], fingerprint=7, **kw),
                                      want, err_msg=f"reduced chunk {j}")
        reduced.append(want)
        size = codec.read_header(want).numel
        r_cpu = (rng.standard_normal(size) * 1e-2).astype(np.float32)
        r_dev = r_cpu.copy()
        before = r_cpu.copy()
        want_ef = reduction.reduce_chunk(payloads, j, s, seeds[j], fingerprint=7, residual=r_cpu)
        got_ef = backend.reduce_chunk(payloads, j, residual=r_dev, step_seed=seeds[j], fingerprint=7, **kw)
        np.testing.assert_array_equal(got_ef, want_ef, err_msg=f"reduced chunk {j} with feedback")
        np.testing.assert_array_equal(r_dev.view(np.uint32), r_cpu.view(np.uint32), err_msg=f"residual of chunk {j}")
        changed += int(np.count_nonzero(r_cpu != before))
    assert changed > 0, "error feedback never changed a residual: the comparison above proves nothing"
    want = reduction.decode_chunks(reduced, 0.25, numel, bucket)
    np.testing.assert_array_equal(backend.decode_chunks(reduced, 0.25, numel, bucket), want)


def test_reduce_chunk_fails_on_a_corrupt_payload_and_keeps_the_residual(backend):
    s = _settings(4, 128)
    bufs = [reduction.split_by(*reduction.encode_chunks(np.ones(1000, np.float32), s, r, 2)) for r in range(2)]
    payloads = [bufs[0][1], bufs[1][1].copy()]
    payloads[1][100] ^= 1
    residual = np.full(codec.read_header(payloads[0]).numel, 0.5, np.float32)
    with pytest.raises(codec.PayloadError, match="checksum"):
        backend.reduce_chunk(payloads, 1, residual=residual, bits=4, bucket_size=128, step_seed=3)
    assert np.all(residual == 0.5)


@pytest.fixture(params=["gpu", "emulated"])
def device(request):
    """Where the tests of the PyTorch-side backends (``hvd_qsgd.cuda``'s wrappers and
    ``backends.CudaBackend``) run: a CUDA device, or ("emulated") host tensors standing for device
    tensors, with the wrappers pointed at the emulated library (``emulated_cuda.on_host``)."""
    if request.param == "emulated":
        with emulated_cuda.on_host(request.getfixturevalue("emulated_lib")):
            yield torch.device("cpu")
        return
    if _native.load_cuda() is None or not torch.cuda.is_available():
        if os.environ.get("HVD_QSGD_REQUIRE_GPU") == "1":
            pytest.fail("HVD_QSGD_REQUIRE_GPU=1 but the CUDA library or device is not usable")
        pytest.skip("no CUDA device on this machine: the CUDA backend's reduction not checked here")
    yield torch.device("cuda")


@pytest.mark.parametrize("bits,bucket,n,numel", [(4, 512, 4, 100_000), (3, 7, 3, 5001), (2, 128, 16, 40_000)])
def test_cuda_backend_runs_scatter_allgather_bit_identical_to_the_cpu_backend(device, bits, bucket, n, numel):
    """The adapter's steps of one scatter_allgather exchange (backends.CudaBackend on CUDA tensors
    against backends.CpuBackend on arrays, n simulated ranks): chunk payloads, phase-2 frames, the
    decoded result, and error feedback's own dequantized chunks, all equal; a corrupt payload empties
    the frame on the device as on the host."""
    from hvd_qsgd import backends
    cpu, gpu = backends.CPU, backends.CUDA
    s = SimpleNamespace(bits=bits, bucket_size=bucket, norm="max", coding="fixed", checksum=True,
                        server_error_feedback=False, encoder=2)
    assert gpu.missing(s, "scatter_allgather") is None
    expect = SimpleNamespace(bits=bits, bucket_size=bucket, norm="max", coding="fixed", numel=numel,
                             dtype="float32", fingerprint=11)
    rng = np.random.default_rng(bits + n)
    xs = [rng.standard_normal(numel).astype(np.float32) for _ in range(n)]
    host, dev = [], []
    for r in range(n):
        hb, hl = cpu.encode_chunks(xs[r], s, 500 + r, n, 11, "float32", "t")
        db, dl = gpu.encode_chunks(torch.from_numpy(xs[r]).to(device), s, 500 + r, n, 11, "float32", "t")
        assert dl == hl
        np.testing.assert_array_equal(db.cpu().numpy(), hb)
        np.testing.assert_array_equal(gpu.decode_chunks(gpu.split_by(db, dl), 1.0, numel, bucket, "t").cpu().numpy(),
                                      cpu.decode_chunks(cpu.split_by(hb, hl), 1.0, numel, bucket, "t"))
        host.append(cpu.split_by(hb, hl))
        dev.append(gpu.split_by(db, dl))
    frames_h, frames_d, received = [], [], []
    for j in range(n):  # what rank j's alltoall receives: every rank's payload of chunk j
        splits = [int(host[r][j].size) for r in range(n)]
        received_h = np.concatenate([host[r][j] for r in range(n)])
        received_d = torch.cat([dev[r][j] for r in range(n)])
        received.append((splits, received_h, received_d))
        fh, eh = cpu.reduce_received(received_h, splits, j, s, 500 + j, expect, "t")
        fd, ed = gpu.reduce_received(received_d, splits, j, s, 500 + j, expect, "t")
        assert eh is None and ed is None
        np.testing.assert_array_equal(fd.cpu().numpy(), fh)
        frames_h.append(fh)
        frames_d.append(fd)
    chunks = reduction.unframe(np.concatenate(frames_h), n, "t")
    want = cpu.decode_chunks(chunks, 1.0 / n, numel, bucket, "t")
    got = gpu.decode_chunks([torch.from_numpy(c).to(device) for c in chunks], 1.0 / n, numel, bucket, "t")
    np.testing.assert_array_equal(got.cpu().numpy(), want)
    # server error feedback: the reducing rank's residual (an array on the host, a float32 tensor on
    # the device) over two steps; the frames and the residuals equal bit for bit
    s_ef = SimpleNamespace(**{**vars(s), "server_error_feedback": True})
    assert gpu.missing(s_ef, "scatter_allgather") is None
    ranges, changed = reduction.chunk_ranges(numel, bucket, n), 0
    for j, (splits, received_h, received_d) in enumerate(received):
        r_h = np.zeros(ranges[j][1] - ranges[j][0], np.float32)
        r_d = torch.zeros(r_h.size, dtype=torch.float32, device=device)
        for step in range(2):
            fh, eh = cpu.reduce_received(received_h, splits, j, s_ef, 700 + step, expect, "t",
                                         server_residual=lambda: r_h)
            fd, ed = gpu.reduce_received(received_d, splits, j, s_ef, 700 + step, expect, "t",
                                         server_residual=lambda: r_d)
            assert eh is None and ed is None, (eh, ed)
            np.testing.assert_array_equal(fd.cpu().numpy(), fh, err_msg=f"chunk {j}, step {step}")
            np.testing.assert_array_equal(r_d.cpu().numpy().view(np.uint32), r_h.view(np.uint32))
        changed += int(np.count_nonzero(r_h))
    assert changed > 0, "server error feedback never changed a residual: the comparison proves nothing"
    # a corrupt payload: an empty frame and the error, on the device as on the host; the server
    # residual is left as it was
    splits = [int(host[r][0].size) for r in range(n)]
    bad = np.concatenate([host[r][0] for r in range(n)])
    bad[splits[0] + 70] ^= 1
    fh, eh = cpu.reduce_received(bad, splits, 0, s, 500, expect, "t")
    fd, ed = gpu.reduce_received(torch.from_numpy(bad).to(device), splits, 0, s, 500, expect, "t")
    assert fh.size == 8 and fd.numel() == 8 and type(ed) is type(eh), (eh, ed)
    r_d = torch.full((ranges[0][1] - ranges[0][0],), 0.5, dtype=torch.float32, device=device)
    fd, ed = gpu.reduce_received(torch.from_numpy(bad).to(device), splits, 0, s_ef, 500, expect, "t",
                                 server_residual=lambda: r_d)
    assert fd.numel() == 8 and type(ed) is type(eh) and bool(torch.all(r_d == 0.5)), ed


# ---- half-precision input and error feedback fused into the encoder ------------------------------------
def _as_fp32(x, dtype):
    """What the encoder reads x as: float16 exactly converted, bfloat16 given as its uint16 bits."""
    if dtype == "bfloat16":
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32)


def _half_inputs(dtype, n, rng):
    x = (rng.standard_normal(n) * rng.choice([1e-6, 1e-2, 1, 300], size=n)).astype(np.float32)
    x[::97] = 0.0
    x[5::101] = -0.0
    if dtype == "float16":
        h = x.astype(np.float16)
        if n > 1000:
            h[7] = np.float16(6e-8)  # a subnormal
            h[n // 2] = np.inf
        return h
    if dtype == "bfloat16":
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    return x


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("bucket", [512, 100, 8])
def test_half_precision_input_is_read_natively_and_encodes_as_its_fp32_value(backend, dtype, bucket):
    rng = np.random.default_rng(21)
    for n in (0, 1, 9, 4099):
        x = _half_inputs(dtype, n, rng)
        for bits, norm in ((4, "max"), (8, "l2"), (1, "sign"), (3, "max")):
            want = codec.encode(_as_fp32(x, dtype), bits=bits, bucket_size=bucket, norm=norm, seed=n,
                                source_dtype=dtype)
            got = backend.encode_ex(x, dtype, bits=bits, bucket_size=bucket, norm=norm, seed=n)
            np.testing.assert_array_equal(got, want, err_msg=f"{dtype} n={n} bits={bits} {norm}")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("bucket", [512, 100])
@pytest.mark.parametrize("encoder", [1, 2])
def test_error_feedback_fused_into_encode_equals_the_unfused_steps(backend, dtype, bucket, encoder):
    rng = np.random.default_rng(8)
    n = 5003
    x = _half_inputs(dtype, n, rng)
    x32 = _as_fp32(x, dtype)
    if dtype == "float32":
        x[200], x[3000] = np.nan, np.inf  # their buckets decode non-finite: the residual keeps its value there
        x32 = x
    for valid in (True, False):
        for bits, norm in ((4, "max"), (2, "l2"), (8, "max"), (1, "sign")):
            kw = dict(bits=bits, bucket_size=bucket, norm=norm, seed=3, encoder=encoder)
            r0 = (rng.standard_normal(n) * 1e-2).astype(np.float32)
            r0[::50] = -0.0
            want_q, want_r = error_feedback_steps(x32, r0, valid, source_dtype=dtype, **kw)
            r = r0.copy() if valid else np.full(n, 7.0, np.float32)  # not valid: never read
            got_q = backend.encode_ex(x, dtype, residual=r, valid=valid, **kw)
            where = f"{dtype} bits={bits} {norm} valid={valid} encoder={encoder}"
            np.testing.assert_array_equal(got_q, want_q, err_msg=where)
            np.testing.assert_array_equal(r.view(np.uint32), want_r.view(np.uint32), err_msg=where)
            assert np.any(want_r != r0), "the residual never changed: the comparison proves nothing"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cuda_backend_encodes_half_precision_and_fuses_error_feedback_as_the_cpu_backend(device, dtype):
    """backends.CudaBackend.encode on a CUDA tensor of its own dtype, with and without a residual,
    against backends.CpuBackend.encode on its fp32 value: payloads and residuals bit for bit."""
    from hvd_qsgd import backends
    from hvd_qsgd.settings import Settings
    rng = np.random.default_rng(5)
    x = _half_inputs(dtype, 300_001 if device.type == "cuda" else 40_001, rng)  # the emulation's lanes are threads
    x32 = _as_fp32(x, dtype)
    t = (torch.from_numpy(x.view(np.int16)).to(device).view(torch.bfloat16) if dtype == "bfloat16"
         else torch.from_numpy(x).to(device))
    for bucket in (512, 100):
        s = Settings.make(bits=4, bucket_size=bucket, error_feedback=True)
        np.testing.assert_array_equal(backends.CUDA.encode(t, s, 9, 3, dtype, "t").cpu().numpy(),
                                      backends.CPU.encode(x32, s, 9, 3, dtype, "t"))
        r_cpu = (rng.standard_normal(x.size) * 1e-3).astype(np.float32)
        r_dev = torch.from_numpy(r_cpu.copy()).to(device)  # its own memory (emulated: a host tensor)
        for step in range(3):  # a new residual, then two steps that read and rewrite it
            q_cpu = backends.CPU.encode(x32, s, step, 3, dtype, "t", residual=r_cpu, residual_valid=step > 0)
            q_dev = backends.CUDA.encode(t, s, step, 3, dtype, "t", residual=r_dev, residual_valid=step > 0)
            np.testing.assert_array_equal(q_dev.cpu().numpy(), q_cpu)
            np.testing.assert_array_equal(r_dev.cpu().numpy().view(np.uint32), r_cpu.view(np.uint32))


# ---- the Elias coding ------------------------------------------------------------------------------------
@pytest.mark.parametrize("encoder", [1, 2])
def test_elias_encode_and_decode_sum_are_identical_to_cpu(backend, encoder):
    """Elias payloads byte for byte (scales, segment table, streams, checksum) and their decode-sums
    bit for bit: widths 2-8, max and L2 norms, bucket sizes giving many, one and partial segments
    (and one bucket per segment above 32768), sparse and dense levels, NaN/Inf buckets, empty tensors."""
    emulated = isinstance(backend, EmulatedBackend)
    rng = np.random.default_rng(17)
    cases = []
    for n in (0, 1, 7, 513, 3001):
        cases.append((rng.standard_normal(n) * rng.choice([1e-30, 1e-3, 1, 1e30], size=n)).astype(np.float32))
    x = rng.standard_normal(5000).astype(np.float32)
    x[17], x[1500], x[3000] = np.nan, np.inf, 1e-45
    x[2000:2600] = 0.0
    cases.append(x)
    if not emulated:
        cases.append(rng.standard_normal(300_001).astype(np.float32))
    for bits in (2, 3, 4, 8):
        for norm in ("max", "l2"):
            for bucket in (7, 128, 512, 40_000):
                payloads = []
                for i, x in enumerate(cases):
                    kw = dict(bits=bits, bucket_size=bucket, norm=norm, seed=50 + i, fingerprint=3, encoder=encoder)
                    want = codec.encode(x, coding="elias", **kw)
                    got = backend.encode_elias(x, **kw)
                    np.testing.assert_array_equal(got, want, err_msg=f"bits={bits} {norm} bucket={bucket} case={i}")
                    payloads.append(want)
                x = cases[-1]
                ps = [codec.encode(x * (k + 1), bits=bits, bucket_size=bucket, norm=norm, seed=k, coding="elias")
                      for k in range(3)]
                want = codec.decode_sum(ps, scale=0.5)
                np.testing.assert_array_equal(backend.decode_sum(ps, 0.5), want)
                out = np.full(x.size, 2.0, np.float32)
                backend.decode_sum(ps, 0.5, out=out, accumulate=True)
                np.testing.assert_array_equal(out, np.float32(2.0) + want)


def test_elias_decode_detects_corruption_and_leaves_out_untouched(backend):
    from tests.references import reseal
    x = np.random.default_rng(2).standard_normal(3000).astype(np.float32)
    p = codec.encode(x, bits=4, bucket_size=128, coding="elias")
    h = codec.read_header(p)
    nb = -(-3000 // 128)
    table = 56 + 4 * nb
    flipped = p.copy()
    flipped[table + 40] ^= 1
    cases = [(flipped, "checksum")]
    bad_table = p.copy()
    bad_table[table: table + 8] = np.frombuffer((10 ** 9).to_bytes(8, "little"), np.uint8)
    cases.append((reseal(bad_table), "Elias stream"))
    stream = p.copy()
    stream[table + 8 + 3] ^= 0xFF
    cases.append((reseal(stream), "Elias stream|padding"))
    assert h.coding == "elias"
    for bad, match in cases:
        out = np.full(3000, 5.0, np.float32)
        with pytest.raises(codec.PayloadError, match=match):
            backend.decode_sum([bad], 1.0, out=out, accumulate=True)
        assert np.all(out == 5.0)


@pytest.mark.parametrize("coding", ["fixed", "elias"])
def test_cuda_backend_reads_a_gathered_results_headers_from_the_device_once(device, coding, monkeypatch):
    """backends.CudaBackend.decode_gathered (3 simulated ranks' payloads back to back, as an allgather
    returns them) gives the CPU backend's result and lengths bit for bit, and brings the payloads'
    headers to the host once for the Elias coding, for their checks and the decode alike (it did
    twice, and read the coding byte a third time), and never for the fixed coding (the device checks
    them: the next test), whose payloads of an odd length are aligned for the kernels by one copy of
    the result, not one per payload; nor does the reduce step of scatter_allgather. A rank whose
    tensor has another size is named by the field that differs, as on the CPU backend."""
    from hvd_qsgd import backends, cuda
    reads = []
    monkeypatch.setattr(cuda, "device_headers",
                        lambda payloads, where, real=cuda.device_headers: reads.append(len(payloads)) or
                        real(payloads, where))
    s = SimpleNamespace(bits=4, bucket_size=512, norm="max", coding=coding, checksum=True, encoder=2,
                        server_error_feedback=False)
    expect = SimpleNamespace(bits=4, bucket_size=512, norm="max", coding=coding, numel=30_001, dtype="float32",
                             fingerprint=5)
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(30_001).astype(np.float32) for _ in range(3)]
    xs[2][::2] = 0.0   # (a sparser rank: an Elias payload of another length)
    host = [backends.CPU.encode(x, s, 40 + r, 5, "float32", "t") for r, x in enumerate(xs)]
    dev = [backends.CUDA.encode(torch.from_numpy(x).to(device), s, 40 + r, 5, "float32", "t") for r, x in enumerate(xs)]
    want, want_lens = backends.CPU.decode_gathered(np.concatenate(host), 3, host[0].size, 1 / 3, expect, "t")
    copies = []
    for name in ("clone", "copy_"):
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, real=getattr(torch.Tensor, name), **k:
                            copies.append(name) or real(self, *a, **k))
    got, lens = backends.CUDA.decode_gathered(torch.cat(dev), 3, dev[0].numel(), 1 / 3, expect, "t")
    monkeypatch.undo()
    np.testing.assert_array_equal(got.cpu().numpy(), want)
    assert lens == want_lens and reads == ([3] if coding == "elias" else [])
    if coding == "fixed":
        assert dev[0].numel() % 4 and copies == ["copy_"]   # (the payloads of an odd length: one copy)
    monkeypatch.setattr(cuda, "device_headers", lambda payloads, where, real=cuda.device_headers:
                        reads.append(len(payloads)) or real(payloads, where))

    if coding == "fixed":  # the reduce step: the chunk payloads' headers once
        reads.clear()
        chunks = [backends.CUDA.encode_chunks(torch.from_numpy(x).to(device), s, 40 + r, 3, 5, "float32", "t")
                  for r, x in enumerate(xs)]
        splits = [int(c[1][1]) for c in chunks]
        received = torch.cat([backends.CUDA.split_by(*c)[1] for c in chunks])
        frame, error = backends.CUDA.reduce_received(received, splits, 1, s, 41, expect, "t")
        assert error is None and frame.numel() > 8 and reads == []

    short = backends.CPU.encode(xs[1][:20_000], s, 41, 5, "float32", "t")
    with pytest.raises(Exception) as on_host:
        backends.CPU.decode_gathered(np.concatenate([host[0], short, host[2]]), 3, host[0].size, 1.0, expect, "t")
    short_dev = torch.from_numpy(short).to(device)
    with pytest.raises(type(on_host.value), match="numel") as on_device:
        backends.CUDA.decode_gathered(torch.cat([dev[0], short_dev, dev[2]]), 3, dev[0].numel(), 1.0, expect, "t")
    assert str(on_device.value) == str(on_host.value)


@pytest.mark.parametrize("change", ["fingerprint", "norm", "magic", "reserved", "length", "checksum off",
                                    "corrupt data"])
def test_a_fixed_coding_decode_checks_the_headers_on_the_device_and_names_what_differs(device, change, monkeypatch):
    """backends.CudaBackend.decode_gathered of fixed-coding payloads (3 simulated ranks) reads nothing
    from the device within ``deferred_verdicts``: the device checks every header against the
    expectation with the checksums. A rank's payload that differs (another fingerprint or norm, a
    broken magic, a reserved byte set, another declared length, corrupt data) fails at ``settle``
    with the very error the host's own check raises (the CPU backend's for a field that differs,
    naming every rank's value; the header parse's, naming the payload; the checksum's), and outside
    the scope in the call; a payload without a checksum (its own flags) decodes as on the CPU."""
    import collections
    from hvd_qsgd import backends, cuda
    s = SimpleNamespace(bits=4, bucket_size=128, norm="max", coding="fixed", checksum=True, encoder=2,
                        server_error_feedback=False)
    expect = SimpleNamespace(bits=4, bucket_size=128, norm="max", coding="fixed", numel=3001, dtype="float32",
                             fingerprint=5)
    xs = [np.random.default_rng(r).standard_normal(3001).astype(np.float32) for r in range(3)]
    host = [backends.CPU.encode(x, s, 40 + r, 5, "float32", "t") for r, x in enumerate(xs)]
    other = {"fingerprint": (s, 6), "norm": (SimpleNamespace(**{**vars(s), "norm": "l2"}), 5),
             "checksum off": (SimpleNamespace(**{**vars(s), "checksum": False}), 5)}.get(change)
    if other is not None:
        host[1] = backends.CPU.encode(xs[1], other[0], 41, other[1], "float32", "t")
    else:
        host[1] = host[1].copy()
        at = {"magic": 0, "reserved": 10, "length": 24, "corrupt data": -1}[change]
        host[1][at] ^= 1
    if change == "corrupt data":
        expected = pytest.raises(codec.PayloadError, match="^t: .*checksum")
    elif change in ("magic", "reserved", "length"):   # the header's parse on the host names the payload
        with pytest.raises(codec.PayloadError) as parse:
            cuda.read_headers([torch.from_numpy(h).to(device) for h in host], "t")
        assert "payload 1 of 3" in str(parse.value)
        expected = pytest.raises(codec.PayloadError, match="^" + re.escape(str(parse.value)) + "$")
    elif change == "checksum off":
        expected = None
    else:   # the CPU backend's check names the field and every rank's value
        with pytest.raises(protocol.MismatchError, match=change) as on_host:
            backends.CPU.decode_gathered(np.concatenate(host), 3, host[0].size, 1.0, expect, "t")
        expected = pytest.raises(protocol.MismatchError, match="^" + re.escape(str(on_host.value)) + "$")
    gathered = torch.from_numpy(np.concatenate(host)).to(device)
    reads = []
    monkeypatch.setattr(torch.Tensor, "item", lambda self, real=torch.Tensor.item: reads.append(1) or real(self))
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, real=torch.Tensor.cpu: reads.append(2) or real(self))
    pending = collections.deque()
    with cuda.deferred_verdicts(pending):
        got, lens = backends.CUDA.decode_gathered(gathered, 3, host[0].size, 1.0, expect, "t")
    assert reads == [] and len(pending) == 1 and lens == [h.size for h in host]
    if expected is None:
        cuda.settle(pending)
        np.testing.assert_array_equal(got.cpu().numpy(), codec.decode_sum(host, 1.0))
        return
    with expected:
        cuda.settle(pending)
    with expected:
        backends.CUDA.decode_gathered(gathered, 3, host[0].size, 1.0, expect, "t")


@pytest.mark.parametrize("change", ["fingerprint", "magic"])
def test_the_chunk_steps_check_the_headers_on_the_device_and_name_what_differs(device, change, monkeypatch):
    """scatter_allgather's steps on the device (3 simulated ranks, fixed coding) read no header on the
    host either: the reduce step of chunk 1, where rank 1's payload has another fingerprint (or a
    broken magic), empties its frame with the error the host's check gives (the CPU backend's reduce
    step's; the device backend's read of the headers, for the magic); the phase-2
    decode of a chunk whose header is broken raises at ``settle`` what the host's parse raises,
    and nothing is read before."""
    import collections
    from hvd_qsgd import backends, cuda
    s = SimpleNamespace(bits=4, bucket_size=128, norm="max", coding="fixed", checksum=True, encoder=2,
                        server_error_feedback=False)
    expect = SimpleNamespace(bits=4, bucket_size=128, norm="max", coding="fixed", numel=3001, dtype="float32",
                             fingerprint=5)
    xs = [np.random.default_rng(r).standard_normal(3001).astype(np.float32) for r in range(3)]
    host = [backends.CPU.encode_chunks(x, s, 9 + r, 3, 6 if change == "fingerprint" and r == 1 else 5, "float32",
                                       "t") for r, x in enumerate(xs)]
    parts = [backends.CPU.split_by(*c)[1].copy() for c in host]   # chunk 1 of each rank
    if change == "magic":
        parts[1][0] ^= 1
    splits = [p.size for p in parts]
    _, on_host = backends.CPU.reduce_received(np.concatenate(parts), splits, 1, s, 41, expect, "t")
    if change == "magic":   # (named as the device backend's own read of the headers names it)
        with pytest.raises(codec.PayloadError) as read:
            cuda.read_headers([torch.from_numpy(p).to(device) for p in parts], "t: chunk 1")
        on_host = read.value
    reads = []
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, real=torch.Tensor.cpu: reads.append(1) or real(self))
    frame, on_device = backends.CUDA.reduce_received(torch.from_numpy(np.concatenate(parts)).to(device), splits, 1, s,
                                                     41, expect, "t")
    assert type(on_device) is type(on_host) and str(on_device) == str(on_host) and frame.numel() == 8
    assert reads == [1]   # (the verdict, read in the call: this result goes on to the other ranks)

    host = [backends.CPU.encode_chunks(x, s, 9 + r, 3, 5, "float32", "t") for r, x in enumerate(xs)]
    good = [backends.CPU.reduce_chunk([backends.CPU.split_by(*c)[j] for c in host], j, s, 41 + j, 5, "float32", "t")
            for j in range(3)]
    good[2] = good[2].copy()
    good[2][0] ^= 1   # a reduced chunk whose header is broken
    with pytest.raises(codec.PayloadError) as parse:
        cuda.read_headers([torch.from_numpy(g).to(device) for g in good], "t: reduced chunks")
    reads.clear()
    pending = collections.deque()
    with cuda.deferred_verdicts(pending):
        backends.CUDA.decode_chunks([torch.from_numpy(g).to(device) for g in good], 1.0, 3001, 128, "t: reduced chunks",
                                    expect=expect)
    assert reads == [] and len(pending) == 1
    with pytest.raises(codec.PayloadError, match="^" + re.escape(str(parse.value)) + "$"):
        cuda.settle(pending)


def test_cuda_backend_cuts_the_reduced_chunks_on_the_device(device, monkeypatch):
    """The phase-2 frames of scatter_allgather (3 simulated ranks, fixed coding) are cut on the device
    at the lengths the coding fixes, without a trip through the host, into the chunks the host path
    cuts; a rank's empty frame (it could not reduce its chunk) sends the cut through the host path,
    which finds it empty."""
    from hvd_qsgd import backends
    s = SimpleNamespace(bits=4, bucket_size=128, norm="max", coding="fixed", checksum=True, encoder=2,
                        server_error_feedback=False)
    numel, n = 1000, 3
    expect = SimpleNamespace(bits=4, bucket_size=128, norm="max", coding="fixed", numel=numel, dtype="float32",
                             fingerprint=2)
    xs = [np.random.default_rng(r).standard_normal(numel).astype(np.float32) for r in range(n)]
    chunks = [backends.CUDA.split_by(*backends.CUDA.encode_chunks(torch.from_numpy(x).to(device), s, 9 + r, n, 2,
                                                                  "float32", "t")) for r, x in enumerate(xs)]
    frames = []
    for j in range(n):
        splits = [int(c[j].numel()) for c in chunks]
        frame, error = backends.CUDA.reduce_received(torch.cat([c[j] for c in chunks]), splits, j, s, 9 + j,
                                                     expect, "t")
        assert error is None
        frames.append(frame)
    gathered = torch.cat(frames)
    want = [c.cpu().numpy() for c in backends.CUDA.unframe(gathered, n, "t")]   # through the host
    trips = []
    monkeypatch.setattr(backends.CudaBackend, "host", lambda self, x: trips.append(x.numel()) or x.cpu().numpy())
    got = backends.CUDA.unframe(gathered, n, "t", expect)
    assert trips == [] and [c.device for c in got] == [device] * n
    assert [c.cpu().numpy().tobytes() for c in got] == [w.tobytes() for w in want]

    failed = torch.cat([frames[0], torch.zeros(8, dtype=torch.uint8, device=device), frames[2]])
    cut = backends.CUDA.unframe(failed, n, "t", expect)
    assert trips == [failed.numel()] and [c.numel() for c in cut] == [want[0].size, 0, want[2].size]


def test_deferred_verdicts_are_read_together_and_name_the_failing_payload(device, monkeypatch):
    """Within ``cuda.deferred_verdicts``, decode_sum and decode_chunks do not wait for the device's
    verdict (no read of their status); ``settle`` reads them all at once and raises the first failure,
    naming its payloads; outside the scope a corrupt payload raises in its call, as before."""
    import collections
    from hvd_qsgd import cuda
    x = torch.from_numpy(np.random.default_rng(3).standard_normal(5000).astype(np.float32)).to(device)
    good = cuda.encode(x, bits=4, bucket_size=128, seed=1)
    bad = good.clone()
    bad[-1] ^= 1   # the last packed byte: only the device's checksum sees it
    buf, lens = cuda.encode_chunks(x, 2, bits=4, bucket_size=128, step_seed=2)
    chunks = list(buf.split(lens))
    reads = []
    monkeypatch.setattr(torch.Tensor, "item", lambda self, real=torch.Tensor.item: reads.append(1) or real(self))
    pending = collections.deque()
    with cuda.deferred_verdicts(pending):
        ok = cuda.decode_sum([good], where="good")
        cuda.decode_sum([bad], where="bad")   # no error yet: its verdict is kept
        cuda.decode_chunks(chunks, 1.0, 5000, 128, where="chunks")
    assert reads == [] and len(pending) == 3
    with pytest.raises(codec.PayloadError, match="^bad: .*checksum"):
        cuda.settle(pending)
    assert not pending
    np.testing.assert_array_equal(ok.cpu().numpy(), codec.decode_sum([good.cpu().numpy()], 1.0))
    with pytest.raises(codec.PayloadError, match="^bad: .*checksum"):
        cuda.decode_sum([bad], where="bad")


def test_cuda_backend_runs_an_elias_allgather_exchange_as_the_cpu_backend(device):
    """backends.CudaBackend with the Elias coding: encode with error feedback (three steps), the split
    of gathered payloads of different lengths, and their decode-sum, against backends.CpuBackend
    (the backend's methods called directly: ``missing`` keeps Elias off the GPU until this passes)."""
    from hvd_qsgd import backends
    from hvd_qsgd.settings import Settings
    s = Settings.make(bits=4, bucket_size=512, coding="elias", error_feedback=True)
    rng = np.random.default_rng(4)
    xs = [(rng.standard_normal(100_003) * (r + 1)).astype(np.float32) for r in range(3)]
    xs[1][::3] = 0.0  # a sparser rank: its payload is shorter
    r_cpu = [np.zeros(x.size, np.float32) for x in xs]
    r_dev = [torch.zeros(x.size, device=device) for x in xs]
    for step in range(3):
        host, dev = [], []
        for r, x in enumerate(xs):
            qh = backends.CPU.encode(x, s, 10 * step + r, 1, "float32", "t", residual=r_cpu[r], residual_valid=step > 0)
            qd = backends.CUDA.encode(torch.from_numpy(x).to(device), s, 10 * step + r, 1, "float32", "t",
                                      residual=r_dev[r], residual_valid=step > 0)
            np.testing.assert_array_equal(qd.cpu().numpy(), qh)
            np.testing.assert_array_equal(r_dev[r].cpu().numpy().view(np.uint32), r_cpu[r].view(np.uint32))
            host.append(qh)
            dev.append(qd)
        assert len({q.size for q in host}) > 1
        gathered = torch.cat(dev)
        parts = backends.CUDA.split(gathered, 3, dev[0].numel(), "t")
        assert [p.numel() for p in parts] == [q.size for q in host]
        np.testing.assert_array_equal(backends.CUDA.decode_sum(parts, 1 / 3, "t").cpu().numpy(),
                                      backends.CPU.decode_sum(host, 1 / 3, "t"))


# ---- the PyTorch adapter's device path, multi-rank, on the emulated library --------------------------
def test_adapter_device_path_emulated_equals_its_host_path_under_horovodrun(emulated_lib_path):
    """hvd_qsgd.torch.QSGD under horovodrun (3 Gloo ranks: uneven chunks), three steps of two tensors
    per configuration, once on the host path and once on the device path with the CUDA library
    emulated (host tensors standing for CUDA tensors): allgather and scatter_allgather, worker error
    feedback fused into the encoder, server error feedback with its residual kept as a device tensor,
    BlockSign's two-way steps, float16 and bfloat16 read natively, fusion (payloads joined and cut on
    the device), fusion buffers (staged and sliced on the device) and overlap. Results and residuals equal bit for
    bit on every rank, with no host fallback; the Elias coding on the device for allgather (with error
    feedback), and through the host for scatter_allgather (no chunk kernels) with every exchange
    counted (tests/mp/torch_device_path.py). An emulated result:
    it checks the adapter's device-path logic, not a GPU (docs/gpu.md)."""
    pytest.importorskip("horovod.torch")
    from tests.helpers import launch
    from tests.mp.torch_device_path import CONFIGS, CORRUPT
    out = launch(3, "gloo", ["tests/mp/torch_device_path.py", "emulated", *CONFIGS, CORRUPT], timeout=400,
                 env={emulated_cuda.ENV: emulated_lib_path})
    for name in [*CONFIGS, CORRUPT]:
        assert out.count(f"<stdout>:OK {name}\n") == 3, f"{name}:\n{out[-4000:]}"


def test_the_device_decoder_gives_the_cpus_verdict_on_the_kept_fuzzing_payloads(emulated_lib):
    """scripts/gpu_sanitize.py's last check (make gpu-check runs it under compute-sanitizer on a GPU), here
    on the emulated device: the payloads the fuzzing kept, malformed ones among them, each get the CPU's
    verdict from the device's decoder, and the CPU's values where valid."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_sanitize", os.path.join(emulated_cuda.ROOT, "scripts",
                                                                               "gpu_sanitize.py"))
    gpu_sanitize = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_sanitize)
    payloads = gpu_sanitize.kept_payloads()
    refused = sum(1 for p in payloads if _native.load().qsgd_validate_cpu(_native.address(p), p.size) != 0)
    assert len(payloads) > 100 and 0 < refused < len(payloads)
    with emulated_cuda.on_host(emulated_lib):
        assert gpu_sanitize.check_kept_payloads(lambda t: t) == len(payloads)
