"""The exchange's chains (``hvd_qsgd.exchange.chains``) built as TensorFlow ops, so that they run in
``tf.function`` steps, ``tf.compat.v1`` graphs and eagerly. A chain's steps run once, when the step
is built, in order (``chains.run_stages``); what they build runs every step:

    TensorFlowOps          the backend of one exchange: the codec ops of ``hvd_qsgd.tensorflow``
                           (QsgdEncode[Ef], QsgdDecodeSum[Report], QsgdEncodeChunks[Ef],
                           QsgdReduceChunk[Ef], QsgdDecodeChunks) bound to its settings, expected
                           header, message and seed; sizes are int64 tensors; a header check or a
                           failed reduce step raises inside the op that decodes
                           (``InvalidArgumentError``, every rank), or, mid-chain (the hierarchical
                           shard result), reports its failure for every rank to see
    TensorFlowCollectives  Horovod's TensorFlow collectives (``hvd_qsgd.adapters.tensorflow.collectives``)
    GraphRun               what a chain calls on its runner: the collectives, the statistics and
                           timing (one op a scope adds them to the adapter's variables:
                           ``tally.Tally``), and the residuals the adapter keeps as variables
                           (``state.GraphResidual``)

Phase 2 of scatter_allgather carries the reduced chunks' lengths apart (``collectives.Phase2Part``):
the decode op then knows every rank's slot, an empty one included, without parsing headers.
QsgdReduceChunk never fails the step: a rank whose received payloads fail
their checks sends an empty reduced chunk and keeps its reason, so every rank still joins phase 2,
sees the empty slot and raises ``InvalidArgumentError`` naming the ranks that could not reduce.

The operations a step builds that nothing downstream reads (statistics, residual updates, timing)
are collected by ``GraphRun.collecting`` for the adapter to make its result depend on.
"""
import threading
from contextlib import contextmanager

import tensorflow as tf
from tensorflow.python.ops import control_flow_switch_case

from hvd_qsgd import _tf_ops as qops, codec
from hvd_qsgd.adapters.tensorflow.collectives import Phase2Part, TensorFlowCollectives
from hvd_qsgd.adapters.tensorflow.state import UNCHECKPOINTED_COUNTS
from hvd_qsgd.adapters.tensorflow.tally import Tally
from hvd_qsgd.errors import MismatchError
from hvd_qsgd.settings import Stats


