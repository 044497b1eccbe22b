"""Worker for tests/test_soak.py: thousands of TensorFlow steps through hvd_qsgd under horovodrun,
recording whatever could grow. tests/test_soak.py applies the rules.

Phases, ``PHASE[:STEPS[:WARMUP]]`` in the order given:

* ``tape``: a ``tf.function`` step with ``hvd.DistributedGradientTape(tape,
  compression=hvd_qsgd.QSGD(4, error_feedback=True))`` on plain variables (three above min_numel:
  12,800, 20,000 and 10,000 elements; five below);
* ``eager``: no ``tf.function``; each step ``hvd.allreduce(a, compression=c)`` and
  ``hvd.grouped_allreduce([a, b], compression=c)`` executing eagerly (c = ``hvd_qsgd.QSGD(4)``).

After the warm-up every step records this process's RSS (psutil) and its resident anonymous memory
outside malloc's heap into preallocated arrays; every
``SAMPLE`` steps the open file descriptors and the threads; at the start, the middle and the end of
the measured steps (after a full garbage collection) the pymalloc blocks and the bytes glibc's
malloc has handed out; at the start and the end the objects the garbage collector tracks, the live
``tf.Variable`` objects, the traces of the step function and the compressor's variables, traced
exchanges, sequence number and eager slots. Each rank prints ``SOAK <phase> <json>`` per phase.

The tape phase's warm-up is long (2000 steps by default) because TensorFlow itself keeps growing
for about that many calls of a ``tf.function``: its function-dispatch cache takes one or two pymalloc
blocks per call and about 0.5 MB of RSS until it is full (measured alike with
``--compression none``).

``--inject`` adds a deliberate leak: ``rss`` keeps a 4 KiB tensor per step; ``retrace`` calls the
step function with a new Python number every 100 steps (a new trace each time).
"""
import argparse
import gc
import json
import sys
import time

import numpy as np
import psutil
import tensorflow as tf
import horovod.tensorflow as hvd

import hvd_qsgd
from tests.mp.soak_memory import malloc_in_use, memory_fields, resident_outside_malloc

SAMPLE = 100
SHAPES = [(64, 200), (200,), (200, 100), (100,), (100, 100), (100,), (100, 10), (10,)]  # 12800, 20000, 10000
EAGER_NUMEL = (20000, 12000)
WARMUP = {"tape": 2000, "eager": 100}


def live_tf_variables():
    return sum(1 for o in gc.get_objects() if isinstance(o, tf.Variable))


