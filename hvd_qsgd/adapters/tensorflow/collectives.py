"""Horovod's TensorFlow collectives as the exchange's chains start them (``hvd_qsgd.exchange.collectives``),
under the exchange's names ("." becomes "_"), each timed into ``wait_s``: a handle is the
collective's result (a tensor of the graph being built, or eagerly its value), and waiting is
reading it.

Phase 2 of scatter_allgather carries the reduced chunks' lengths by a second allgather of one int32
each (``<exchange>_gather_splits``; not payload, not counted), not in frames as the CPU and CUDA
backends do (``Phase2Part``).

Horovod keys a collective by its op's node name as the graph runs it: the whole name
(``ignore_name_scope=False``), not its last component. The chains' collectives run inside a ``Case``
(``GraphRun.switch``), and where Grappler's TFG passes rewrite a branch (constant hoisting, code sinking), they move its ops
into the enclosing graph renamed ``<name>_tfg_inlined_<case op>_<branch>``: the last component of
every collective of a branch is then the ``Case`` op's, the same for every tensor's exchange
(Horovod: "a tensor with the same name as another tensor that is currently being processed"). The
whole name keeps the exchange's name, and is the same on every rank where every rank builds the
same graph, as the names of Horovod's own collectives are.

They are Horovod's ops (``horovod.tensorflow.mpi_ops``), not ``hvd.allreduce``, which takes a
compression: code that wraps ``hvd.allreduce`` to put a compression in (a test harness, a user's
wrapper) would otherwise send the exchange's own allreduces through the compressor, which in a
graph recursed without end (the branch for joined ranks is always built there).
"""
from collections import namedtuple

import tensorflow as tf
import horovod.tensorflow as hvd
from horovod.tensorflow import mpi_ops


class Phase2Part(namedtuple("Phase2Part", "data lengths")):
    """A reduced chunk and its length (int32, [1]); once gathered, every rank's back to back and
    their lengths (a namedtuple: ``tf.nest`` sees its two tensors)."""

    __slots__ = ()


class TensorFlowCollectives:
    """Horovod's TensorFlow collectives as the chains start them (``hvd_qsgd.exchange.collectives``):
    a handle is the collective's result, and waiting is reading it."""

    def __init__(self, run):
        self.run = run

    @staticmethod
    def _name(name):
        return name.replace(".", "_")

    def allreduce(self, x, name, group):
        return self.run.timed("wait_s", lambda: mpi_ops._allreduce(x, op=hvd.Sum, name=self._name(name),
                                                                  ignore_name_scope=False, process_set=group), x)

    def allgather(self, x, name, group):
        name = self._name(name)
        if isinstance(x, Phase2Part):  # both at one moment: Horovod negotiates them in one cycle (timed
            # apart, one could reach Horovod a cycle after the other on some rank: 40% slower steps)
            return Phase2Part(*self.run.timed("wait_s", lambda: (
                mpi_ops.allgather(x.data, name=name, ignore_name_scope=False, process_set=group),
                mpi_ops.allgather(x.lengths, name=f"{name}_splits", ignore_name_scope=False, process_set=group)), *x))
        return self.run.timed("wait_s", lambda: mpi_ops.allgather(x, name=name, ignore_name_scope=False,
                                                             process_set=group), x)

    def alltoall(self, x, splits, name, group):
        splits = (tf.stack([tf.cast(v, tf.int32) for v in splits]) if isinstance(splits, (list, tuple))
                  else tf.cast(splits, tf.int32))
        received, rsplits = self.run.timed("wait_s", lambda: tuple(mpi_ops.alltoall(
            x, splits=splits, name=self._name(name), ignore_name_scope=False, process_set=group)), x, splits)
        return received, tf.cast(rsplits, tf.int64)

    @staticmethod
    def wait(handle):
        return handle