class TensorFlowOps:
    """The backend of one exchange (``hvd_qsgd.backends``' methods, as graph ops): bound to its
    settings, source dtype, fingerprint, message (``where``), element count and number of ranks; the
    step seed a chain passes is (the seed attr, the occurrence tensor). The ``where`` arguments of
    the chains' calls are not used, but by ``decode_report`` (which names the shard): the ops name
    the tensor by the message bound here, as before the chains were shared."""

    def __init__(self, run, settings, source_dtype, fingerprint, where, numel, world):
        s = settings
        self.run, self.settings, self.numel, self.world = run, s, numel, world
        self.attrs = dict(bits=s.bits, bucket_size=s.bucket_size, norm=codec.NORMS[s.norm],
                          coding=codec.CODINGS[s.coding], dtype_code=codec.DTYPES[source_dtype],
                          fingerprint=qops.as_int64_attr(fingerprint), where=where)

    def _encoding(self, step_seed, **more):
        s = self.settings
        return dict(self.attrs, checksum=s.checksum, encoder=s.encoder, seed=step_seed[0], **more)

    def encode(self, x, settings, step_seed, fingerprint, source_dtype, where, residual=None, residual_valid=True):
        """The payload of ``x`` (the tensor, or the node's sum of this rank's shard: hierarchical);
        with a residual (``state.GraphResidual``), error feedback in the same op (QsgdEncodeEf,
        which updates the residual's variable in place)."""
        ops = qops.load()
        if residual is None:
            return ops.qsgd_encode(x, step_seed[1], **self._encoding(step_seed))
        payload = ops.qsgd_encode_ef(x, step_seed[1], residual.variable.handle, residual.factor,
                                     **self._encoding(step_seed))
        self.run.depend(residual.keep(payload))
        return payload

    def encode_chunks(self, x, settings, step_seed, n, fingerprint, source_dtype, where, residual=None,
                      residual_valid=True):
        """Phase 1's payloads and splits; with a residual, error feedback in the same op
        (QsgdEncodeChunksEf)."""
        ops = qops.load()
        if residual is None:
            payloads, splits = ops.qsgd_encode_chunks(x, step_seed[1], **self._encoding(step_seed, world=n))
        else:
            payloads, splits = ops.qsgd_encode_chunks_ef(x, step_seed[1], residual.variable.handle, residual.factor,
                                                         **self._encoding(step_seed, world=n))
            self.run.depend(residual.keep(payloads))
        return payloads, tf.cast(splits, tf.int64)

    # the hierarchical reduction's cross stage is an allgather: its scatter_allgather would decode
    # mid-chain with ops that fail the step on some ranks while others wait
    reduces_across_nodes = False

    @staticmethod
    def float32(x):
        return tf.reshape(tf.cast(x, tf.float32), [-1])

    @staticmethod
    def empty_bytes(like):
        return tf.zeros([0], tf.uint8)

    @staticmethod
    def zeros(size, like):
        return tf.zeros([size], tf.float32)

    @staticmethod
    def repeat(x, times):
        return tf.tile(x, [times])

    @staticmethod
    def slice(x, begin, size):
        return tf.slice(x, [begin], [size])

    @staticmethod
    def sizes(lens, n):
        return [lens[k] for k in range(n)] if isinstance(lens, tf.Tensor) else list(lens)

    @staticmethod
    def check_size(x, expected, message):
        """Nothing: every size was fixed when the control vectors agreed."""

    def decode_report(self, buffer, lens, count, expect, where):
        """(the decode-sum of the ``count`` payloads in ``buffer``, checked against ``expect``, or
        nothing; "" or why not): QsgdDecodeSumReport, which never fails the step."""
        attrs = dict(self.attrs, where=where)
        return tuple(qops.load().qsgd_decode_sum_report(buffer, tf.constant(1.0), count=count, numel=expect.numel,
                                                        **attrs))

    def decode(self, payload, where):
        """The payload decoded (this rank's own, for the allreduce that carries an exchange through a
        join): QsgdDecodeSum of one payload, its header checked."""
        return qops.load().qsgd_decode_sum(payload, tf.constant(1.0), count=1, numel=self.numel, **self.attrs)

    @staticmethod
    def split_by(buffer, lens):
        """Payloads back to back and their lengths, as ``decode_chunks`` takes them."""
        return Phase2Part(buffer, tf.cast(lens, tf.int32))

    @staticmethod
    def checked_sizes(out, got, expected, message, error=None):
        """``out``, after an assertion that fails the step (on every rank that received the same
        sizes) unless the parts had the ``expected`` sizes."""
        ok = tf.reduce_all(tf.equal(tf.stack([tf.cast(g, tf.int64) for g in got]), tf.constant(expected, tf.int64)))
        data = [message(None), "sizes:", tf.stack(got), "expected:", tf.constant(expected, tf.int64)]
        if isinstance(error, tf.Tensor):
            data += ["this rank:", error]
        with tf.control_dependencies([tf.debugging.Assert(ok, data, summarize=64)]):
            return tf.identity(out)

    @staticmethod
    def scaled(out, alpha):
        return out * alpha

    @staticmethod
    def length(x):
        return tf.size(x.data if isinstance(x, Phase2Part) else x, out_type=tf.int64)

    @staticmethod
    def total(lens):
        return tf.reduce_sum(tf.cast(lens, tf.int64))

    def decode_gathered(self, gathered, count, own_len, alpha, expect, where):
        """(alpha * the decoded sum of the gathered payloads, their headers checked in the op; None:
        the payloads' lengths are not read out)."""
        return qops.load().qsgd_decode_sum(gathered, alpha, count=count, numel=self.numel, **self.attrs), None

    def reduce_received(self, received, splits, j, settings, step_seed, expect, where, server_residual=None):
        """(this rank's reduced chunk j and its length, the reason it is empty or ""): never fails."""
        ops, splits = qops.load(), tf.cast(splits, tf.int32)
        attrs = self._encoding(step_seed, world=self.world)
        if server_residual is None:
            reduced, error = ops.qsgd_reduce_chunk(received, splits, step_seed[1], chunk=j, numel=self.numel, **attrs)
        else:
            server = server_residual()
            reduced, error, new = ops.qsgd_reduce_chunk_ef(received, splits, step_seed[1], server, chunk=j,
                                                           numel=self.numel, **attrs)
            with tf.control_dependencies([server.assign(new)]):
                reduced, error = tf.identity(reduced), tf.identity(error)
        return Phase2Part(reduced, tf.reshape(tf.size(reduced, out_type=tf.int32), [1])), error

    @staticmethod
    def unframe(gathered, n, where, expect=None):
        return gathered

    @staticmethod
    def part_bytes(parts, ranks):
        ranks = list(ranks)
        return tf.reduce_sum(tf.gather(tf.cast(parts.lengths, tf.int64), ranks)) if ranks else 0

    @staticmethod
    def raise_if_failed(error, message):
        """A step that failed while the graph was built raises here; one that fails when the graph
        runs (``error`` a string tensor) makes the op that decodes fail instead."""
        if isinstance(error, Exception):
            raise MismatchError(f"{message}: {error}") from error

    def decode_chunks(self, parts, alpha, numel, bucket_size, where, error=None, expect=None):
        return qops.load().qsgd_decode_chunks(parts.data, parts.lengths, alpha,
                                              tf.constant("") if error is None else error,
                                              numel=self.numel, world=self.world, **self.attrs)


