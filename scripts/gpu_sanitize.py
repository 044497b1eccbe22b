"""Drive every CUDA kernel of the codec once per configuration, small sizes, for compute-sanitizer
(``scripts/gpu_check.sh`` runs it under memcheck and racecheck). Each result is also compared with the
CPU library, so a run that the sanitizer passes is a correct run too. Then the payloads the fuzzing
kept (tests/fuzz/corpus.pack: malformed ones among them) go through the device's decoder, which must
give the CPU's verdict and values (``check_kept_payloads``). Exits non-zero on a mismatch."""
import os
import sys
from types import SimpleNamespace

import numpy as np
import torch

from hvd_qsgd import _native, codec, cuda, cuda_headers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# an Elias stream's checks run per segment in parallel, on the CPU too: any of them may be found first
STREAM_CHECKS = {_native.E_STREAM, _native.E_PADDING, _native.E_LENGTH}


def kept_payloads(limit=None):
    """The kept fuzzing inputs of the device's decoder (tests/fuzz/fuzz_codec.cc's mode 3) as it reads
    them: resealed where the input asks, cut at the declared length; those whose header parses, of 1
    to 65,536 elements. At most ``limit``."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "fuzz"))
    try:
        import pack
    finally:
        sys.path.pop(0)
    lib, out = _native.load(), []
    for data in pack.records(os.path.join(ROOT, "tests", "fuzz", "corpus.pack")):
        if not data or data[0] & 0x7F != 3:
            continue
        p = np.frombuffer(data[1:], np.uint8).copy()
        if data[0] & 0x80 and p.size >= codec.HEADER_BYTES and p[9] & 1:
            p[48:56] = np.frombuffer(int(lib.qsgd_checksum_cpu(_native.address(p), p.size)).to_bytes(8, "little"),
                                     np.uint8)
        try:
            h = codec.read_header(p)
        except codec.PayloadError:
            continue
        if 1 <= h.numel <= 1 << 16:
            out.append(p[: h.payload_len].copy())
        if limit is not None and len(out) >= limit:
            break
    return out


def check_kept_payloads(to_device, limit=None):
    """Every kept payload decoded by the device (``to_device``: a host uint8 tensor's device copy): a
    payload the CPU refuses raises PayloadError with the CPU's status (among an Elias stream's checks:
    one of them), one it accepts gives its values. Returns how many were checked."""
    payloads = kept_payloads(limit)
    for k, p in enumerate(payloads):
        want = int(_native.load().qsgd_validate_cpu(_native.address(p), p.size))
        try:
            got = cuda.decode_sum([to_device(torch.from_numpy(p))]).cpu().numpy()
            status = _native.OK
        except codec.PayloadError as e:
            got, status = None, e.status
        if status != want and not (status in STREAM_CHECKS and want in STREAM_CHECKS):
            sys.exit(f"kept payload {k}: the device says {_native.status_string(status) if status else 'valid'}, "
                     f"the CPU {_native.status_string(want) if want else 'valid'}")
        if got is not None and not np.array_equal(got, codec.decode_sum([p]), equal_nan=True):
            sys.exit(f"kept payload {k}: the device's values differ from the CPU's")
    return len(payloads)


def main():
    rng = np.random.default_rng(3)
    cases = 0
    for n in (0, 7, 513, 4099):
        x = rng.standard_normal(n).astype(np.float32)
        if n > 100:
            x[5], x[77] = np.nan, np.inf
        for bits in range(1, 9):
            for norm in ("max", "l2", "sign") if bits == 1 else ("max", "l2"):
                for bucket in (1, 100, 512):
                    for checksum, encoder in ((True, 2), (False, 2), (True, 1)) if bucket == 100 else ((True, 2),):
                        kw = dict(bits=bits, bucket_size=bucket, norm=norm, seed=n + bits, checksum=checksum,
                                  encoder=encoder)
                        dev = cuda.encode(torch.from_numpy(x).cuda(), **kw)
                        cpu = codec.encode(x, **kw)
                        if not np.array_equal(dev.cpu().numpy(), cpu):
                            sys.exit(f"encode differs: n={n} {kw}")
                        if n:
                            ps = [dev, cuda.encode(torch.from_numpy(x[::-1].copy()).cuda(), **kw)]
                            out = torch.full((n,), 2.0, device="cuda")
                            cuda.decode_sum(ps, scale=0.5, out=out, accumulate=True)
                            want = np.float32(2.0) + codec.decode_sum([p.cpu().numpy() for p in ps], scale=0.5)
                            if not np.array_equal(out.cpu().numpy(), want, equal_nan=True):
                                sys.exit(f"decode_sum differs: n={n} {kw}")
                            # the headers checked on the device against what they must say
                            expect = [cuda_headers.expected(SimpleNamespace(bits=bits, bucket_size=bucket, norm=norm,
                                                                            numel=n, dtype="float32", fingerprint=0))] * 2
                            got = cuda.decode_sum(ps, scale=0.5, expect=expect)
                            if not np.array_equal(got.cpu().numpy() + np.float32(2.0), want, equal_nan=True):
                                sys.exit(f"decode_sum with the headers checked on the device differs: n={n} {kw}")
                        cases += 1
    # half-precision input and error feedback fused into the encoder (both bucket paths)
    for bucket in (512, 100):
        x = torch.from_numpy(rng.standard_normal(4099).astype(np.float32)).cuda()
        for xin in (x, x.half(), x.bfloat16()):
            residual = torch.zeros(4099, device="cuda")
            for valid in (False, True):
                cuda.encode(xin, 4, bucket, residual=residual, residual_valid=valid)
            cuda.encode(xin, 2, bucket)
            cases += 1
    # the Elias coding: encode (one and many segments), decode-sum of several payloads
    for n, bucket in ((0, 128), (5000, 128), (70_000, 40_000), (3001, 7)):
        x = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).cuda()
        ps = [cuda.encode(x * (k + 1), 3, bucket, seed=k, coding="elias") for k in range(2)]
        want = codec.decode_sum([p.cpu().numpy() for p in ps])
        if not np.array_equal(cuda.decode_sum(ps).cpu().numpy(), want, equal_nan=True):
            sys.exit(f"Elias decode_sum differs: n={n} bucket={bucket}")
        cases += 1
    # the chunk steps of scatter_allgather (odd chunk lengths, empty chunks, server residual)
    for bits, bucket, n, numel in ((4, 512, 4, 3001), (3, 7, 3, 700), (2, 128, 6, 300)):
        xs = [torch.from_numpy(rng.standard_normal(numel).astype(np.float32)).cuda() for _ in range(n)]
        chunks = []
        for r in range(n):
            buf, lens = cuda.encode_chunks(xs[r], n, bits, bucket, step_seed=r)
            chunks.append(list(buf.split(lens)))
        reduced = []
        for j in range(n):
            size = cuda.read_headers([chunks[0][j]])[0].numel
            residual = torch.zeros(size, device="cuda")
            cuda.reduce_chunk([chunks[r][j] for r in range(n)], j, bits, bucket, step_seed=j, residual=residual)
            reduced.append(cuda.reduce_chunk([chunks[r][j] for r in range(n)], j, bits, bucket, step_seed=j))
        cuda.decode_chunks(reduced, 1.0 / n, numel, bucket)
        tensor = SimpleNamespace(bits=bits, bucket_size=bucket, norm="max", numel=numel, dtype="float32", fingerprint=0)
        ranges = [(0, cuda.read_headers([c])[0].numel) for c in reduced]   # (each chunk's size is what matters)
        cuda.decode_chunks(reduced, 1.0 / n, numel, bucket, expect=cuda_headers.expected_chunks(tensor, ranges))
        cases += 1
    # a corrupt payload: the error path of the verify kernels
    p = cuda.encode(torch.ones(1001, device="cuda"), bits=3)
    p[200] ^= 4
    try:
        cuda.decode_sum([p])
        sys.exit("a corrupt payload was not detected")
    except codec.PayloadError:
        pass
    p[200] ^= 4
    p[20] ^= 1   # (its numel: a header that differs from the expected one, found on the device)
    tensor = SimpleNamespace(bits=3, bucket_size=512, norm="max", numel=1001, dtype="float32", fingerprint=0)
    try:
        cuda.decode_sum([p], expect=[cuda_headers.expected(tensor)])
        sys.exit("a header that differs was not detected on the device")
    except codec.PayloadError:
        pass
    torch.cuda.synchronize()
    kept = check_kept_payloads(lambda t: t.cuda())
    torch.cuda.synchronize()
    print(f"sanitizer driver: {cases} configurations and {kept} kept fuzzing payloads, every result and verdict "
          "equal to the CPU library's")


if __name__ == "__main__":
    main()
