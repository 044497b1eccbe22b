"""``python -m benchmarks overhead --codec-calls``: what one codec call costs a gradient, by size.

The CPU kernels through their C ABI (ctypes, one thread: encode, and the decode-sum of one payload)
and the calls a gradient's exchange makes around them (``codec.encode``; the CPU backend's decode of
an allgather's payloads, 2 and 16 of them; a hierarchical shard's decode from 2 nodes), each the
minimum over 7 rounds of a timed loop, in microseconds. Each tree in ``--trees`` runs in a process of
its own, ``--repeats`` times in ABBA order, and a cell gives every run's value: small calls are
where fixed costs (an OpenMP region, Python per payload) show, and where they vary from run to run.
"""
import json
import os
import timeit

SIZES = (2000, 20000, 200000)


def worker(args):
    """Every call's time (us) as JSON on stdout's last line."""
    import ctypes
    import numpy as np
    from hvd_qsgd import _native, backends, codec
    from hvd_qsgd.codec_params import config_template
    from hvd_qsgd.exchange.chains import expectation
    from hvd_qsgd.settings import Settings
    codec.set_num_threads(1)
    lib, number, rng = _native.load(), args.number, np.random.default_rng(0)
    cfg = _native.Config.from_buffer_copy(config_template(4, 512, "max", "fixed", True, 2))
    length, out = ctypes.c_uint64(0), {}

    def best(stmt, **names):
        return 1e6 * min(timeit.repeat(stmt, globals=dict(names, lib=lib, ctypes=ctypes, codec=codec,
                                                          backends=backends), number=number, repeat=7)) / number

    for n in SIZES:
        x = rng.standard_normal(n).astype(np.float32)
        buf, dec = np.empty(n, np.uint8), np.empty(n, np.float32)
        xa, ba, da = x.ctypes.data, buf.ctypes.data, dec.ctypes.data
        lib.qsgd_encode_cpu(xa, n, ctypes.byref(cfg), ba, buf.size, ctypes.byref(length))
        ptrs, lens = (ctypes.c_void_p * 1)(ba), (ctypes.c_uint64 * 1)(length.value)
        out[f"encode kernel, {n}"] = best("lib.qsgd_encode_cpu(xa, n, ctypes.byref(cfg), ba, size, ctypes.byref(length))",
                                          xa=xa, n=n, cfg=cfg, ba=ba, size=buf.size, length=length)
        out[f"decode kernel, {n}"] = best("lib.qsgd_decode_sum_cpu(ptrs, lens, 1, 1.0, da, n, 0)",
                                          ptrs=ptrs, lens=lens, da=da, n=n)
        out[f"codec.encode, {n}"] = best("codec.encode(x, seed=3, fingerprint=5)", x=x)
    for count, n in ((2, 20000), (16, 20000), (2, 2500)):
        x = rng.standard_normal(n).astype(np.float32)
        payloads = [codec.encode(x, fingerprint=5, seed=r) for r in range(count)]
        gathered, expect = np.concatenate(payloads), expectation(Settings(), n, "float32", 5)
        if n == 20000:
            out[f"decode_gathered, {count} x {n}"] = best("backends.CPU.decode_gathered(g, c, size, 0.5, e, 'w')",
                                                          g=gathered, c=count, size=payloads[0].size, e=expect)
        else:
            out[f"decode_report, {count} x {n}"] = best("backends.CPU.decode_report(g, lens, c, e, 'w')", g=gathered,
                                                        lens=[p.size for p in payloads], c=count, e=expect)
    print(json.dumps(out))


def run(args, trees):
    """Launch the worker in each tree (ABBA, ``--repeats`` rounds) and print the table."""
    from benchmarks.common import REPO_ROOT, machine_info, tree_runs
    table = tree_runs(trees, args.repeats, ["--codec-calls-worker", "--steps", str(args.steps)])
    if table is None:
        return 1
    rows = list(dict.fromkeys(key for _, key in table))
    info = machine_info()
    names = [os.path.relpath(t, REPO_ROOT) if t.startswith(REPO_ROOT) else t for t in trees]
    print(f"{info['cpu']}, load {info['load_avg_1min']:.1f}; one thread; us a call (the best of 7 rounds of "
          f"{args.steps}), every run, {args.repeats} per tree in ABBA order")
    print("| call (elements) | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(trees))
    for key in rows:
        print(f"| {key} | " + " | ".join(", ".join(f"{v:.1f}" for v in table.get((t, key), [])) or "-"
                                         for t in trees) + " |")
    return 0
