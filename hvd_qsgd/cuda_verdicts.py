"""The device's verdicts on what its kernels decoded (``hvd_qsgd.cuda``): read in the call, or kept
and read together (``deferred_verdicts``, ``settle``), one wait for the device a step.

A verdict is a status on the device (an int32: QSGD_OK, or the first failure a kernel found) and
what names a failure: the call's ``where``, and, for a decode whose headers the device checked
(``cuda.decode_sum`` with ``expect``), the headers it copied beside the status, which the host
reads only once the status says they failed, to raise what its own check of them would have raised
(``explain``: the payload whose header is malformed, or the field that differs and every rank's value).
"""
import contextlib
import threading

from hvd_qsgd import _native, codec

# the statuses a device's check of a header against the expected one gives (qsgd_header_against)
HEADER_FAILURES = frozenset((_native.E_MAGIC, _native.E_VERSION, _native.E_HEADER, _native.E_MISMATCH,
                             _native.E_LENGTH))

_scope = threading.local()   # the verdict list of the ``deferred_verdicts`` the calling thread is in


def verdict(st, status, where, deferrable=False, explain=None):
    """Raise for a failed call (``st``) or a failure the device reported in ``status`` (its first
    word; waits for it); a ``deferrable`` call's verdict, within ``deferred_verdicts``, is kept for
    ``settle`` instead. ``explain(code)``: raises what names a header failure more closely."""
    if st != _native.OK:
        codec.raise_status(st, where)
    pending = getattr(_scope, "pending", None) if deferrable else None
    if pending is not None:
        pending.append((status, where, explain))
        return
    _raise_if_failed(int(status[0].item()), where, explain)


def _raise_if_failed(code, where, explain):
    if code == _native.OK:
        return
    if explain is not None and code in HEADER_FAILURES:
        explain(code)
    codec.raise_status(code, where)


@contextlib.contextmanager
def deferred_verdicts(pending):
    """Within: the device's verdicts of ``decode_sum`` and ``decode_chunks`` in this thread are added
    to ``pending`` (a deque) instead of waited for call by call: for decodes whose results nothing
    reads before ``settle(pending)`` (an exchange's result, handed to the optimizer only after the
    step's last decompress settles). The call's own errors (arguments, headers it read) still raise
    at once. ``pending`` None: the verdicts are read in each call (a stage whose result goes on to
    other ranks, run within another's scope)."""
    outer = getattr(_scope, "pending", None)
    _scope.pending = pending
    try:
        yield
    finally:
        _scope.pending = outer


def settle(pending):
    """Wait once for every verdict in ``pending`` (a deque, then emptied): one device-to-host copy per
    device; raise the first failure, naming the payloads that failed."""
    if not pending:
        return
    import torch
    kept = []
    while pending:   # (popleft is atomic: a verdict added meanwhile stays for the next settle)
        kept.append(pending.popleft())
    codes = {}
    for device in {status.device for status, _, _ in kept}:
        mine = [i for i, (status, _, _) in enumerate(kept) if status.device == device]
        codes.update(zip(mine, torch.cat([kept[i][0][:1] for i in mine]).cpu().tolist()))
    for i, (_, where, explain) in enumerate(kept):
        _raise_if_failed(codes[i], where, explain)
