"""A TensorFlow exchange from its reduced control vector to its result, as graph ops (eagerly, the
same ops run in turn)::

    alpha, joined = QsgdCheckControl(reduced)      the verdict, the same on every rank (or an error
                                                   on every rank alike)
    joined == 0:  the reduction's chain (``chains.run_stages``), its first collective ordered after
                  alpha (a rank never waits on a collective another rank did not start)
    joined == 1:  ranks of the set have called ``hvd.join()``: alpha * Horovod's Sum of the stepping
                  ranks' own payloads, dequantized (the joined ranks add zeros)

in a ``Case`` op on ``joined`` (``GraphRun.switch``; DQSGD: each path a switch on the bits chosen in
compress). A compressor made with ``join=False`` gives ``hvd.join()`` up: its exchange is the chain
alone, and QsgdCheckControl fails the step, on every stepping rank, where ranks have joined.
QsgdCheckControl runs inline, in the thread that finished the control vector's allreduce, and gives
``joined`` as the branch index itself (no cast between them).

A join is carried through as PyTorch's runner does (``hvd_qsgd.exchange.joined``): Horovod carries
its allreduce through a join, and no allgather or alltoall. The control vector, reduced at every
step, shows which ranks stepped; QsgdCheckControl checks it as theirs (the native checks of
``protocol.joined_verdict``) and tells a join from an allreduce over a smaller process set by the
op's scale (Average divides by the set's size after a join); for Sum, by where the process set came
from (``sum_join``): Horovod's own call (``horovod_caller``) reduces over the set it names, so a Sum
that misses ranks of it is a join. Outside Horovod's calls such a Sum fails the step, naming both
causes. A traced exchange cannot wait a while for a presence allreduce as PyTorch's runner does.

Where a gradient tape records the compressed tensor (``hvd.allreduce`` in a model's forward pass),
the result is differentiable as Horovod's allreduce is (``with_gradient``).
"""
import tensorflow as tf
import horovod.tensorflow as hvd
from tensorflow.python.eager import record   # (whether a gradient tape is recording: ``taped``)

from hvd_qsgd import _tf_ops as qops, cost_model, protocol
from hvd_qsgd.exchange.chains import run_stages
from hvd_qsgd.exchange.joined import joined_refusal, note_joined


# what the control op says of a disagreement on each tag of the control vector (the runner's words)
TAG_EXPLANATIONS = [protocol.tag_explanation(name) for name in protocol.TAG_NAMES]


def reduced(run, ctx, control):
    """The exchange ``ctx``'s result, float32 of its elements, once ``control`` (the control vector
    as Horovod's allreduce returned it) has been checked; what nothing reads (statistics, timing)
    among the operations ``run`` collects. With ``join=False`` the chain alone, no conditional: the
    check fails the step where ranks have joined."""
    join = ctx.variants[0].join
    alpha, joined = qops.load().qsgd_check_control(
        tf.cast(control, tf.float64), world=hvd.size(), set_ranks=ctx.set_ranks, tag_names=TAG_EXPLANATIONS,
        where=ctx.where, sum_join=ctx.sum_join, join=join)
    ctx.alpha = alpha
    if not join:
        return stepping(run, ctx, alpha)
    saved = [(ex.payload, ex.splits) for ex in ctx.exchanges]   # (the stages take them)
    return run.switch(joined, [lambda: stepping(run, ctx, alpha), lambda: joined_ranks(run, ctx, alpha, saved)])


def taped(tensor):
    """``tensor``, where a gradient tape may record what is computed now (``hvd.allreduce`` in a
    model's forward pass; not Horovod's allreduce of the gradients, which runs after the tape has
    stopped), or in a v1 graph, where ``tf.gradients`` may differentiate anything later (it found no
    gradient: None, silently), so that the result can carry a gradient back to it; else None."""
    if record.could_possibly_record() or not getattr(getattr(tensor, "graph", None), "building_function", True):
        return tensor
    return None


def with_gradient(ctx, result):
    """The exchange's ``result``, where a tape may record it (``taped``) with Horovod's gradient of
    its allreduce: the allreduce of the result's gradient over the same process set, scaled alike
    (alpha: 1/n for Average), uncompressed as Horovod's own is."""
    if ctx.graph_input is None:
        return result
    alpha, process_set = ctx.alpha, ctx.process_set

    @tf.custom_gradient
    def reduced(x):
        def gradient(upstream):
            summed = hvd.allreduce(upstream, op=hvd.Sum, process_set=process_set)
            return summed * tf.cast(alpha, summed.dtype)
        return tf.identity(result), gradient
    return reduced(ctx.graph_input)


def stepping(run, ctx, alpha):
    """Every rank of the set stepping: the reduction's chain (DQSGD: that of the bits chosen); counted
    in ``allreduce_bytes`` (what a ring allreduce of the tensor would have cost: report.summary
    compares; not in the joined branch, whose allreduce is that)."""
    run.add(allreduce_bytes=cost_model.fp32_allreduce_bytes(len(ctx.set_ranks), ctx.numel))
    if ctx.index is None:
        return stages(run, ctx.exchanges[0], alpha)
    return run.switch(ctx.index, [lambda ex=ex: stages(run, ex, alpha) for ex in ctx.exchanges])


def joined_ranks(run, ctx, alpha, saved):
    """Ranks of the set have joined: alpha * Horovod's Sum of this rank's own payload(s),
    dequantized (``saved``: each exchange's payload and splits from compress); uncompressed on the
    wire, counted in ``joined_exchanges`` (and ``raw_elements``, ``raw_tensors``), logged once."""
    def own(ex, payload, splits):
        ex.payload, ex.splits = payload, splits
        with tf.control_dependencies([alpha]):
            return ex.chain.own_dequantized(ex)
    if ctx.index is None:
        mine = own(ctx.exchanges[0], *saved[0])
    else:
        mine = run.switch(ctx.index, [lambda ex=ex, p=p: own(ex, *p) for ex, p in zip(ctx.exchanges, saved)])
    refusal = joined_refusal(len(ctx.set_ranks))   # (this branch runs only where ranks have joined: which, unknown)
    if refusal is not None:   # a collective there would overflow Horovod's buffer: refused, on every stepping rank
        with tf.control_dependencies([tf.debugging.Assert(False, [f"{ctx.where}: {refusal}"])]):
            return tf.zeros_like(mine) * alpha
    summed = run.collectives.allreduce(mine, f"{ctx.wire}.joined", ctx.process_set)
    run.add(raw_elements=ctx.numel, raw_tensors=1, joined_exchanges=1)
    run.depend(tf.py_function(lambda: (note_joined(ctx.where), 0)[1], [], tf.int32))
    return summed * alpha


def stages(run, ex, alpha):
    """alpha * the reduced tensor: the chain's stages, its first collective ordered after the
    control check."""
    with tf.control_dependencies([alpha]):
        ex.payload = tf.identity(ex.payload)
        if ex.splits is not None:
            ex.splits = tf.identity(ex.splits)
    return run_stages(run, ex, alpha)
