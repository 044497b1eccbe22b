"""Worker for tests/test_hierarchical.py's TensorFlow case under horovodrun with
HVD_QSGD_RANKS_PER_NODE=2: the hierarchical reduction through Horovod's TensorFlow allreduce equals
the single-process reference of its three stages (``tests.references.hierarchical``, its cross
stage an allgather, as TensorFlow runs it) bit for bit on every rank, eagerly, in a traced step
with error feedback and in a traced tape step of three gradients, and where "auto" resolves to it; counts what it sent; ranks that disagree on the
layout raise on every rank; a join is carried through.
Prints ``OK <scenario>`` or ``RAISED <type>: <message>``."""
import os
import sys

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import hvd_qsgd
import hvd_qsgd.tensorflow
from hvd_qsgd import codec, protocol, reduction
from tests import references
from tests.mp.tf_graphs import foldable_collectives

SEED = 5
PER_NODE = 2


def gather(a, tag):
    return list(hvd.allgather(tf.constant(np.asarray(a, dtype=np.float32)[None]), name=f"test_gather_{tag}").numpy())


def exact():
    """Eager exchanges: odd lengths, shards of unequal size, one bucket (an empty shard), half
    precision, Sum and Average; bytes_sent as the stages send them."""
    rank, n = hvd.rank(), hvd.size()
    c = hvd_qsgd.tensorflow.QSGD(4, seed=SEED, reduction="hierarchical", min_numel=1)
    for seq, (numel, dtype, op) in enumerate(((20000, tf.float32, hvd.Average), (1001, tf.float32, hvd.Sum),
                                              (300, tf.float32, hvd.Average), (30001, tf.float16, hvd.Average))):
        x = np.random.default_rng(100 * rank + seq).standard_normal(numel).astype(np.float32)
        t = tf.cast(tf.constant(x), dtype)
        before = c.stats
        out = hvd.allreduce(t, compression=c, op=op, name=f"h{seq}")
        exchange = f"hvd_qsgd_{c._creation_index}_s{seq}"
        seeds = [protocol.payload_seed(SEED, r, exchange, 0) for r in range(n)]
        dname = {tf.float32: "float32", tf.float16: "float16"}[dtype]
        fp = codec.tensor_fingerprint("", [numel], dname)
        xs = gather(tf.cast(t, tf.float32).numpy(), seq)
        ref, sent = references.hierarchical(xs, c.settings, seeds, PER_NODE, 1.0 / n if op == hvd.Average else 1.0,
                                            fp, dname, cross_stage="allgather")
        assert out.dtype == dtype and out.shape == t.shape
        assert np.array_equal(out.numpy(), ref.astype(out.numpy().dtype)), \
            f"{numel} {dtype}: max diff {np.abs(tf.cast(out, tf.float32).numpy() - ref).max()}"
        copies = gather(tf.cast(out, tf.float32).numpy(), f"out{seq}")
        assert all(np.array_equal(y, copies[0]) for y in copies), "ranks differ"
        b, e = reduction.chunk_ranges(numel, c.settings.bucket_size, PER_NODE)[rank % PER_NODE]
        cross = sent[rank % PER_NODE][rank // PER_NODE]
        expected = 4 * (numel - (e - b)) + cross + 4 * (e - b) * (PER_NODE - 1)
        got = c.stats["bytes_sent"] - before["bytes_sent"]
        assert got == expected, (numel, got, expected)


def traced_error_feedback():
    """Two bits and error feedback over three steps of a tf.function: each rank keeps the residual
    of the shard it encodes, and every step equals the reference's."""
    rank, n = hvd.rank(), hvd.size()
    c = hvd_qsgd.tensorflow.QSGD(2, seed=SEED, reduction="hierarchical", min_numel=1, error_feedback=True)
    x = np.random.default_rng(rank).standard_normal(5001).astype(np.float32)
    step = tf.function(lambda v: hvd.allreduce(v, compression=c, name="ef"))
    xs = gather(x, "ef")
    residuals = {}
    for k in range(3):
        out = step(tf.constant(x))
        exchange = c.traced_exchanges[-1][0]
        seeds = [protocol.payload_seed(SEED, r, exchange, k) for r in range(n)]
        ref, _ = references.hierarchical(xs, c.settings, seeds, PER_NODE, 1.0 / n,
                                         codec.tensor_fingerprint("", [5001], "float32"), residuals=residuals,
                                         cross_stage="allgather")
        assert np.array_equal(out.numpy(), ref), f"step {k}: max diff {np.abs(out.numpy() - ref).max()}"
    (mine,) = [v.numpy() for v in c.residuals.residuals.values()]
    assert np.array_equal(mine, residuals[(rank // PER_NODE, rank % PER_NODE)]), "residual"
    gd = step.get_concrete_function(tf.TensorSpec([5001], tf.float32)).graph.as_graph_def()
    assert not foldable_collectives(gd), foldable_collectives(gd)  # every collective runs at every step


def tape_step():
    """Horovod's gradient tape in a tf.function, three gradients in one step, two steps: each
    exchange equals its reference. (Grappler rewrites these branches, renaming their ops after the
    ``Case`` op: under the last component of its name alone, Horovod took the three exchanges'
    collectives for one tensor's.)"""
    rank, n = hvd.rank(), hvd.size()
    c = hvd_qsgd.tensorflow.QSGD(4, seed=SEED, reduction="hierarchical", min_numel=1)
    sizes = (20000, 5001, 30001)
    ws = [np.random.default_rng(10 * rank + i).standard_normal(m).astype(np.float32) for i, m in enumerate(sizes)]
    vs = [tf.Variable(tf.zeros([m])) for m in sizes]

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * w) for v, w in zip(vs, ws)])
        return hvd.DistributedGradientTape(tape, compression=c).gradient(loss, vs)
    wanted = [gather(w, f"tape{i}") for i, w in enumerate(ws)]
    for k in range(2):
        outs = step()
        exchanges = [name for name, _ in c.traced_exchanges[-len(sizes):]]
        for out, xs, m, exchange in zip(outs, wanted, sizes, exchanges):
            seeds = [protocol.payload_seed(SEED, r, exchange, k) for r in range(n)]
            ref, _ = references.hierarchical(xs, c.settings, seeds, PER_NODE, 1.0 / n,
                                             codec.tensor_fingerprint("", [m], "float32"), cross_stage="allgather")
            assert np.array_equal(out.numpy(), ref), f"step {k}, {m} elements: max diff {np.abs(out.numpy() - ref).max()}"


def auto():
    """reduction="auto" on nodes of 2 ranks, told the link inside a node is 200 Gbit/s
    (HVD_QSGD_INTRA_GBITS, alike on every rank): a 1M-element tensor resolves to the hierarchical
    reduction, as in PyTorch, and equals its reference."""
    rank, n = hvd.rank(), hvd.size()
    c = hvd_qsgd.tensorflow.QSGD(4, seed=SEED)
    numel = 1 << 20
    x = np.random.default_rng(7 + rank).standard_normal(numel).astype(np.float32)
    os.environ["HVD_QSGD_INTRA_GBITS"] = "200"
    try:
        assert c.settings.exchange_reduction(n, numel, PER_NODE, "cpu") == "hierarchical"
        out = hvd.allreduce(tf.constant(x), compression=c, name="auto")
    finally:
        del os.environ["HVD_QSGD_INTRA_GBITS"]
    seeds = [protocol.payload_seed(SEED, r, f"hvd_qsgd_{c._creation_index}_s0", 0) for r in range(n)]
    ref, _ = references.hierarchical(gather(x, "auto"), c.settings, seeds, PER_NODE, 1.0 / n,
                                     codec.tensor_fingerprint("", [numel], "float32"), cross_stage="allgather")
    assert np.array_equal(out.numpy(), ref), f"auto: max diff {np.abs(out.numpy() - ref).max()}"


def layouts_differ():
    os.environ["HVD_QSGD_RANKS_PER_NODE"] = "1" if hvd.rank() == 0 else str(PER_NODE)
    c = hvd_qsgd.tensorflow.QSGD(4, reduction="hierarchical")
    try:
        hvd.allreduce(tf.random.normal([20000]), compression=c, name="differ")
    except tf.errors.InvalidArgumentError as e:
        print(f"RAISED {type(e).__name__}: {' '.join(e.message.split())[:300]}", flush=True)
        return False
    finally:
        os.environ["HVD_QSGD_RANKS_PER_NODE"] = str(PER_NODE)
    raise AssertionError("ranks with different layouts did not raise")


def joined():
    """The last rank has no data and joins at once: the others' hierarchical exchanges, eager and
    traced, are carried through the join as Horovod's joined allreduce (zeros for the joined rank,
    Average dividing by the set's size): their own tensors, in float32, summed (exact for these
    integers), each counted as a joined exchange. Last in its launch: Horovod 0.28.1 carries one
    uneven join per process."""
    rank, n = hvd.rank(), hvd.size()
    if rank < n - 1:
        c = hvd_qsgd.tensorflow.QSGD(4, seed=SEED, reduction="hierarchical")
        x = tf.constant(np.full(20000, rank + 1, np.float32))
        want = np.full(20000, sum(range(1, n)) / n, np.float32)
        eager = hvd.allreduce(x, compression=c, name="joined_eager")
        traced = tf.function(lambda v: hvd.allreduce(v, compression=c, name="joined_traced"))(x)
        for got in (eager, traced):
            assert np.array_equal(got.numpy(), want), got.numpy()[:4]
        assert c.stats["joined_exchanges"] == 2 and c.stats["tensors"] == 0, c.stats
    assert 0 <= hvd.join() < n - 1


def main():
    hvd.init()
    for name in sys.argv[1:]:
        if {"exact": exact, "traced-error-feedback": traced_error_feedback, "tape-step": tape_step,
                "auto": auto,
                "layouts-differ": layouts_differ, "joined": joined}[name]() is not False:
            print(f"OK {name}", flush=True)


if __name__ == "__main__":
    main()
