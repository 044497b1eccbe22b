"""The package's exceptions: one base, ``hvd_qsgd.Error``, so ``except hvd_qsgd.Error`` catches
everything the package raises about its own work. Each also keeps the built-in parent it had
before the base existed (``ValueError`` for bad payloads, ``RuntimeError`` for disagreements
between ranks and for encode failures), so no caller's ``except`` clause changes meaning.

Bad arguments stay plain ``ValueError``/``TypeError`` (they name the parameter), as in the
standard library.
"""


class Error(Exception):
    """Base of the errors hvd_qsgd raises about payloads, exchanges and its kernels."""


class PayloadError(Error, ValueError):
    """A payload failed validation; ``status`` is the kernels' qsgd_status code."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class MismatchError(Error, RuntimeError):
    """Ranks disagreed about a compressed exchange (settings, tensor order, process set, op), or a
    rank could not take part; raised on every rank of the exchange."""


class EncodeError(Error, RuntimeError):
    """The kernels refused to encode a tensor (``status``: their qsgd_status code)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


# the default of ``compress``'s tensor: Horovod calls ``compression.compress(tensor)``, which a class
# passed as the compression (``compression=hvd_qsgd.QSGD``, where Horovod's own ``hvd.Compression.fp16``
# is an object) receives as ``self``, with no tensor
NOT_GIVEN = object()


def class_given() -> TypeError:
    """The error of a compressor class handed to Horovod where a compressor made from it belongs."""
    return TypeError("hvd_qsgd: the compression given is a class (compression=hvd_qsgd.QSGD, say), not a "
                     "compressor: make one from it with its settings, e.g. compression=hvd_qsgd.QSGD(4) (4 bits)")


class NotCopied:
    """A compressor is neither copied nor pickled (``copy.deepcopy`` of a model's optimizer, a
    ``torch.save`` of the whole optimizer): it holds exchanges in progress, locks and framework
    state. Its settings and ``state_dict()`` make another."""

    def __reduce_ex__(self, protocol):
        raise TypeError(f"{type(self).__name__}: a compressor is not copied or pickled (it holds exchanges in "
                        "progress and framework state): make another with the same settings, "
                        "hvd_qsgd.QSGD(**compressor.settings.as_dict()), and give it compressor.state_dict() "
                        "through load_state_dict()")

    def __deepcopy__(self, memo):
        self.__reduce_ex__(None)
