"""The exchange runner's path for ranks gone to ``hvd.join()``: the control vector's verdict where
ranks of the set may have joined, and the result of an exchange that went uncompressed because they
had (the stepping ranks allreduce decode(own payload(s)); docs/compressor.md, "Uneven data")."""
import logging
import threading
import time

import numpy as np

from hvd_qsgd import protocol

log = logging.getLogger("hvd_qsgd")
# the reductions whose first collective ``overlap`` starts in compress
OVERLAPPED = ("allgather", "scatter_allgather")
_joined_logged = threading.Event()


def note_joined(where, joined=None):
    """Log, once per process, that exchanges go uncompressed while ranks have joined (``joined``: how
    many, where known)."""
    if not _joined_logged.is_set():
        _joined_logged.set()
        log.warning("%s: %s of the set have joined (hvd.join); until every rank has joined, compressed "
                    "exchanges go through Horovod's allreduce of each stepping rank's dequantized payload "
                    "(fp32 on the wire; counted in stats['joined_exchanges'])", where,
                    "ranks" if joined is None else f"{joined} rank(s)")


# Horovod 0.28.1's coordinator answers a collective it has not cached (one first negotiated after a
# rank joined, as the joined path's allreduce always is: only responses of every rank are cached)
# in Controller::ConstructResponse (horovod/common/controller.cc), whose vector of devices is sized
# by the requests of the ranks still stepping and indexed by their rank in the set: it writes past
# its end where a joined rank's number is below a stepping one's. glibc's allocation leaves room for
# 6 entries, so from 7 ranks up the job crashes (free(): invalid pointer) or its memory is corrupted
# silently; where the joined ranks are the set's last, every write is in bounds.
JOIN_SAFE_RANKS = 6


def joined_refusal(set_size, present=None):
    """The error for a joined step of a process set of ``set_size`` ranks (``present``: the set ranks
    still stepping, None where not known), where its reduction would write past Horovod's buffer
    (see ``JOIN_SAFE_RANKS``); None where it is safe."""
    if set_size <= JOIN_SAFE_RANKS or (present is not None and max(present) < len(present)):
        return None
    stepping = "some" if present is None else str(len(present))
    return protocol.MismatchError(
        f"{set_size - len(present) if present is not None else 'some'} rank(s) of the process set of {set_size} "
        f"have joined (hvd.join) while {stepping} step on, and the others' tensor would then be reduced by a "
        "collective Horovod 0.28.1 has not seen before the join, which from "
        f"{JOIN_SAFE_RANKS + 1} ranks up, where a joined rank's number is below a stepping one's, writes past a "
        "buffer on its coordinator (horovod/common/controller.cc, Controller::ConstructResponse) and crashes the "
        "job or corrupts its memory: refused, on every rank still stepping. Give every rank the same number of "
        "steps (drop the last, uneven batch), so that every rank reaches hvd.join() at the end, or let the ranks "
        "with fewer batches be the last ones")


