"""The exchange runner's deferred exchanges: those whose first collective waits for a decompress.

An exchange of a gradient that Horovod's optimizer hands over (``defer == "named"``) defers where its
reduction can start without a presence allreduce (``OVERLAPPED``): its step's reduced control vector
says what the presence allreduces would. An exchange of an unnamed call (``hvd.allreduce(t,
compression=...)``, ``hvd.grouped_allreduce``: ``defer == "unnamed"``) always defers, whatever its
reduction, fused exchange included: Horovod names an unnamed collective by its per-process handle
count, so a collective started in compress on the ranks that compress, and not on a rank that does
not (another dtype, ``min_numel``, compressor), left the control vectors' allreduces under different
names, and every rank waited forever; deferred, every rank gets Horovod's mismatch error.

Such an error leaves this rank's exchanges of that call compressed and never decompressed. Kept, they
held a numbered slot the other ranks did not hold, and started at the next call's decompress on this
rank alone: every later call failed ("ranks disagree on the exchange key") or waited. So the runner
notes which unnamed call of Horovod's each thread's exchanges came from (``hvd_qsgd.state.UnnamedCalls``):
a new call on a thread whose earlier call left exchanges, where those are every exchange in progress,
forgets them first (``reset``, the residuals kept), logged.
"""
import logging

from hvd_qsgd import protocol
from hvd_qsgd.exchange.joined import OVERLAPPED
from hvd_qsgd.state import UnnamedCalls

log = logging.getLogger("hvd_qsgd")


class DeferredSteps:
    """Mixed into ``ExchangeRunner``, whose ``lock``, ``names``, ``_start_now``, ``_start_presence``
    and ``reset`` it uses."""

    def _init_deferred(self):
        self._deferred = {}   # by process set: exchanges compressed, no collective started yet
        self.calls = UnnamedCalls()   # the exchanges of each thread's last unnamed call

    def _defers(self, ex):
        """Whether ``ex`` waits for a decompress to start (see the module docstring)."""
        return ex.defer == "unnamed" or (ex.defer is not None and ex.reduction in OVERLAPPED)

    def _defer(self, ex):
        ex.stage = "deferred"
        with self.lock:
            self._deferred.setdefault(ex.group, []).append(ex)

    def _start_deferred(self, ex, reduced_control):
        """At a decompress of a deferred exchange ``ex``: the first collective of every exchange of
        its process set compressed and not yet started, in the order compressed. Where ex's reduced
        control vector shows every rank of the set stepping alike (no join, no failure, settings and
        layout agreed: ``protocol.control_passes``), the chains' first collectives at once, as with
        ``overlap`` (where the reduction can start so): the presence allreduce could only confirm it,
        as the ranks that stepped for ex step for every exchange of the step. Otherwise their presence
        allreduces: the verdict is a function of the reduced vector, so every rank decides alike."""
        with self.lock:
            pending = self._deferred.pop(ex.group, [])
        direct = protocol.control_passes(reduced_control, ex.world, ex.set_ranks)
        for e in pending:
            (self._start_now if direct and e.reduction in OVERLAPPED else self._start_presence)(e)

    # -- the unnamed calls (``hvd_qsgd.state.UnnamedCalls``) -------------------------------------

    def begin_call(self, frame):
        """Before an unnamed exchange of the Horovod call running in ``frame`` opens: where this
        thread's earlier call left exchanges that are every exchange in progress, forget them."""
        left = self.calls.begin(frame)
        if left and len(left) == self.names.pending:
            log.warning("hvd_qsgd: %d exchange(s) of an earlier unnamed call of %s on this thread were never "
                        "decompressed (its collective raised, as at a mismatch between ranks); forgotten before "
                        "the next call", len(left), self.owner)
            self.reset(residuals=False)
