"""The bytes hvd_qsgd puts on the wire for a fixed set of inputs, as SHA-256 digests.

``golden_payloads.py torch|tensorflow`` under ``horovodrun -np 2`` prints one line
``GOLDEN <rank> <json>`` per rank: for every case, the digest of every payload this rank handed to
Horovod's collectives (allgather and alltoall, sorted: the order in which a rank starts the
collectives of several exchanges in flight depends on when their presence allreduces complete, the
bytes do not) and of the results it decoded (in order). Rank 0
adds the codec's own payloads (``codec.encode``, ``reduction.encode_chunks``/``reduce_chunk``) over a
grid of settings. These cases run with ``encoder=1``, the encoder of earlier releases:
tests/test_golden_payloads.py compares them with digests recorded before the package was restructured
(tests/data/golden_payloads.json): the restructuring keeps every byte, and encoder=1 is that encoder.

Then the same cases run again with ``encoder=2`` (the default) and each rank prints
``GOLDEN-ENCODER2 <rank> <json>``, compared with the set recorded when encoder version 2 came
(the file's "encoder2" key). They run after the encoder-1 cases in the same job, so their
compressors are numbered after those (the number is part of their exchange names, hence seeds).

Only public entry points are used (``hvd_qsgd.QSGD``, ``DynamicQSGD``, ``BlockSign``, the codec); with
``encoder=`` left out, the encoder-1 cases are the script that ran on the code before.
"""
import functools
import hashlib
import json
import sys

import numpy as np


def digest(chunks):
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()


def rank_input(rank, step, numel, seed=0):
    rng = np.random.default_rng(1000 * seed + 10 * rank + step)
    x = rng.standard_normal(numel).astype(np.float32)
    x[:: 97] *= 30.0          # some large entries: several levels and buckets differ
    x[5:40] = 0.0             # a run of zeros (Elias gaps)
    return x


def record(module, functions, sent, as_bytes):
    """Replace ``module``'s collectives ``functions`` by ones that append the bytes of the tensor
    they are handed to ``sent`` (in call order) before calling the real one."""
    def recording(fn):
        def call(tensor, *args, **kwargs):
            sent.append(as_bytes(tensor))
            return fn(tensor, *args, **kwargs)
        return call

    for name in functions:
        setattr(module, name, recording(getattr(module, name)))


def codec_cases(encoder):
    from hvd_qsgd import codec, reduction
    from hvd_qsgd import Settings
    out = {}
    x = rank_input(0, 0, 5000)
    for bits in range(1, 9):
        for norm in ("max", "l2", "sign"):
            for coding in ("fixed", "elias"):
                for bucket in (64, 512):
                    try:
                        codec.make_config(bits, bucket, norm, 0, coding)
                    except ValueError:
                        continue
                    for dtype in ("float32", "float16", "bfloat16"):
                        p = codec.encode(x, bits, bucket, norm, seed=12345 + bits, coding=coding,
                                         fingerprint=77, checksum=(bits % 2 == 0), source_dtype=dtype,
                                         encoder=encoder)
                        out[f"encode/{bits}/{norm}/{coding}/{bucket}/{dtype}"] = digest([p.tobytes()])
    for bits, norm, coding in ((4, "max", "fixed"), (2, "l2", "elias"), (1, "sign", "fixed"), (8, "max", "fixed")):
        s = Settings.make(bits=bits, bucket_size=128, norm=norm, coding=coding, encoder=encoder)
        xs = [rank_input(r, 1, 3000) for r in range(3)]
        sent = [reduction.split_by(*reduction.encode_chunks(x, s, 99 + r, 3, fingerprint=5)) for r, x in enumerate(xs)]
        reduced = []
        for j in range(3):
            begin, end = reduction.chunk_ranges(3000, 128, 3)[j]
            residual = np.full(end - begin, 0.01, np.float32)
            q = reduction.reduce_chunk([sent[r][j] for r in range(3)], j, s, 7 + j, fingerprint=5)
            q_ef = reduction.reduce_chunk([sent[r][j] for r in range(3)], j, s, 7 + j, fingerprint=5,
                                          residual=residual)
            reduced += [q.tobytes(), q_ef.tobytes(), residual.tobytes()]
        out[f"chunks/{bits}/{norm}/{coding}"] = digest([p.tobytes() for ps in sent for p in ps] + reduced)
    return out


def compressors(encoder):
    """hvd_qsgd's QSGD, DynamicQSGD and BlockSign, made with ``encoder``."""
    import hvd_qsgd
    return tuple(functools.partial(make, encoder=encoder)
                 for make in (hvd_qsgd.QSGD, hvd_qsgd.DynamicQSGD, hvd_qsgd.BlockSign))


