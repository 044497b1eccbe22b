"""CUDA kernels: built wherever nvcc is, and byte-identical to the CPU kernels.

Two backends run the same checks:
- "gpu": the CUDA library on a CUDA device (skipped, and reported as skipped, where there is none);
- "emulated": kernels/qsgd_cuda.cu compiled as host C++ against tests/cuda_emu/cuda_runtime.h (lanes
  as threads, real shuffles and atomics), which checks the kernels' arithmetic, indexing, packing,
  reduction order and validation on any machine, but not the GPU's memory model or streams.
"""
import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest

from hvd_qsgd import _native, codec
from tests.helpers import ROOT
from tests.references import documented_sign_decode, fold_order_bucket, l1_fold_order_bucket

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


class EmulatedBackend:
    """The CUDA library's C entry points, compiled for the host: 'device' pointers are host pointers."""

    def __init__(self, lib):
        self.lib = lib

    def encode(self, x, bits=4, bucket_size=512, norm="max", seed=0, fingerprint=0, checksum=True):
        cfg = codec.make_config(bits, bucket_size, norm, seed, "fixed", fingerprint, checksum)
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
                                           int(accumulate), status.ctypes.data, None)
        if st == 0:
            st = int(status[0])
        if st != 0:
            codec.raise_status(st, "decode_sum")
        return out


@pytest.fixture(scope="module")
def emulated_lib(tmp_path_factory):
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        pytest.skip("no C++ compiler to build the emulated CUDA library")
    so = tmp_path_factory.mktemp("cuda_emu") / "libqsgd_cuda_emu.so"
    cmd = [cxx, "-O2", "-std=c++20", "-x", "c++", "-fPIC", "-shared", "-pthread", "-ffp-contract=off",
           "-fno-trapping-math", "-Itests/cuda_emu", "-Ikernels", "kernels/qsgd_cuda.cu", "-o", str(so)]
    subprocess.run(cmd, cwd=ROOT, check=True)
    lib = ctypes.CDLL(str(so))
    P, U64, I32 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int32
    lib.qsgd_encode_cuda.restype = I32
    lib.qsgd_encode_cuda.argtypes = [P, U64, ctypes.POINTER(_native.Config), P, U64, P]
    lib.qsgd_decode_sum_cuda.restype = I32
    lib.qsgd_decode_sum_cuda.argtypes = [ctypes.POINTER(P), ctypes.POINTER(_native.CHeader), I32, ctypes.c_float,
                                         P, U64, I32, P, P]
    return lib


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


def test_encode_is_byte_identical_to_cpu(backend):
    emulated = isinstance(backend, EmulatedBackend)
    for bits in range(1, 9):
        for norm in ("max", "l2", "sign") if bits == 1 else ("max", "l2"):
            for bucket in (1, 7, 128, 512, 4096):
                for i, x in enumerate(_inputs(small=emulated)):
                    if emulated and bucket < 128 and x.size > 1000:
                        x = x[:600]  # one warp per bucket: keep the emulation's warp count small
                    cpu = codec.encode(x, bits=bits, bucket_size=bucket, norm=norm, seed=1234 + i, fingerprint=99)
                    dev = backend.encode(x, bits=bits, bucket_size=bucket, norm=norm, seed=1234 + i, fingerprint=99)
                    np.testing.assert_array_equal(dev, cpu, err_msg=f"bits={bits} norm={norm} bucket={bucket} case={i}")


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
