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
