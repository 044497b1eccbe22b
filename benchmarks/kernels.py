"""``python -m benchmarks kernels``: codec throughput against memcpy and hand-written baselines.

For each size and bit width, side by side in one run: np.copyto of a same-size float32 array (the
memory-bandwidth reference), hvd_qsgd encode, decode and encode+decode (with and without the payload
checksum: the "checksum" column is its cost, the median over rounds of t(with) / t(without) - 1,
the two timed back to back in each round), and encode+decode of the
NumPy and PyTorch-ops baselines of the same quantizer (``baselines.py``). Throughput is GB/s of fp32
input: 4 * numel / seconds (1 GB = 1e9 bytes; e+d uses t_encode + t_decode); each time is the median
of ``--repeats`` runs after one warm-up. Before timing, a self-check verifies every implementation
(error within one level spacing, unbiasedness, scales and bit layout equal to the codec's). With a
CUDA device and the codec's CUDA library, the CUDA kernels are timed against a device-to-device copy.

Every row names the CPU kernels' instruction-set variant (``--isa`` times several side by side in
one run; the default is the one in use: the widest this CPU runs, or HVD_QSGD_ISA) and gives the
time per element per thread (t * threads / numel: what one core costs per element). The roofline
table then sets each kernel against the bytes it must move: encode reads 4 bytes per element and
writes the payload, decode reads the payload and writes 4 bytes per element, memcpy reads and writes
4; at the memory bandwidth this machine's memcpy reached in the same run (8 * numel / t_memcpy),
that traffic takes a floor time, and "of floor" is floor / measured (1.00 = as fast as the memory
allows; a write-allocating store moves the destination twice, so plain stores reach ~0.7).
"""
import argparse
import ctypes
import json
import os
import statistics
import time

import numpy as np

from hvd_qsgd import _native, codec
from benchmarks import baselines as bl
from benchmarks import common
from benchmarks.common import bit_widths, positive_int

_UNITS = common.ELEMENT_UNITS
parse_size = common.element_count
_CHECK_TRIALS = 200  # encodes per implementation in the unbiasedness check


# ---- arguments ---------------------------------------------------------------------------------
def parse_sizes(text):
    return [parse_size(s) for s in text.split(",") if s.strip()]


parse_bits = bit_widths(2)


def parse_encoders(text):
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        out = []
    if not out or any(v not in codec.ENCODERS for v in out):
        raise argparse.ArgumentTypeError(f"{text!r}: encoder versions are 1 and 2, e.g. 2 or 2,1")
    return out


def parse_isas(text):
    """'avx2,baseline' -> ['avx2', 'baseline']; 'all' -> every variant this CPU runs."""
    runs = [name for name, ok in codec.cpu_isas().items() if ok]
    if text.strip() == "all":
        return runs
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in runs]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--isa: {', '.join(bad) or '(none)'} not among the variants this CPU "
                                         f"runs ({', '.join(runs)})")
    return names


def fmt_size(n):
    for unit in ("G", "M", "K"):
        if n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)


