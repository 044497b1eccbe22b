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

With ``--members K``, each size is a fusion buffer of K members (each its share, at a multiple of
the bucket size) with their residuals, and the three are: staged (the members copied into a
staging array kept from call to call, their residuals into a new one, zeros between, and the fused
call on those: what a buffer with error feedback did before 2026-11-29), segmented (``error_feedback.encode_members``, kernel
``qsgd_encode_segments_ef_cpu``: the members and residuals read and updated where they are), and
the encode of the members alone (``codec_segments.encode``).

With ``--framework tensorflow``, the same three as TensorFlow graph ops (``benchmarks.error_feedback_tf``:
the adapter's former ops composed against ``QsgdEncodeEf``), with the variant the op library loaded.

Before timing, the composed and fused results (payload bytes, residual bits) are checked equal. Each
time is the median of ``--repeats`` runs after a warm-up; "composed/fused" is the median over rounds
of the two timed back to back (``kernels.paired_ratio``), so that load changing during the run
affects both alike. Every row names the CPU and the variant.
"""
import functools
import json

import numpy as np

from hvd_qsgd import codec, codec_segments, error_feedback
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
    p.add_argument("--members", type=int, default=0,
                   help="time a fusion buffer of this many members, staged against segmented (default 0: a tensor)")
    p.add_argument("--framework", choices=("numpy", "tensorflow"), default="numpy",
                   help="the CPU backend's native calls, or the TensorFlow ops in a tf.function (default numpy)")
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


def staged(prepared, members, seed, residuals, stage, valid=True):
    """A buffer with error feedback as it was encoded before: its members copied into the group's
    staging array ``stage`` (kept from step to step, zeros between), their residuals into a new
    array, the fused call, each member's residual its slice of the result."""
    x, e = stage[:members.numel], np.zeros(members.numel, np.float32)
    end = 0
    for p, r, o in zip(members.parts, residuals, members.offsets):
        x[end:o] = 0
        x[o:o + p.size], e[o:o + p.size] = p, r
        end = o + p.size
    q = error_feedback.encode(prepared, x, seed, e, valid)
    return q, [e[o:o + p.size] for p, o in zip(members.parts, members.offsets)]


def measure_buffer(n, bits, bucket, coding, repeats, k):
    if coding != "fixed":
        raise SystemExit("--members: a segmented encode takes the fixed coding")
    share = max(1, n // k - bucket // 2)   # (each member its share, less half a bucket: gaps between)
    offsets = [i * (-(-share // bucket) * bucket) for i in range(k)]
    numel = offsets[-1] + share
    rng = np.random.default_rng(n)
    parts = [rng.standard_normal(share, dtype=np.float32) for _ in range(k)]
    res0 = [(0.1 * rng.standard_normal(share)).astype(np.float32) for _ in range(k)]
    members = codec_segments.Members(parts, offsets, numel)
    prepared = codec.prepare(numel, bits, bucket, coding=coding)
    stage = np.empty(numel, np.float32)
    q_a, r_a = staged(prepared, members, 7, res0, stage)
    r_b = [r.copy() for r in res0]
    q_b = error_feedback.encode_members(prepared, members, r_b, 7)
    if not (np.array_equal(q_a, q_b) and all(np.array_equal(a, b) for a, b in zip(r_a, r_b))):
        raise SystemExit(f"self-check FAILED at {n} elements, {k} members: the segmented encode differs from staged")
    t_staged, _ = kernels.median_time(lambda: staged(prepared, members, 7, r_b, stage), repeats)
    t_seg, _ = kernels.median_time(lambda: error_feedback.encode_members(prepared, members, r_b, 7), repeats)
    t_enc, _ = kernels.median_time(lambda: codec_segments.encode(prepared, members, 7), repeats)
    ratio = kernels.paired_ratio(lambda: staged(prepared, members, 7, r_b, stage),
                                 lambda: error_feedback.encode_members(prepared, members, r_b, 7), repeats)
    return dict(n=numel, bits=bits, composed_us=1e6 * t_staged, fused_us=1e6 * t_seg, encode_us=1e6 * t_enc,
                composed_over_fused=ratio)


def run(args):
    in_use = codec.cpu_isa()
    isas = args.isa or [in_use]
    timer = measure
    if args.framework == "tensorflow":   # the op library's variant and threads are its own, chosen as it loads
        if isas != [in_use] or args.threads:
            raise SystemExit("--framework tensorflow times the variant the op library loads: set HVD_QSGD_ISA "
                             "(and OMP_NUM_THREADS) instead of --isa and --threads, one run each")
        from benchmarks import error_feedback_tf
        timer = error_feedback_tf.measure
    if args.members:
        if args.framework != "numpy" or args.members < 1:
            raise SystemExit("--members: a positive count, with --framework numpy")
        timer = functools.partial(measure_buffer, k=args.members)
    if args.threads:
        codec.set_num_threads(args.threads)
    info = kernels.machine_info()
    print(f"cpu: {info['cpu']}; codec threads {codec.get_num_threads()}; load {info['load_avg_1min']:.2f}")
    print(f"config: {args.framework}, bucket {args.bucket_size}, {args.coding} coding, norm max, checksum on; "
          f"median of {args.repeats} after 1 warm-up")
    names = ("staged", "segmented") if args.members else ("composed", "fused")
    if args.members:
        print(f"a fusion buffer of {args.members} members")
    print(f"{'isa':>8} {'elements':>9} {'bits':>4} {names[0] + ' us':>12} {names[1] + ' us':>12} {'encode us':>10} "
          f"{names[0] + '/' + names[1]:>18} {names[1] + '/encode':>17}")
    rows = []
    for isa in isas:
        codec.set_cpu_isa(isa)
        try:
            for n in args.sizes:
                for bits in args.bits:
                    r = dict(timer(n, bits, args.bucket_size, args.coding, args.repeats), isa=isa)
                    rows.append(r)
                    print(f"{isa:>8} {r['n']:>9} {bits:>4} {r['composed_us']:>12.1f} {r['fused_us']:>12.1f} "
                          f"{r['encode_us']:>10.1f} {r['composed_over_fused']:>18.2f} "
                          f"{r['fused_us'] / r['encode_us']:>17.2f}")
        finally:
            codec.set_cpu_isa(in_use)
    print(f"{names[0]}/{names[1]}: median over rounds of the two timed back to back; {names[1]}/encode: what "
          "error feedback adds to an encode of the same size")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=info, config=vars(args) | dict(isa=isas), rows=rows), f, indent=1, default=str)
    return 0
