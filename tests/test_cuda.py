"""CUDA kernels: built wherever nvcc is, and byte-identical to the CPU kernels where a GPU is lent.

Without a CUDA device the identity tests are skipped, and reported as skipped (pytest -rs)."""
import shutil

import numpy as np
import pytest

from hvd_qsgd import _native, codec

torch = pytest.importorskip("torch")
no_gpu = pytest.mark.skipif(
    _native.load_cuda() is None or not torch.cuda.is_available(),
    reason="no CUDA device on this machine: CPU/CUDA byte identity not checked here")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_library_is_built_where_nvcc_is():
    assert _native.cuda_built(), "setup.py must build hvd_qsgd/_lib_cuda*.so when nvcc is present"


def _inputs():
    rng = np.random.default_rng(0)
    cases = []
    for n in (0, 1, 7, 513, 100_003):
        x = (rng.standard_normal(n) * rng.choice([1e-30, 1e-3, 1, 1e30], size=n)).astype(np.float32)
        cases.append(x)
    x = rng.standard_normal(5000).astype(np.float32)
    x[17], x[1500], x[3000] = np.nan, np.inf, 1e-45
    cases.append(x)
    return cases


@no_gpu
def test_cuda_encode_is_byte_identical_to_cpu():
    from hvd_qsgd import cuda
    for bits in range(1, 9):
        for norm in ("max", "l2"):
            for bucket in (1, 7, 128, 512, 4096):
                for i, x in enumerate(_inputs()):
                    cpu = codec.encode(x, bits=bits, bucket_size=bucket, norm=norm, seed=1234 + i, fingerprint=99)
                    gpu = cuda.encode(torch.from_numpy(x).cuda(), bits=bits, bucket_size=bucket, norm=norm,
                                      seed=1234 + i, fingerprint=99)
                    np.testing.assert_array_equal(gpu.cpu().numpy(), cpu, err_msg=f"bits={bits} norm={norm} "
                                                  f"bucket={bucket} case={i}")


@no_gpu
def test_cuda_decode_sum_is_bit_identical_to_cpu():
    for bits in (1, 3, 4, 8):
        _check_decode_sum(bits)


def _check_decode_sum(bits):
    from hvd_qsgd import cuda
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(70_001).astype(np.float32) for _ in range(5)]
    ps = [codec.encode(x, bits=bits, seed=k) for k, x in enumerate(xs)]
    want = codec.decode_sum(ps, scale=0.2)
    got = cuda.decode_sum([torch.from_numpy(p).cuda() for p in ps], scale=0.2)
    np.testing.assert_array_equal(got.cpu().numpy(), want)
    out = torch.full((70_001,), 3.0, device="cuda")
    cuda.decode_sum([torch.from_numpy(p).cuda() for p in ps], scale=0.2, out=out, accumulate=True)
    np.testing.assert_array_equal(out.cpu().numpy(), np.float32(3.0) + want)


@no_gpu
def test_cuda_decode_sum_detects_corruption_and_leaves_out_untouched():
    from hvd_qsgd import cuda
    p = codec.encode(np.ones(1000, np.float32), bits=4)
    p[200] ^= 4
    out = torch.full((1000,), 5.0, device="cuda")
    with pytest.raises(codec.PayloadError, match="checksum"):
        cuda.decode_sum([torch.from_numpy(p).cuda()], out=out, accumulate=True)
    assert bool((out == 5.0).all())