def tape_phase(rank, inject, compression):
    """(step function, compressor, what to count, bytes a step allocates at the least)."""
    rng = np.random.default_rng(0)
    vs = [tf.Variable(rng.standard_normal(s).astype(np.float32) * 0.1) for s in SHAPES]
    c = hvd_qsgd.QSGD(4, error_feedback=True) if compression == "qsgd" else hvd.Compression.none
    data = np.random.default_rng(rank)
    batches = [(tf.constant(data.standard_normal((16, 64)).astype(np.float32)),
                tf.constant(data.integers(0, 10, 16))) for _ in range(8)]

    @tf.function
    def train_step(x, y, lr):
        with tf.GradientTape() as tape:
            h = tf.nn.relu(x @ vs[0] + vs[1])
            h = tf.nn.relu(h @ vs[2] + vs[3])
            h = tf.nn.relu(h @ vs[4] + vs[5])
            logits = h @ vs[6] + vs[7]
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        tape = hvd.DistributedGradientTape(tape, compression=c)
        grads = tape.gradient(loss, vs)
        for v, g in zip(vs, grads):
            v.assign_sub(lr * g)
        return loss

    def step(i):
        x, y = batches[i % len(batches)]
        train_step(x, y, 0.01 + 1e-9 * (i // 100) if inject == "retrace" else 0.01)

    def counts():
        return {"traces": train_step.experimental_get_tracing_count()}

    return step, c, counts, sum(4 * int(np.prod(s)) for s in SHAPES)


def eager_phase(rank):
    g = np.random.default_rng(rank)
    a, b = (tf.constant(g.standard_normal(k).astype(np.float32)) for k in EAGER_NUMEL)
    c = hvd_qsgd.QSGD(4)

    def step(i):
        hvd.allreduce(a, compression=c)
        hvd.grouped_allreduce([a, b], compression=c)

    return step, c, dict, 4 * (sum(EAGER_NUMEL) + EAGER_NUMEL[0])


def run_phase(phase, steps, warmup, inject, compression):
    rank = hvd.rank()
    proc = psutil.Process()
    step, c, counts, grad_bytes = tape_phase(rank, inject, compression) if phase == "tape" else eager_phase(rank)
    kept = []

    t0 = time.perf_counter()
    for i in range(warmup):
        step(i)
    adapter = c._adapters["tensorflow"] if isinstance(c, hvd_qsgd.QSGD) else None

    def state():
        st = dict(counts(), tf_variables=live_tf_variables(), blocks=sys.getallocatedblocks(),
                  objects=len(gc.get_objects()), malloc=malloc_in_use())
        if adapter is not None:
            st.update(variables=len(adapter.variables), traced_exchanges=len(adapter.traced_exchanges),
                      seq=adapter.names.seq, occurrences=len(adapter._occurrences), residuals=len(adapter.residuals),
                      eager_slots=len(adapter.names.slots))
        return st

    gc.collect()  # also empties the free lists: the block counts are what is still in use
    before = state()
    stats0 = c.stats if adapter is not None else None
    rss = np.zeros(steps, dtype=np.int64)   # preallocated: recording allocates nothing that outlives a step
    outside = np.zeros(steps, dtype=np.int64)
    fds, threads = [], []
    t1 = time.perf_counter()
    for j, i in enumerate(range(warmup, warmup + steps)):
        step(i)
        if inject == "rss":
            kept.append(tf.ones([1024]))
        rss[j] = proc.memory_info().rss
        outside[j] = resident_outside_malloc()
        if j % SAMPLE == 0 or j == steps - 1:
            fds.append(proc.num_fds())
            threads.append(proc.num_threads())
        if j == steps // 2:
            gc.collect()
            blocks_mid, malloc_mid = sys.getallocatedblocks(), malloc_in_use()
    t2 = time.perf_counter()
    gc.collect()
    after = state()
    kept.clear()
    payload_bytes = 0.0
    if adapter is not None:
        st = c.stats
        payload_bytes = (st["bytes_sent"] + st["bytes_received"]
                         - stats0["bytes_sent"] - stats0["bytes_received"]) / steps
    occurrence_values = [] if adapter is None else sorted({int(v.numpy()) for v in adapter._occurrences.values()})
    result = {
        "phase": phase, "rank": rank, "size": hvd.size(), "warmup": warmup, "steps": steps,
        "warmup_s": round(t1 - t0, 2), "measured_s": round(t2 - t1, 2),
        "step_bytes": int(grad_bytes + payload_bytes), "grad_bytes": grad_bytes, "payload_bytes": int(payload_bytes),
        **memory_fields(rss.tolist(), outside.tolist()),
        "blocks": [before["blocks"], blocks_mid, after["blocks"]],
        "malloc": [before["malloc"], malloc_mid, after["malloc"]],
        "fds": fds, "threads": threads, "before": before, "after": after, "occurrence_values": occurrence_values,
    }
    print(f"SOAK {phase} {json.dumps(result)}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("phases", nargs="+", help="PHASE[:STEPS[:WARMUP]], PHASE tape or eager")
    p.add_argument("--inject", choices=["rss", "retrace"])
    p.add_argument("--compression", choices=["qsgd", "none"], default="qsgd",
                   help="tape with none: the same steps with hvd.Compression.none, to tell TensorFlow's and "
                        "Horovod's own growth from the compressor's")
    args = p.parse_args()
    hvd.init()
    for spec in args.phases:
        phase, steps, warmup = (spec.split(":") + [None, None])[:3]
        if phase not in WARMUP:
            raise SystemExit(f"unknown phase {phase}")
        run_phase(phase, int(steps or 1500), int(warmup or WARMUP[phase]), args.inject, args.compression)


if __name__ == "__main__":
    main()
