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
held a numbered slot the other ranks did not hold, and started at the next decompress on this rank
alone: every later call failed ("ranks disagree on the exchange key") or waited. So the runner notes
which unnamed call of Horovod's each thread's exchanges came from (``hvd_qsgd.unnamed_calls``),
and forgets them, logged, once that call has ended without them: at the thread's next unnamed call
(another frame), or at a decompress on that thread where the call's frame is no longer on its stack
(an optimizer step after the failed call).
"""
import threading

from hvd_qsgd.exchange.joined import OVERLAPPED
from hvd_qsgd.horovod_caller import call_tensor_name
from hvd_qsgd.unnamed_calls import UnnamedCalls, warn_left


# the ``started`` event of an exchange with no stage in the driver (one event for all: made once)
NO_STAGES = threading.Event()
NO_STAGES.set()


class DeferredSteps:
    """Mixed into ``ExchangeRunner``, whose ``lock``, ``names``, ``_start_now``, ``_start_presence``
    and ``reset`` it uses."""

    def _init_deferred(self):
        self._deferred = {}   # by ``_waiting_key``: exchanges compressed, no collective started yet
        self.calls = UnnamedCalls()   # the exchanges of each thread's last unnamed call

    def _defers(self, ex):
        """Whether ``ex`` waits for a decompress to start (see the module docstring)."""
        return ex.defer == "unnamed" or (ex.defer is not None and ex.reduction in OVERLAPPED)

    def _defer(self, ex):
        ex.stage = "deferred"
        with self.lock:
            self._deferred.setdefault(_waiting_key(ex), []).append(ex)

    def _start_deferred(self, ex, reduced_control):
        """At a decompress of a deferred exchange ``ex``: the first collective of every exchange of
        its process set (of an unnamed call: of its thread's call) compressed and not yet started, in
        the order compressed. Where ex's reduced control vector shows every rank of the set stepping
        alike (no join, no failure, settings and layout agreed: ``protocol.control_passes``), the
        chains' first collectives at once, as with ``overlap`` (where the reduction can start so): the
        presence allreduce could only confirm it, as the ranks that stepped for ex step for every
        exchange of the step. Otherwise their presence allreduces; or nothing, where a join refuses
        the step (``_first_collective``): the verdict is a function of the reduced vector, so every
        rank decides alike."""
        if self.calls:   # an unnamed call that raised on this thread: its exchanges start nowhere
            self._forget(self.calls.ended())
        with self.lock:
            pending = self._deferred.pop(_waiting_key(ex), [])
        how = self._first_collective(ex, reduced_control)
        for e in pending:
            if how is None:
                e.started = NO_STAGES
            else:
                (self._start_now if how == "direct" and e.reduction in OVERLAPPED else self._start_presence)(e)

    # -- the unnamed calls (``hvd_qsgd.unnamed_calls``) -------------------------------------

    def begin_call(self, frame):
        """Before an unnamed exchange of the Horovod call running in ``frame`` opens: forget what
        this thread's earlier call left; the name that call gives the tensor, or None
        (``horovod_caller.call_tensor_name``)."""
        self._forget(self.calls.begin(frame))
        return call_tensor_name(frame, self.calls.held(frame))

    def _forget(self, left):
        """Forget the exchanges ``left`` by an unnamed call that raised before their decompress
        (logged): the runner's whole reset where they are every exchange in progress; else each one
        (its deferred start, pending count and slot), but for members of a fused exchange or fusion
        buffer, which other exchanges share: those are kept, and said."""
        if not left:
            return
        kept = []
        if len(left) == self.names.pending:
            self.reset(residuals=False)
        else:
            kept = [ex for ex in left if ex.fused is not None]
            gone = [ex for ex in left if ex.fused is None]
            with self.lock:
                for waiting in self._deferred.values():
                    waiting[:] = [e for e in waiting if all(e is not g for g in gone)]
            for ex in gone:
                self.names.finish(ex.route)
                self.names.release_slot(ex.route.slot)
        warn_left(len(left), self.owner,
                  "forgotten" + (f", but for {len(kept)} in a fused exchange shared with others" if kept else ""))


def on_thread(ex):
    """The thread whose call ``ex`` is of, for an unnamed Horovod call (compressed and decompressed on
    the calling thread), else None: threads that share a compressor call in an order that differs
    between ranks, so each thread's exchanges start, fuse and fill buffers apart."""
    return threading.get_ident() if ex.defer == "unnamed" else None


def _waiting_key(ex):
    """Which deferred exchanges start together: those of one process set; of an unnamed call, those
    of one thread's call (``on_thread``: one thread's decompress starting another's exchanges would
    start them before that thread's control vector is reduced)."""
    return ex.group, on_thread(ex)


def unnamed_state_fault(call_name, settings, policy):
    """The error of a tensor of an unnamed Horovod call that names none (``call_name`` None), where
    the compressor keeps state per tensor (a residual, a DQSGD schedule); else None. Such calls are
    synchronous: each one's tensors are numbered from 0, so every call's first tensor would share one
    residual, mixed silently where sizes agree. Reported through the control vector: every rank raises."""
    if call_name is not None or not (settings.error_feedback or settings.server_error_feedback or policy.observes):
        return None
    return ValueError("the compressor keeps state per tensor (error feedback, DQSGD's bits), and this "
                      "hvd.allreduce / hvd.grouped_allreduce gives the tensor no name to keep it by: pass "
                      "name= (the same at every step, one per tensor or group), or hand the tensors over "
                      "through hvd.DistributedOptimizer")