def torch_cases(encoder, sent):
    import torch
    import horovod.torch as hvd

    rank = hvd.rank()
    QSGD, DynamicQSGD, BlockSign = compressors(encoder)
    cases = {
        "qsgd4-named": (lambda named: QSGD(4, named_parameters=named), 2, torch.float32, hvd.Average),
        "qsgd2-unnamed": (lambda named: QSGD(2), 2, torch.float32, hvd.Average),
        "qsgd8-l2-nochecksum-sum": (lambda named: QSGD(8, norm="l2", checksum=False), 1, torch.float32, hvd.Sum),
        "qsgd4-elias": (lambda named: QSGD(4, coding="elias", named_parameters=named), 2, torch.float32,
                        hvd.Average),
        "qsgd3-ef": (lambda named: QSGD(3, error_feedback=True, named_parameters=named), 3, torch.float32,
                     hvd.Average),
        "qsgd4-fp16": (lambda named: QSGD(4), 1, torch.float16, hvd.Average),
        "qsgd4-bf16-ef": (lambda named: QSGD(4, error_feedback=True), 2, torch.bfloat16, hvd.Average),
        "qsgd4-scatter": (lambda named: QSGD(4, reduction="scatter_allgather"), 2, torch.float32, hvd.Average),
        "qsgd4-scatter-elias": (lambda named: QSGD(4, coding="elias", reduction="scatter_allgather",
                                                   named_parameters=named), 2, torch.float32, hvd.Average),
        "qsgd4-scatter-ef-server": (lambda named: QSGD(4, reduction="scatter_allgather", error_feedback=True,
                                                       server_error_feedback=True, named_parameters=named),
                                    3, torch.float32, hvd.Average),
        "dqsgd": (lambda named: DynamicQSGD(3.0, named_parameters=named), 4, torch.float32, hvd.Average),
        "dqsgd-horizon-ef": (lambda named: DynamicQSGD(3.0, discount=0.9, total_steps=4, error_feedback=True),
                             4, torch.float32, hvd.Average),
        "blocksign": (lambda named: BlockSign(named_parameters=named), 3, torch.float32, hvd.Average),
        "blocksign-allgather": (lambda named: BlockSign(reduction="allgather"), 2, torch.float32, hvd.Average),
    }
    out = {}
    for case, (make, steps, dtype, op) in cases.items():
        w = torch.nn.Parameter(torch.zeros(20000, dtype=dtype))
        b = torch.nn.Parameter(torch.zeros(12345, dtype=dtype))
        c = make([("w", w), ("b", b)])
        sent.clear()
        results = []
        for step in range(steps):
            pending = []
            for i, p in enumerate((w, b)):
                p.grad = torch.from_numpy(rank_input(rank, step, p.numel(), seed=i)).to(dtype)
                ctrl, ctx = c.compress(p.grad)
                pending.append((hvd.allreduce_async(ctrl, op=op, name=f"golden.{case}.{step}.{i}"), ctx))
            for handle, ctx in pending:
                r = c.decompress(hvd.synchronize(handle), ctx)
                results.append(r.detach().float().numpy().tobytes())
        out[case] = {"sent": digest(sorted(sent)), "decoded": digest(results), "payloads": len(sent),
                     "bytes_sent": c.stats["bytes_sent"]}
    return out


def tensorflow_cases(encoder, sent):
    import tensorflow as tf
    import horovod.tensorflow as hvd

    rank = hvd.rank()
    QSGD, _, BlockSign = compressors(encoder)
    cases = {
        "tf-qsgd4": (lambda: QSGD(4), 2, tf.float32),
        "tf-qsgd2-elias": (lambda: QSGD(2, coding="elias"), 1, tf.float32),
        "tf-qsgd8-l2-fp16": (lambda: QSGD(8, norm="l2"), 1, tf.float16),
        "tf-qsgd4-scatter": (lambda: QSGD(4, reduction="scatter_allgather"), 2, tf.float32),
        "tf-blocksign": (lambda: BlockSign(server_error_feedback=False, error_feedback=False), 1,
                         tf.float32),
    }
    out = {}
    for case, (make, steps, dtype) in cases.items():
        c = make()
        sent.clear()
        results = []
        for step in range(steps):
            for i, numel in enumerate((20000, 12345)):
                x = tf.cast(tf.constant(rank_input(rank, step, numel, seed=i)), dtype)
                ctrl, ctx = c.compress(x)
                r = c.decompress(hvd.allreduce(ctrl, op=hvd.Average, name=f"golden.{case}.{step}.{i}"), ctx)
                results.append(tf.cast(r, tf.float32).numpy().tobytes())
        out[case] = {"sent": digest(sorted(sent)), "decoded": digest(results), "payloads": len(sent),
                     "bytes_sent": c.stats["bytes_sent"]}
    return out


def main():
    framework = sys.argv[1]
    sent = []
    if framework == "torch":
        import horovod.torch as hvd
        hvd.init()
        record(hvd, ("allgather_async", "alltoall_async"), sent,
               lambda t: t.detach().cpu().contiguous().numpy().tobytes())
        cases = torch_cases
    else:
        import horovod.tensorflow as hvd
        hvd.init()
        from horovod.tensorflow import mpi_ops   # (the exchange's collectives are Horovod's ops)
        record(mpi_ops, ("allgather", "alltoall"), sent, lambda t: t.numpy().tobytes())
        cases = tensorflow_cases
    for encoder, label in ((1, "GOLDEN"), (2, "GOLDEN-ENCODER2")):
        result = cases(encoder, sent)
        if hvd.rank() == 0 and framework == "torch":
            result.update(codec_cases(encoder))
        print(f"{label} {hvd.rank()} {json.dumps(result, sort_keys=True)}", flush=True)


if __name__ == "__main__":
    main()