class JoinedSteps:
    """Mixed into ``ExchangeRunner``, whose ``driver``, ``stats`` and ``wait`` it uses."""

    def _check_control(self, ex, reduced, carrier):
        """The control vector's verdict (``protocol.check_control``), where ranks of the set may have
        joined (``hvd.join``): then the vector is that of the ranks still stepping, and the exchange's
        presence allreduce (that of ``carrier``, the exchange whose collectives carry ex's payload) must
        say the same (``protocol.joined_verdict`` tells a join from a reduction over a smaller process
        set)."""
        fault = None if ex.fault is None else str(ex.fault)
        if fault is not None and not fault.startswith(ex.where):   # (a fault may name the tensor itself)
            fault = f"{ex.where}: {fault}"
        try:
            return protocol.check_control(reduced, ex.world, ex.set_ranks, ex.where, fault_message=fault)
        except protocol.MismatchError as e:
            if len(ex.set_ranks) > 1 and np.array_equal(reduced, self.control(ex)):   # (not reduced at all)
                raise protocol.MismatchError(
                    f"{ex.where}: decompress was given what compress returned, not reduced: the compressor works "
                    "inside Horovod's allreduce (compress, then hvd.allreduce of what it returned, with op Sum or "
                    "Average, then decompress), as Horovod's optimizer and hvd.allreduce(t, compression=...) "
                    "call it") from None
            verdict = protocol.joined_verdict(reduced, ex.world, ex.set_ranks, ex.where)
            if verdict is None or ex.set_rank is None:
                raise
            if not carrier.settings.join:
                raise protocol.MismatchError(protocol.join_off_message(
                    ex.where, len(ex.set_ranks) - len(verdict[0]))) from None
            if carrier.settings.overlap and carrier.reduction in OVERLAPPED:
                raise protocol.MismatchError(
                    f"{ex.where}: ranks of the set have joined (hvd.join), and with overlap=True its payload "
                    "collective started before that could be known (Horovod cannot carry an allgather or alltoall "
                    "through a join): pass overlap=False to use hvd.join()") from None
            present, alpha, certain = verdict
            refusal = joined_refusal(len(ex.set_ranks), present)
            if refusal is not None:
                raise protocol.MismatchError(f"{ex.where}: {refusal}") from None
            if not self._presence_known(carrier, None if certain else protocol.JOIN_WAIT_S):
                raise protocol.MismatchError(f"{e} (or ranks {sorted(set(range(len(ex.set_ranks))) - set(present))} "
                                             "of the set joined (hvd.join) but never took part in this "
                                             "exchange's presence allreduce)") from None
            if carrier.present != present:
                raise protocol.MismatchError(
                    f"{ex.where}: the control vector was reduced over set ranks {present}, but the ranks "
                    f"still stepping (not joined with hvd.join) are {carrier.present}") from None
            return alpha

    def _first_collective(self, ex, reduced):
        """How the exchanges that start at ex's decompress (its process set's deferred ones, a fusion
        buffer closed there) start, decided from ex's reduced control vector, alike on every rank:
        "direct" (their chains' first collectives) where it shows every rank of the set stepping
        alike; None where ranks have joined and a presence allreduce, a collective new since the join,
        would write past Horovod's buffer (``joined_refusal``: nothing starts, and each decompress
        raises it, ``_check_control``); else "presence"."""
        if protocol.control_passes(reduced, ex.world, ex.set_ranks):
            return "direct"
        return None if self._refused_join(ex, reduced) is not None else "presence"

    def _refused_join(self, ex, reduced):
        """``joined_refusal`` of the step whose reduced control vector is ``reduced``, where it shows
        ranks of ex's set joined (``protocol.joined_verdict``); else None."""
        if len(ex.set_ranks) <= JOIN_SAFE_RANKS:
            return None
        try:
            verdict = protocol.joined_verdict(reduced, ex.world, ex.set_ranks, ex.where)
        except protocol.MismatchError:   # (another fault: the control check says it)
            return None
        return None if verdict is None else joined_refusal(len(ex.set_ranks), verdict[0])

    def _presence_known(self, ex, timeout):
        """Wait until the exchange's presence allreduce has completed (``timeout`` seconds at most,
        None: no limit); whether it has."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while ex.present is None and ex.stage_error is None:
            if deadline is None:
                self.driver.finish(ex)
                break
            if time.monotonic() > deadline:
                return False
            self.driver.advance()
            time.sleep(1e-3)
        return ex.present is not None

    def _finish_joined(self, ex, alpha):
        """With ranks joined: alpha * the sum Horovod's allreduce made of the stepping ranks'
        dequantized payloads (the joined ranks added zeros), counted as an uncompressed exchange."""
        out = self.wait(ex.handle)
        if alpha != 1.0:
            out = out * alpha
        self._count_joined(ex)
        return out

    def _count_joined(self, ex):
        carrier = ex.fused or ex
        self.stats.add(raw_elements=ex.expect.numel, raw_tensors=1, joined_exchanges=1)
        note_joined(ex.where, len(ex.set_ranks) - len(carrier.present))