def add_arguments(p):
    p.add_argument("--sizes", type=parse_sizes, default="1M,4M,16M,64M",
                   help="fp32 element counts, comma-separated; K/M/G = 2^10/2^20/2^30 (default %(default)s)")
    p.add_argument("--bits", type=parse_bits, default="2,4,8",
                   help="bit widths in 2..8 (default %(default)s)")
    p.add_argument("--bucket-size", type=positive_int, default=512,
                   help="elements per scale (default %(default)s)")
    p.add_argument("--repeats", type=positive_int, default=5,
                   help="timed runs per measurement, after one warm-up (default %(default)s)")
    p.add_argument("--baseline-max", type=parse_size, default="16M",
                   help="skip the NumPy/PyTorch baselines above this many elements (default %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="codec CPU threads (0: the codec's default)")
    p.add_argument("--isa", type=parse_isas, default=None,
                   help="CPU kernel variants to time side by side, comma-separated, or 'all' (every variant "
                        "this CPU runs); default: the one in use")
    p.add_argument("--no-checksum", action="store_true", help="encode without the payload checksum")
    p.add_argument("--encoder", type=parse_encoders, default="2,1",
                   help="encoder versions to time side by side, comma-separated (default 2,1; docs/wire-format.md)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and of the quantizers")
    p.add_argument("--json", metavar="PATH", help="also write every number to this JSON file")
    p.add_argument("--device", choices=("all", "cpu", "cuda"), default="all",
                   help="time the CPU kernels, the CUDA kernels, or both (default %(default)s; 'cuda' fails "
                        "where no CUDA device is usable)")


# ---- measurement helpers --------------------------------------------------------------------------
def median_time(fn, repeats):
    """(median seconds of `repeats` calls after one warm-up call, the last call's result)."""
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def paired_ratio(fn_a, fn_b, repeats):
    """median over `repeats` rounds of t(fn_a) / t(fn_b), the two timed back to back in each round
    (after one warm-up call of each), so that load changing during the run affects both alike."""
    fn_a(), fn_b()
    ratios = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn_a()
        t1 = time.perf_counter()
        fn_b()
        ratios.append((t1 - t0) / (time.perf_counter() - t1))
    return statistics.median(ratios)


def gbps(numel, seconds):
    return 4 * numel / seconds / 1e9


def machine_info():
    info = common.machine_info()
    info.update(codec_threads=codec.get_num_threads(), numpy=np.__version__, torch=None, torch_threads=None)
    if bl.torch is not None:
        info.update(torch=bl.torch.__version__, torch_threads=bl.torch.get_num_threads())
    return info


# ---- self-check ----------------------------------------------------------------------------------
def _implementations(bits, bucket, checksum):
    """name -> (encode(x, seed), decode(q) -> np.ndarray) for every implementation timed here."""
    def qsgd_encode(x, k):
        return codec.encode(x, bits=bits, bucket_size=bucket, seed=k, checksum=checksum)

    def numpy_encode(x, k):
        return bl.numpy_encode(x, bits, bucket, np.random.default_rng(k))

    def torch_encode(x, k):
        return bl.torch_encode(bl.torch.from_numpy(x), bits, bucket, bl.torch.Generator().manual_seed(k))

    impls = {"hvd_qsgd": (qsgd_encode, codec.decode), "numpy": (numpy_encode, bl.numpy_decode)}
    if bl.torch is not None:
        impls["torch"] = (torch_encode, lambda q: bl.torch_decode(q).numpy())
    return impls


def self_check(bits_list, bucket, checksum, seed):
    """Check every implementation on a small array; return a list of failure messages (empty: pass).

    Per element, |Q(x) - x| <= scale/s; over K encodes with different seeds, |mean Q(x) - x| <=
    0.3 scale/s (Hoeffding: P(fail) <= 2 exp(-2 K 0.09) ~ 5e-16 per element for an unbiased Q), and
    the mean error in units of scale/s is below 0.02. Baseline scales and packed sizes must equal the
    codec's, and the baseline decoders must decode the codec's own packed codes to the codec's values.
    """
    n = 4 * bucket + 37  # a zero first bucket and a partial last one
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    x[:bucket] = 0.0
    x[n // 2] = -x[n // 2] * 3  # some bucket has its max at a negative element
    fails = []
    for bits in bits_list:
        s = bl.levels(bits)
        payload = codec.encode(x, bits=bits, bucket_size=bucket, seed=seed, checksum=checksum)
        nb = -(-n // bucket)
        scales = payload[codec.HEADER_BYTES: codec.HEADER_BYTES + 4 * nb].view(np.float32)
        packed = payload[codec.HEADER_BYTES + 4 * nb:]
        ref = bl.numpy_decode(bl.Quantized(scales, packed, n, bits, bucket))
        if not np.array_equal(ref, codec.decode(payload)):
            fails.append(f"bits={bits}: numpy_decode of the codec's codes differs from codec.decode")
        if bl.torch is not None:
            tq = bl.Quantized(bl.torch.from_numpy(scales.copy()), bl.torch.from_numpy(packed.copy()),
                              n, bits, bucket)
            if not np.array_equal(bl.torch_decode(tq).numpy(), ref):
                fails.append(f"bits={bits}: torch_decode of the codec's codes differs from codec.decode")
        step = np.repeat(scales / np.float32(s), bucket)[:n].astype(np.float64)
        live = step > 0
        for name, (enc, dec) in _implementations(bits, bucket, checksum).items():
            if name != "hvd_qsgd":
                q = enc(x, seed)
                if not np.array_equal(np.asarray(q.scales), scales) or len(q.packed) != len(packed):
                    fails.append(f"bits={bits} {name}: scales or packed size differ from the codec's")
            total = np.zeros(n)
            for k in range(_CHECK_TRIALS):
                err = dec(enc(x, seed + k)).astype(np.float64) - x
                if np.any(np.abs(err) > step * (1 + 1e-6)):
                    fails.append(f"bits={bits} {name}: error above one level spacing (seed {seed + k})")
                    break
                total += err
            mean = total / _CHECK_TRIALS
            if np.any(np.abs(mean) > 0.3 * step):
                fails.append(f"bits={bits} {name}: per-element mean error above 0.3 level spacings")
            bias = np.mean(mean[live] / step[live])
            if abs(bias) > 0.02:
                fails.append(f"bits={bits} {name}: biased (mean error {bias:.3f} level spacings)")
    return fails


# ---- CPU timing ----------------------------------------------------------------------------------
_COLS = [("size", 6), ("bits", 4), ("isa", 8), ("enc", 3), ("memcpy", 8), ("qsgd enc", 9), ("qsgd dec", 9), ("qsgd e+d", 9),
         ("numpy e+d", 10), ("torch e+d", 10), ("e+d/torch", 10), ("e+d/memcpy", 11), ("enc ns/el", 10),
         ("dec ns/el", 10), ("checksum", 9), ("streamed", 9)]


def _row_text(cells):
    return "  ".join(str(c).rjust(w) for c, (_, w) in zip(cells, _COLS))


def _num(v, ratio=False):
    return "-" if v is None else (f"{v:.2f}x" if ratio else f"{v:.2f}")


def kernel_threads(n):
    """Threads the CPU kernels use for n elements (kernels/qsgd_cpu.cc: one below 2^16 elements)."""
    return codec.get_num_threads() if n >= 1 << 16 else 1


def time_cpu(n, bits, bucket, repeats, seed, checksum, x, memcpy_s, with_baselines, encoder=codec.DEFAULT_ENCODER):
    """Measure one (size, bits, encoder) cell with the variant in use; returns the row dict (None where
    not measured)."""
    threads = kernel_threads(n)
    row = dict(numel=n, bits=bits, isa=codec.cpu_isa(), encoder=encoder, threads=threads, memcpy_s=memcpy_s,
               memcpy_gbps=gbps(n, memcpy_s))
    # encode into a caller-owned buffer, as decode and memcpy write into existing arrays: a fresh
    # array would time the page faults of its first touch, not the codec
    buf = np.empty(codec.max_payload_nbytes(n, bits, bucket), dtype=np.uint8)
    te, payload = median_time(lambda: codec.encode(x, bits=bits, bucket_size=bucket, seed=seed, checksum=checksum,
                                                   out=buf, encoder=encoder), repeats)
    payload = payload.copy()
    # decode into a caller-owned buffer, as the reduction does (into the gradient) and as memcpy's
    # destination is: a fresh 256 MB array would time the kernel's page faults, not the codec
    out = np.empty(n, dtype=np.float32)
    td, _ = median_time(lambda: codec.decode_sum([payload], out=out), repeats)
    row.update(payload_bytes=int(payload.size), qsgd_encode_s=te, qsgd_decode_s=td,
               qsgd_encode_gbps=gbps(n, te), qsgd_decode_gbps=gbps(n, td), qsgd_ed_gbps=gbps(n, te + td),
               encode_ns_per_elem_thread=te * threads / n * 1e9, decode_ns_per_elem_thread=td * threads / n * 1e9)
    row.update(roofline(n, int(payload.size), memcpy_s, te, td))
    # the checksum's cost, side by side: encode + decode with it over without it, round by round
    with_ck, _ = _implementations(bits, bucket, True)["hvd_qsgd"]
    without_ck, _ = _implementations(bits, bucket, False)["hvd_qsgd"]
    out2 = np.empty(n, dtype=np.float32)
    row["checksum_cost"] = paired_ratio(lambda: codec.decode_sum([with_ck(x, seed)], out=out),
                                        lambda: codec.decode_sum([without_ck(x, seed)], out=out2), repeats) - 1.0
    row["streamed_cost"] = _streamed_cost(payload, out, repeats)
    for name in ("numpy", "torch"):
        row.update({f"{name}_encode_s": None, f"{name}_decode_s": None, f"{name}_ed_gbps": None})
        if not with_baselines or (name == "torch" and bl.torch is None):
            continue
        if name == "numpy":
            rng = np.random.default_rng(seed)
            benc, bdec = (lambda: bl.numpy_encode(x, bits, bucket, rng)), bl.numpy_decode
        else:
            xt, gen = bl.torch.from_numpy(x), bl.torch.Generator().manual_seed(seed)
            benc, bdec = (lambda: bl.torch_encode(xt, bits, bucket, gen)), bl.torch_decode
        be, q = median_time(benc, repeats)
        bd, _ = median_time(lambda: bdec(q), repeats)
        row.update({f"{name}_encode_s": be, f"{name}_decode_s": bd, f"{name}_ed_gbps": gbps(n, be + bd)})
    row["ratio_qsgd_torch"] = row["qsgd_ed_gbps"] / row["torch_ed_gbps"] if row["torch_ed_gbps"] else None
    row["ratio_qsgd_memcpy"] = row["qsgd_ed_gbps"] / row["memcpy_gbps"]
    return row


def _streamed_cost(payload, out, repeats):
    """The decode's streaming stores against cached ones, side by side: the median over rounds of
    t(decode with streaming stores) / t(decode with cached stores) - 1 (the qsgd dec column uses the
    codec's choice: streaming where the result is at least ``codec.stream_bytes()``)."""
    chosen = codec.stream_bytes()

    def decode_with(nbytes):
        codec.set_stream_bytes(nbytes)
        try:
            codec.decode_sum([payload], out=out)
        finally:
            codec.set_stream_bytes(chosen)
    return paired_ratio(lambda: decode_with(1), lambda: decode_with(2**64 - 1), repeats) - 1.0


def roofline(n, payload_bytes, memcpy_s, encode_s, decode_s):
    """The bytes each kernel must move, the floor time they take at the bandwidth memcpy reached
    (8 * n bytes moved in memcpy_s), and floor / measured."""
    bandwidth = 8 * n / memcpy_s
    enc_bytes, dec_bytes = 4 * n + payload_bytes, payload_bytes + 4 * n
    return dict(memory_gbps=bandwidth / 1e9, encode_bytes=enc_bytes, decode_bytes=dec_bytes,
                encode_floor_s=enc_bytes / bandwidth, decode_floor_s=dec_bytes / bandwidth,
                encode_of_floor=enc_bytes / bandwidth / encode_s, decode_of_floor=dec_bytes / bandwidth / decode_s)


def _print_cpu_row(r):
    print(_row_text([fmt_size(r["numel"]), r["bits"], r["isa"], f"v{r['encoder']}", _num(r["memcpy_gbps"]), _num(r["qsgd_encode_gbps"]),
                     _num(r["qsgd_decode_gbps"]), _num(r["qsgd_ed_gbps"]), _num(r["numpy_ed_gbps"]),
                     _num(r["torch_ed_gbps"]), _num(r["ratio_qsgd_torch"], True),
                     _num(r["ratio_qsgd_memcpy"], True), f"{r['encode_ns_per_elem_thread']:.2f}",
                     f"{r['decode_ns_per_elem_thread']:.2f}", f"{100 * r['checksum_cost']:+.1f}%",
                     f"{100 * r['streamed_cost']:+.1f}%"]), flush=True)


_ROOF_COLS = [("size", 6), ("bits", 4), ("isa", 8), ("enc", 3), ("mem GB/s", 9), ("enc B/el", 9), ("dec B/el", 9),
              ("enc floor", 10), ("dec floor", 10), ("enc of floor", 13), ("dec of floor", 13)]


def _print_roofline(rows):
    print("\nroofline: bytes each kernel moves per element, its floor time (ns per element, all threads) at "
          "the memory bandwidth memcpy reached (8 B/el), and floor / measured")
    print("  ".join(c.rjust(w) for c, w in _ROOF_COLS))
    for r in rows:
        n = r["numel"]
        cells = [fmt_size(n), r["bits"], r["isa"], f"v{r['encoder']}", f"{r['memory_gbps']:.1f}", f"{r['encode_bytes'] / n:.2f}",
                 f"{r['decode_bytes'] / n:.2f}", f"{r['encode_floor_s'] / n * 1e9:.3f}",
                 f"{r['decode_floor_s'] / n * 1e9:.3f}", f"{r['encode_of_floor']:.2f}", f"{r['decode_of_floor']:.2f}"]
        print("  ".join(str(c).rjust(w) for c, (_, w) in zip(cells, _ROOF_COLS)))


# ---- CUDA timing ---------------------------------------------------------------------------------
def cuda_unavailable_reason():
    """None when the CUDA kernels can be timed, else why not (one short phrase)."""
    lib = _native.load_cuda()
    torch = bl.torch
    torch_cuda = torch is not None and torch.cuda.is_available()
    if lib is not None and torch_cuda:
        return None
    if lib is not None:
        return "torch in this environment has no CUDA support"
    if torch_cuda:
        return ("hvd_qsgd's CUDA library sees no device or did not load" if _native.cuda_built()
                else "hvd_qsgd was built without its CUDA library")
    return "no CUDA device on this machine"


def _cuda_median(fn, repeats):
    torch = bl.torch
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _check(st, what):
    if st != _native.OK:
        raise RuntimeError(f"{what}: {_native.status_string(st)}")


def time_cuda(n, bits, bucket, repeats, seed, checksum, x_host, x, copy_s, norm="max", encoder=codec.DEFAULT_ENCODER):
    """Time qsgd_encode_cuda and qsgd_decode_sum_cuda on device x; the results are checked against
    the CPU codec (bit-identical payload, equal decode) before the row is returned."""
    from hvd_qsgd import cuda
    torch, lib = bl.torch, _native.load_cuda()
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    cfg = codec.make_config(bits, bucket, norm, seed, "fixed", 0, checksum, encoder=encoder)
    cap = codec.payload_nbytes(n, bits, bucket)
    out = torch.empty(cap, dtype=torch.uint8, device=x.device)
    te = _cuda_median(lambda: _check(lib.qsgd_encode_cuda(x.data_ptr(), n, ctypes.byref(cfg), out.data_ptr(),
                                                          cap, stream), "qsgd_encode_cuda"), repeats)
    # the decoder takes headers parsed on the host (not timed: the kernels are)
    headers = cuda.device_headers([out])
    ptrs = (ctypes.c_void_p * 1)(out.data_ptr())
    y = torch.empty(n, dtype=torch.float32, device=x.device)
    d_status = torch.zeros(1, dtype=torch.int32, device=x.device)
    td = _cuda_median(lambda: _check(lib.qsgd_decode_sum_cuda(ptrs, headers, 1, 1.0, y.data_ptr(), n, 0,
                                                              d_status.data_ptr(), None, stream),
                                     "qsgd_decode_sum_cuda"), repeats)
    _check(int(d_status.item()), "qsgd_decode_sum_cuda (device status)")
    ref = codec.encode(x_host, bits=bits, bucket_size=bucket, norm=norm, seed=seed, checksum=checksum, encoder=encoder)
    if not np.array_equal(out.cpu().numpy(), ref) or not np.array_equal(y.cpu().numpy(), codec.decode(ref)):
        raise RuntimeError(f"CUDA results differ from the CPU codec (n={n}, bits={bits}, encoder {encoder})")
    # effective bandwidth: the bytes a kernel must move (encode reads 4n and writes the payload,
    # decode reads the payload and writes 4n; the copy reads and writes 4n) over its time
    copy_bw = 8 * n / copy_s
    enc_bw, dec_bw = (4 * n + cap) / te, (4 * n + cap) / td
    return dict(numel=n, bits=bits, norm=norm, encoder=encoder, payload_bytes=cap, copy_s=copy_s, copy_gbps=gbps(n, copy_s), encode_s=te,
                decode_s=td, encode_gbps=gbps(n, te), decode_gbps=gbps(n, td), ed_gbps=gbps(n, te + td),
                ratio_ed_copy=gbps(n, te + td) / gbps(n, copy_s), copy_eff_gbps=copy_bw / 1e9,
                encode_eff_gbps=enc_bw / 1e9, decode_eff_gbps=dec_bw / 1e9,
                encode_of_copy=enc_bw / copy_bw, decode_of_copy=dec_bw / copy_bw)


def time_cuda_encode_variant(n, kind, bucket, repeats, seed, checksum, x_host, x, copy_s, encoder=codec.DEFAULT_ENCODER):
    """4-bit encode of the fused variants: "ef" (fp32 x with error feedback: reads x and the residual,
    rewrites the residual) or "fp16" (x read as float16). The payload is checked against the CPU codec."""
    torch, lib = bl.torch, _native.load_cuda()
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    cfg = codec.make_config(4, bucket, "max", seed, "fixed", 0, checksum, encoder=encoder)
    cap = codec.payload_nbytes(n, 4, bucket)
    out = torch.empty(cap, dtype=torch.uint8, device=x.device)
    if kind == "ef":
        xin, dtype, res = x, 0, torch.full_like(x, 1e-3)
        moved = 12 * n + cap  # x, the residual read and written, the payload
        ref_in = x_host + np.float32(1e-3)
    else:
        xin, dtype, res = x.half(), 1, None
        moved = 2 * n + cap
        ref_in = x_host.astype(np.float16).astype(np.float32)
    res0 = None if res is None else res.clone()

    def call():
        if res is not None:
            res.copy_(res0)  # timed too: subtracted below with a copy-only run
        _check(lib.qsgd_encode_ex_cuda(xin.data_ptr(), dtype, n, ctypes.byref(cfg), None if res is None else
                                       res.data_ptr(), 1, out.data_ptr(), cap, stream), "qsgd_encode_ex_cuda")
    te = _cuda_median(call, repeats)
    if res is not None:  # the residual's reset is not the encoder's work
        te -= _cuda_median(lambda: res.copy_(res0), repeats)
    call()
    if not np.array_equal(out.cpu().numpy(), codec.encode(ref_in, bits=4, bucket_size=bucket, seed=seed,
                                                           checksum=checksum, encoder=encoder)):
        raise RuntimeError(f"CUDA {kind} encode differs from the CPU codec (n={n})")
    copy_bw = 8 * n / copy_s
    return dict(numel=n, bits=4, norm="max", variant=kind, encoder=encoder, payload_bytes=cap, copy_s=copy_s, encode_s=te,
                encode_gbps=gbps(n, te), moved_bytes=moved, encode_eff_gbps=moved / te / 1e9,
                encode_of_copy=moved / te / copy_bw)


def time_cuda_elias(n, bucket, repeats, seed, checksum, x_host, x, copy_s, encoder=codec.DEFAULT_ENCODER):
    """4-bit Elias encode (which waits once for its length) and decode_sum of one payload; both
    checked against the CPU codec."""
    from hvd_qsgd import cuda
    torch, lib = bl.torch, _native.load_cuda()
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    cfg = codec.make_config(4, bucket, "max", seed, "elias", 0, checksum, encoder=encoder)
    cap = int(_native.load().qsgd_elias_max_nbytes(n, 4, bucket))
    out = torch.empty(cap, dtype=torch.uint8, device=x.device)
    out_len = ctypes.c_uint64()
    te = _cuda_median(lambda: _check(lib.qsgd_encode_elias_cuda(x.data_ptr(), 0, n, ctypes.byref(cfg), out.data_ptr(),
                                                                cap, ctypes.byref(out_len), stream),
                                     "qsgd_encode_elias_cuda"), repeats)
    payload = out[: out_len.value]
    headers = cuda.device_headers([payload])
    ptrs = (ctypes.c_void_p * 1)(payload.data_ptr())
    y = torch.empty(n, dtype=torch.float32, device=x.device)
    d_status = torch.zeros(1, dtype=torch.int32, device=x.device)
    td = _cuda_median(lambda: _check(lib.qsgd_decode_sum_cuda(ptrs, headers, 1, 1.0, y.data_ptr(), n, 0,
                                                              d_status.data_ptr(), None, stream), "qsgd_decode_sum_cuda"),
                      repeats)
    _check(int(d_status.item()), "qsgd_decode_sum_cuda (device status)")
    ref = codec.encode(x_host, bits=4, bucket_size=bucket, seed=seed, checksum=checksum, coding="elias", encoder=encoder)
    if not np.array_equal(payload.cpu().numpy(), ref) or not np.array_equal(y.cpu().numpy(), codec.decode(ref)):
        raise RuntimeError(f"CUDA Elias results differ from the CPU codec (n={n})")
    return dict(numel=n, bits=4, norm="max", variant="elias", encoder=encoder, payload_bytes=int(out_len.value), copy_s=copy_s,
                encode_s=te, decode_s=td, encode_gbps=gbps(n, te), decode_gbps=gbps(n, td), ed_gbps=gbps(n, te + td))


def run_cuda(sizes, bits_list, bucket, repeats, seed, checksum, encoders=(codec.DEFAULT_ENCODER,)):
    torch = bl.torch
    print(f"\nCUDA: {torch.cuda.get_device_name()}; GB/s of fp32 input; decode = qsgd_decode_sum_cuda of "
          "one payload (host header parse not timed); copy = torch .copy_ device to device; enc%/dec% = "
          "effective bandwidth (4n + payload bytes over the kernel's time) as a fraction of the copy's (8n); "
          "rows 4ef: 4-bit encode with error feedback fused (moves 12n + payload: x, the residual read and "
          "rewritten), 4fp16: 4-bit encode of float16 x read natively (2n + payload); 4eli: 4-bit Elias coding (its "
          "encode waits once for the payload's length)")
    cols = [("size", 6), ("bits", 5), ("enc", 3), ("d2d copy", 9), ("enc", 9), ("dec", 9), ("e+d", 9), ("e+d/copy", 9),
            ("enc%", 6), ("dec%", 6)]
    print("  ".join(c.rjust(w) for c, w in cols))
    rows = []
    for n in sizes:
        x_host = np.random.default_rng(seed).standard_normal(n, dtype=np.float32)
        x = torch.from_numpy(x_host).cuda()
        dst = torch.empty_like(x)
        copy_s = _cuda_median(lambda: dst.copy_(x), repeats)
        for bits, norm in [(b, "max") for b in bits_list] + [(1, "sign")]:
            for encoder in (encoders if norm == "max" else encoders[:1]):  # the sign norm draws no randomness
                r = time_cuda(n, bits, bucket, repeats, seed, checksum, x_host, x, copy_s, norm, encoder)
                rows.append(r)
                gb = [f"{r[k]:.1f}" for k in ("copy_gbps", "encode_gbps", "decode_gbps", "ed_gbps")]
                cells = [fmt_size(n), bits if norm == "max" else "sign", f"v{encoder}"] + gb + [
                    f"{r['ratio_ed_copy']:.2f}x", f"{100 * r['encode_of_copy']:.0f}", f"{100 * r['decode_of_copy']:.0f}"]
                print("  ".join(str(c).rjust(w) for c, (_, w) in zip(cells, cols)), flush=True)
        for encoder in encoders:
            for kind in ("ef", "fp16"):
                r = time_cuda_encode_variant(n, kind, bucket, repeats, seed, checksum, x_host, x, copy_s, encoder)
                rows.append(r)
                cells = [fmt_size(n), f"4{kind}", f"v{encoder}", f"{gbps(n, copy_s):.1f}", f"{r['encode_gbps']:.1f}",
                         "-", "-", "-", f"{100 * r['encode_of_copy']:.0f}", "-"]
                print("  ".join(str(c).rjust(w) for c, (_, w) in zip(cells, cols)), flush=True)
            r = time_cuda_elias(n, bucket, repeats, seed, checksum, x_host, x, copy_s, encoder)
            rows.append(r)
            cells = [fmt_size(n), "4eli", f"v{encoder}", f"{gbps(n, copy_s):.1f}", f"{r['encode_gbps']:.1f}",
                     f"{r['decode_gbps']:.1f}", f"{r['ed_gbps']:.1f}", "-", "-", "-"]
            print("  ".join(str(c).rjust(w) for c, (_, w) in zip(cells, cols)), flush=True)
        del x, dst
    return rows


def run_cpu(args, isas, in_use, checksum):
    """The CPU rows (printed as they come), or None when the self-check failed."""
    print(f"config: bucket {args.bucket_size}, norm max, fixed coding, "
          f"checksum {'on' if checksum else 'off'}; median of {args.repeats} after 1 warm-up; "
          f"baselines up to {fmt_size(args.baseline_max)} elements")
    fails = self_check(args.bits, args.bucket_size, checksum, args.seed)
    if fails:
        print("self-check FAILED:\n  " + "\n  ".join(fails))
        return None
    print(f"self-check passed (hvd_qsgd, numpy{', torch' if bl.torch else ''}; bits {args.bits}: error <= "
          f"scale/s, unbiased over {_CHECK_TRIALS} seeds, scales and bit layout equal to the codec's)")
    print("\nGB/s of fp32 input (4 * numel bytes / s, 1 GB = 1e9 B); e+d = 4 * numel / (t_enc + t_dec)")
    print(_row_text([c for c, _ in _COLS]))
    rows = []
    for n in args.sizes:
        x = np.random.default_rng(args.seed).standard_normal(n, dtype=np.float32)
        dst = np.empty_like(x)
        memcpy_s, _ = median_time(lambda: np.copyto(dst, x), args.repeats)
        del dst
        for bits in args.bits:
            for isa in isas:
                for encoder in args.encoder:
                    codec.set_cpu_isa(isa)
                    try:
                        r = time_cpu(n, bits, args.bucket_size, args.repeats, args.seed, checksum, x, memcpy_s,
                                     n <= args.baseline_max and isa == isas[0] and encoder == args.encoder[0],
                                     encoder)
                    finally:
                        codec.set_cpu_isa(in_use)
                    rows.append(r)
                    _print_cpu_row(r)
        del x
    print("memcpy = np.copyto into an existing array (counts the 4 * numel bytes read; it also writes as "
          "many); qsgd enc = encode into an existing buffer, including the checksum; qsgd dec = decode_sum "
          "into an existing array; ns/el = ns per element per thread (t * threads / numel); checksum = "
          "median of t(encode+decode with the checksum) / t(without) - 1, timed back to back per round; "
          "streamed = the same for decode with streaming stores against cached ones (qsgd dec: streaming "
          "from the size above); "
          f"'-' = not measured (baselines skipped above {fmt_size(args.baseline_max)} elements)")
    _print_roofline(rows)
    return rows


# ---- the subcommand ------------------------------------------------------------------------------
def run(args):
    if args.threads > 0:
        codec.set_num_threads(args.threads)
    checksum = not args.no_checksum
    info = machine_info()
    torch_text = (f"torch {info['torch']} ({info['torch_threads']} threads)" if info["torch"]
                  else "torch absent")
    in_use = codec.cpu_isa()
    isas = args.isa or [in_use]
    print(f"machine: {info['cpu']}, {info['cores']} cores ({info['usable_cores']} usable); codec threads "
          f"{info['codec_threads']}; numpy {info['numpy']}; {torch_text}; "
          f"load average {info['load_avg_1min']:.2f}")
    print(f"CPU kernels: variant in use {codec.cpu_isa()}; compiled: "
          + ", ".join(f"{n}{'' if ok else ' (not on this CPU)'}" for n, ok in codec.cpu_isas().items())
          + f"; timed: {', '.join(isas)}; decodes stream results of >= {codec.stream_bytes() / 2**20:.1f} MiB")
    if info["load_avg_1min"] > 0.5 * info["usable_cores"]:
        print("warning: other processes are using the CPUs (load average above half the usable cores); "
              "the timings below are shared with them")
    rows = []
    if args.device in ("all", "cpu"):
        rows = run_cpu(args, isas, in_use, checksum)
        if rows is None:
            return 1
    status, cuda = 0, dict(measured=False, reason=cuda_unavailable_reason(), rows=[])
    if args.device == "cpu":
        cuda["reason"] = "--device cpu"
    if cuda["reason"] is not None:
        print(f"\nCUDA: not measured ({cuda['reason']})")
        status = 1 if args.device == "cuda" else 0
    else:
        try:
            cuda.update(measured=True, rows=run_cuda(args.sizes, args.bits, args.bucket_size, args.repeats,
                                                     args.seed, checksum, args.encoder))
        except Exception as e:  # report, keep the CPU numbers, and fail the command
            cuda.update(measured=False, reason=f"failed: {e}")
            print(f"CUDA: not measured (failed: {e})")
            status = 1
    if args.json:
        config = dict(sizes=args.sizes, bits=args.bits, isa=isas, encoder=args.encoder, bucket_size=args.bucket_size, repeats=args.repeats,
                      baseline_max=args.baseline_max, checksum=checksum, seed=args.seed, gb=1e9)
        result = dict(machine=info, config=config, cpu=rows, cuda=cuda, load_avg_1min_end=os.getloadavg()[0])
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return status
