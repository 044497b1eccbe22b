"""What the workers under tests/mp/ read of the package's logger."""
import contextlib
import logging


@contextlib.contextmanager
def logged():
    """The messages logged on the ``hvd_qsgd`` logger inside the block (a list, filled as they come)."""
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("hvd_qsgd").addHandler(handler)
    try:
        yield messages
    finally:
        logging.getLogger("hvd_qsgd").removeHandler(handler)
