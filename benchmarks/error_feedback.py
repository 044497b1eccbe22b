"""``python -m benchmarks error-feedback``: the CPU's error-feedback encode, composed against fused.

A worker with error feedback sends q = encode(v) for v = g + e and keeps e = v - decode(q) where that
is finite. Side by side in one run, per size and instruction-set variant of the CPU kernels (``--isa``,
as ``benchmarks kernels`` takes it):

- composed: the steps as NumPy and separate codec calls run them (v = x + e; encode; decode_sum of q
  accumulated into v with alpha -1; the finite select into e): what the CPU backend did before the
  fused kernel, kept here as the reference;
- fused: ``error_feedback.encode``, one native call (``qsgd_encode_ef_cpu``: the fixed coding works
  per chunk of about 32K elements, in cache);
- encode: ``codec.encode_prepared`` of x alone, the price of an encode without error feedback.

Before timing, the composed and fused results (payload bytes, residual bits) are checked equal. Each
time is the median of ``--repeats`` runs after a warm-up; "composed/fused" is the median over rounds
of the two timed back to back (``kernels.paired_ratio``), so that load changing during the run
affects both alike. Every row names the CPU and the variant.
"""
import json

import numpy as np

from hvd_qsgd import codec, error_feedback
from benchmarks import kernels
from benchmarks.common import bit_widths, positive_int


def add_arguments(p):
    p.add_argument("--sizes", type=kernels.parse_sizes, default="20000,1M,8M",
                   help="fp32 element counts, comma-separated; K/M/G = 2^10/2^20/2^30 (default %(default)s)")
    p.add_argument("--bits", type=bit_widths(1), default="4", help="bit widths in 1..8 (default %(default)s)")
    p.add_argument("--bucket-size", type=positive_int, default=512, help="elements per scale (default %(default)s)")
    p.add_argument("--coding", choices=("fixed", "elias"), default="fixed", help="the payload coding (default fixed)")
    p.add_argument("--repeats", type=positive_int, default=21,
                   help="timed runs per measurement, after one warm-up (default %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="codec CPU threads (0: the codec's default)")
    p.add_argument("--isa", type=kernels.parse_isas, default=None,
                   help="CPU kernel variants to time side by side, comma-separated, or 'all' (default: the one in use)")
    p.add_argument("--json", metavar="PATH", help="also write every number to this JSON file")


def composed(prepared, x, seed, residual):
    """The steps one by one (the reference): v = x + e, q = encode(v), e = v - decode(q) where finite."""
    v = x + residual
    q = codec.encode_prepared(prepared, v, seed)
    codec.decode_sum([q], -1.0, out=v, accumulate=True)
    error_feedback.keep_where_finite(residual, v)
    return q


def measure(n, bits, bucket, coding, repeats):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n, dtype=np.float32)
    e0 = (0.1 * rng.standard_normal(n)).astype(np.float32)
    prepared = codec.prepare(n, bits, bucket, coding=coding)
    r_a, r_b = e0.copy(), e0.copy()
    q_a, q_b = composed(prepared, x, 7, r_a), error_feedback.encode(prepared, x, 7, r_b)
    if not (np.array_equal(q_a, q_b) and np.array_equal(r_a.view(np.uint32), r_b.view(np.uint32))):
        raise SystemExit(f"self-check FAILED at {n} elements, {bits} bits: the fused encode differs from the steps")
    e_a, e_b = e0.copy(), e0.copy()   # (the residual stays bounded: re-running a step is a fair load)
    t_comp, _ = kernels.median_time(lambda: composed(prepared, x, 7, e_a), repeats)
    t_fused, _ = kernels.median_time(lambda: error_feedback.encode(prepared, x, 7, e_b), repeats)
    t_enc, _ = kernels.median_time(lambda: codec.encode_prepared(prepared, x, 7), repeats)
    ratio = kernels.paired_ratio(lambda: composed(prepared, x, 7, e_a),
                                 lambda: error_feedback.encode(prepared, x, 7, e_b), repeats)
    return dict(n=n, bits=bits, composed_us=1e6 * t_comp, fused_us=1e6 * t_fused, encode_us=1e6 * t_enc,
                composed_over_fused=ratio)


def run(args):
    if args.threads:
        codec.set_num_threads(args.threads)
    in_use = codec.cpu_isa()
    isas = args.isa or [in_use]
    info = kernels.machine_info()
    print(f"cpu: {info['cpu']}; codec threads {codec.get_num_threads()}; load {info['load_avg_1min']:.2f}")
    print(f"config: bucket {args.bucket_size}, {args.coding} coding, norm max, checksum on; "
          f"median of {args.repeats} after 1 warm-up")
    print(f"{'isa':>8} {'elements':>9} {'bits':>4} {'composed us':>12} {'fused us':>10} {'encode us':>10} "
          f"{'composed/fused':>15} {'fused/encode':>13}")
    rows = []
    for isa in isas:
        codec.set_cpu_isa(isa)
        try:
            for n in args.sizes:
                for bits in args.bits:
                    r = dict(measure(n, bits, args.bucket_size, args.coding, args.repeats), isa=isa)
                    rows.append(r)
                    print(f"{isa:>8} {n:>9} {bits:>4} {r['composed_us']:>12.1f} {r['fused_us']:>10.1f} "
                          f"{r['encode_us']:>10.1f} {r['composed_over_fused']:>15.2f} "
                          f"{r['fused_us'] / r['encode_us']:>13.2f}")
        finally:
            codec.set_cpu_isa(in_use)
    print("composed/fused: median over rounds of the two timed back to back; fused/encode: what error "
          "feedback adds to an encode of the same size")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=info, config=vars(args) | dict(isa=isas), rows=rows), f, indent=1, default=str)
    return 0