class GraphRun:
    """What a chain calls on its runner, for the TensorFlow adapter ``owner`` (its counter and timing
    variables: ``hvd_qsgd.adapters.tensorflow.state``; its residuals: each exchange's ``origin``)."""

    def __init__(self, owner):
        self.owner = owner
        self.collectives = TensorFlowCollectives(self)
        self._local = threading.local()

    @property
    def stats(self):
        return self

    @contextmanager
    def collecting(self):
        """The list the operations built inside the block that nothing reads are added to; at its
        end, the op adding what the block counted and timed (``tally.Tally``), if anything."""
        outer = getattr(self._local, "scope", None)
        self._local.scope = deps, tally = [], Tally(self.owner._stat_variable)
        try:
            yield deps
            op = tally.op()
            if op is not None:
                deps.append(op)
        finally:
            self._local.scope = outer

    def switch(self, index, makes):
        """``tf.switch_case(index, makes)``, each branch's collected operations made dependencies of
        its results (nothing built in a branch can be read outside it); kept a functional ``Case`` op,
        not lowered to switch and merge ops: the graph TensorFlow optimizes at the first step is then
        one node per conditional, not every node of both branches and a switch per tensor they read
        (docs/performance.md, "The join conditional, kept whole")."""
        def branch(make):
            with self.collecting() as deps:
                out = make()
            with tf.control_dependencies(deps):
                return tf.nest.map_structure(tf.identity, out)
        return control_flow_switch_case._indexed_case_helper(
            [lambda m=m: branch(m) for m in makes], None, index, "switch_case", lower_using_switch_merge=False)

    def depend(self, op):
        self._local.scope[0].append(op)

    def add(self, **amounts):
        """Count ``amounts`` (the fields TensorFlow keeps: ``Stats.GRAPH_FIELDS`` and
        ``state.UNCHECKPOINTED_COUNTS``) in the scope's tally."""
        self._local.scope[1].count(**{k: v for k, v in amounts.items()
                                      if k in Stats.GRAPH_FIELDS or k in UNCHECKPOINTED_COUNTS})

    def exchanged(self, elements, sent, received, cross_sent=0, cross_received=0):
        """One exchange's counts (``Stats.exchanged``), those TensorFlow keeps."""
        self._local.scope[1].count(elements=elements, bytes_sent=sent, tensors=1, bytes_received=received)

    def timed(self, field, make, *after):
        """make(), timed into ``field`` from once ``after`` exist until its results exist."""
        return self._local.scope[1].timed(field, after, make)

    @staticmethod
    def wait(handle):
        return handle

    def worker_residual(self, ex, x, size=None):
        """(the residual of what this rank encodes, ``size`` elements (default: the tensor's), True),
        or (None, False) without error feedback."""
        residual = self.check_residual(ex, size)
        return residual, residual is not None

    def check_residual(self, ex, size):
        """The residual of what this rank encodes, checked to have ``size`` elements (None without
        error feedback)."""
        if not ex.settings.error_feedback:
            return None
        return self.owner._residual(ex.origin, ex.expect.numel if size is None else size)

    @staticmethod
    def keep_residual(ex, residual):
        """Nothing: the residual's variable was assigned by the encode."""

    def server_residual(self, ex, like):
        return self.owner._server_residual(ex.origin, ex.settings)
