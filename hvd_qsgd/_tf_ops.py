"""The native binding of the codec's TensorFlow ops (``hvd_qsgd/tensorflow/qsgd_ops.cc``, built by
setup.py against the installed TensorFlow into ``hvd_qsgd/tensorflow/_qsgd_ops*.so``):
``qsgd_encode`` (``qsgd_encode_ef`` with error feedback), ``qsgd_decode_sum`` and
``qsgd_check_control``, and the steps of the scatter_allgather reduction ``qsgd_encode_chunks``
(``qsgd_encode_chunks_ef``), ``qsgd_reduce_chunk`` and ``qsgd_decode_chunks``:
CPU kernels calling the same C ABI as the PyTorch binding and ``hvd_qsgd.reduction``, so the same
input, settings and seed give the same bytes."""
import glob
import os

from hvd_qsgd import _native

_ops = None
# another build of the op library to load instead of the package's: scripts/fuzz.sh's sanitized one
TF_OPS_ENV = "HVD_QSGD_TF_OPS_LIB"


def load():
    """The op module (``tf.load_op_library``), loaded once."""
    global _ops
    if _ops is None:
        import tensorflow as tf
        here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tensorflow")
        found = [os.environ[TF_OPS_ENV]] if os.environ.get(TF_OPS_ENV) else \
            sorted(glob.glob(os.path.join(here, "_qsgd_ops*.so")))
        if not found:
            raise ImportError(
                "hvd_qsgd's TensorFlow ops are not built (hvd_qsgd/tensorflow/_qsgd_ops*.so is missing): "
                "TensorFlow was not importable when hvd_qsgd was installed. Reinstall with TensorFlow "
                "present: pip install --no-build-isolation -e .")
        _native.check_cpu()   # built with the CPU library's flags: refuse a CPU without them, not SIGILL
        _native.load()        # and HVD_QSGD_ISA checked (the ops choose their variant the same way)
        _ops = tf.load_op_library(found[0])
    return _ops


def as_int64_attr(u):
    """A uint64 value as the signed int64 a TensorFlow int attr holds (the op reads the bits back)."""
    u = int(u) & (2**64 - 1)
    return u - 2**64 if u >= 2**63 else u
