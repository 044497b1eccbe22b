"""The exchanges of one compressor, framework-free: ``ExchangeRunner`` takes a tensor (as its
backend's array) from compress to decompress through its reduction's chain of stages
(``hvd_qsgd.exchange.chains``) over a collectives interface (``hvd_qsgd.exchange.collectives``).

    open        the exchange's route (``hvd_qsgd.state.ExchangeNames``), settings (the bits policy),
                reduction, chain and backend; what every header must say
    encode      the step seed; the chain's encode, with the error-feedback residual
                (``ResidualStore``; fused into the backend's encode, on the CPU as on the device)
    start       the presence allreduce (``protocol.presence_vector``), even after a fault; or, for
                an exchange whose control vector Horovod's optimizer allreduces under the
                parameter's name (``defer``), nothing yet
    control     the control vector the adapter hands to Horovod's allreduce
    finish      a deferred exchange first starts, with every deferred exchange of its process set:
                their chains' first collectives where its reduced control vector shows every rank
                stepping alike, else their presence allreduces; then the control vector's verdict;
                the chain's remaining stages (``hvd_qsgd.driver``); the chain's result, or the
                joined path's (ranks gone to ``hvd.join``: ``hvd_qsgd.exchange.joined``); a CUDA
                decode's verdict on it is read with the step's others at the step's last finish
                (``hvd_qsgd.cuda.settle``: one wait for the device a step)

With ``Settings.fusion``, start keeps an allgather exchange in its group's open fused exchange
(``hvd_qsgd.exchange.fused``), whose one presence allreduce and one allgather carry every member;
finish checks each member's own control vector, then cuts its result from the fused one. With
``Settings.fusion_mb``, start puts a tensor in its group's fusion buffer
(``hvd_qsgd.exchange.buffers``), encoded as one tensor once full or at the first decompress of a
member, and exchanged through its own chain; finish slices each member's result from the buffer's.

The stages start from decompress and its waits, never at a moment of a rank's own choosing: Horovod
names an unnamed collective by its per-process handle count, so a payload collective started where
one rank happened to see its presence allreduce completed, and another rank did not, gave the
user's next unnamed collective different names on the two ranks, and it hung (docs/compressor.md,
"Overlap"). With ``Settings.overlap``, start runs the chain's first collective at once, in compress
(a fusion buffer's as it closes), on every rank alike, and makes no presence allreduce (no
``hvd.join`` then).

A deferred exchange (PyTorch's, by default) makes no presence allreduce where nothing needs one:
the ranks that stepped for the exchange decompressed first step for every exchange of that step, so
its reduced control vector, where it passes, says what their presence allreduces would. Their first
collectives then start at that decompress, on every rank alike (the verdict is a function of the
reduced vector, the same on every rank): one Horovod operation fewer per tensor, and no more rounds.
An unnamed ``hvd.allreduce(t, compression=...)``, whose control vector Horovod names by its handle
count, defers whatever its reduction, even under ``overlap`` (the call is synchronous: nothing to
overlap): a rank that does not compress the tensor (another dtype, ``min_numel``, compressor) starts
nothing in compress either, so the ranks' handle numbers stay alike and Horovod raises its mismatch
instead of hanging; the exchanges that mismatch left are forgotten once their call has ended
(``hvd_qsgd.exchange.deferred``).

hvd.join(): when the presence allreduce shows ranks have joined, no allgather or alltoall starts
(Horovod cannot carry those through a join): the stepping ranks allreduce decode(own payload(s))
instead, and finish returns alpha times that sum, alpha = 1/n for Average as Horovod's own joined
allreduce gives (``protocol.joined_verdict`` checks the control vector as the stepping ranks').
Counted in ``stats["joined_exchanges"]`` and logged once.
"""
import collections
import threading
import time
from types import SimpleNamespace

import numpy as np

from hvd_qsgd import backends, cost_model, protocol, report
from hvd_qsgd.driver import StagedDriver
from hvd_qsgd.exchange.chains import CHAINS, Exchange, expectation, run_stages
from hvd_qsgd.exchange.buffers import FusionBuffers
from hvd_qsgd.exchange.deferred import NO_STAGES, DeferredSteps, unnamed_state_fault
from hvd_qsgd.exchange.fused import FusedGroups
from hvd_qsgd.exchange.hierarchical import node_layout
from hvd_qsgd.exchange.joined import OVERLAPPED, JoinedSteps, joined_refusal
from hvd_qsgd.exchange.openings import Openings
from hvd_qsgd.exchange.residuals import ResidualSteps
from hvd_qsgd.settings import Stats
from hvd_qsgd.state import ExchangeNames, ResidualStore, called_where, named_where

# verdicts kept at most before they are read (where a step's last decompress does not come)
SETTLE_AT = 64


class ExchangeRunner(ResidualSteps, JoinedSteps, DeferredSteps):
    """The exchanges of one compressor (see the module docstring): its names, residuals, statistics
    and stage driver. Thread-safe."""

    def __init__(self, collectives, creation_index, settings, policy, owner, sep="."):
        self.collectives = collectives
        self.creation_index = creation_index
        self.policy = policy
        self.owner = owner     # how warnings name the compressor
        self.lock = threading.Lock()
        self.stats = Stats()
        self.names = ExchangeNames(creation_index, sep)
        self.residuals = ResidualStore()
        self.driver = StagedDriver(collectives.poll, collectives.wait, self._next_stage)
        self.fusion = FusedGroups(self.names)
        self.buffers = FusionBuffers(self.names)
        self._slowdown = report.SlowdownWatch(settings.link_bps())
        self._controls = {}   # the control vectors made so far, by what they say
        self.openings = Openings()   # what each tensor's exchanges start with (``open``)
        self._init_deferred()
        self._verdicts = collections.deque()   # the device's verdicts on results handed over, not yet read
        self.session, self.session_lock = None, threading.Lock()   # Horovod's session (``new_session``)

    # -- compress -----------------------------------------------------------------------------

    def open(self, param, numel, dtype, shape, device_type, group, set_ranks, global_rank, world, route=None,
             where=None, ranks_per_node=None, place=None, alone=False, call=None, order=None):
        """A new exchange of a tensor of ``numel`` elements of ``dtype`` ("float32", "float16",
        "bfloat16") over ``group`` (global ranks ``set_ranks``); ``param``: its parameter's name.
        ``route`` and ``where``: the caller's own naming (``hvd_qsgd.mpi``), else the runner's.
        ``place``: an object the caller keeps for this tensor while these arguments hold for it (its
        opening is then found by it, ``hvd_qsgd.exchange.openings``). ``alone``: the tensor goes in no
        fused exchange or fusion buffer, which place tensors in the order they come: a gradient that
        Horovod's optimizer hands over in an order that differs between ranks (its ``synchronize()``).
        ``order``: the optimizer's ``ParameterOrder`` that plans its fusion buffer, or None.
        ``call``: the frame of the unnamed Horovod call it comes from (``begin_call``), or None: the
        tensor's state (residual, DQSGD schedule) is then keyed by the name that call gives it."""
        call_name = self.begin_call(call) if call is not None else None   # (the tensor's, in Horovod's call)
        route = route or self.names.route(param, call_name)
        s = self.policy.settings_for(route.residual_key)
        if where is None:
            where = named_where(route.param) if route.param is not None else called_where(route, call_name, shape)
        opening = self.openings.of(self, route, where, s, numel, dtype, shape, device_type, group, set_ranks,
                                   global_rank, world, ranks_per_node, place, alone, order)
        if opening.fallback:
            backends.note_fallback(opening.fallback, self.stats)
        ex = Exchange.of(opening.fields, route=route, where=where)
        if call is not None:
            self.calls.hold(call, ex)
            ex.fault = ex.fault or unnamed_state_fault(call_name, s, self.policy)
        return ex

    def open_exchange(self, route, where, settings, numel, dtype, device_type, group, set_ranks, global_rank, world,
                      ranks_per_node, fingerprint=0):
        """An exchange before its reduction is resolved (``resolve``): route, settings, expectation."""
        ex = Exchange(route=route, where=where, settings=settings,
                      expect=expectation(settings, numel, dtype, fingerprint), group=group, set_ranks=set_ranks,
                      world=world, global_rank=global_rank, device_type=device_type, per_node=ranks_per_node,
                      set_rank=set_ranks.index(global_rank) if global_rank in set_ranks else None)
        ex.backend = backends.choose(device_type, settings, "allgather")[0]   # (resolve chooses for the reduction)
        if ranks_per_node and world % ranks_per_node == 0:  # which node each set rank is on (the stats')
            ex.nodes = [g // ranks_per_node for g in set_ranks]
        return ex

    def resolve(self, ex, count=True):
        """The exchange's reduction (the setting, or what "auto" resolves to for its size, ranks and
        layout): its chain, backend and node layout; the backend's fallback (counted with ``count``),
        or None."""
        n = len(ex.set_ranks)
        try:
            red = ex.settings.exchange_reduction(n, ex.expect.numel, ex.per_node if n == ex.world else None,
                                                 ex.device_type)
        except ValueError as e:   # (a link variable malformed since: this exchange's fault, raised on every rank)
            red, ex.fault = "allgather", ex.fault or e
        ex.reduction, ex.chain = red, CHAINS[red]
        ex.backend, fallback = backends.choose(ex.device_type, ex.settings, red)
        if fallback and count:
            backends.note_fallback(fallback, self.stats)
        if red == "hierarchical":
            layout, fault = node_layout(ex.per_node, ex.set_ranks, ex.world, ex.where)
            ex.layout, ex.fault = layout, ex.fault or fault
        return fallback

    def encode(self, ex, x, lr=None):
        """This rank's payload(s) of ``x`` (the tensor flattened, as ``ex.backend`` reads it), timed."""
        if ex.set_rank is None:
            raise protocol.MismatchError(
                f"{ex.where}: this rank (global rank {ex.global_rank}) is not in the compressor's process set "
                f"{ex.set_ranks}; pass the optimizer's process_set= to the compressor")
        ex.lr = lr
        if ex.reduction == "buffered":  # its buffer encodes it (start puts it there)
            ex.source = x
            return
        ex.step_seed = self.names.payload_seed(ex.settings.seed, ex.set_rank, ex.route)
        t0 = time.perf_counter()
        ex.chain.encode(self, ex, x)
        self.stats.add(encode_s=time.perf_counter() - t0)

    def start(self, ex):
        """Start the exchange's presence allreduce, also after a fault (the other ranks count on it;
        the control vector reports the fault); or its chain's first collective (``overlap``, a fusion
        buffer's ``direct``); or nothing yet (``defer``: ``_start_deferred``)."""
        ex.stage = "presence"
        if ex.set_rank is None:  # not in the set: the control check raises on every rank
            ex.started = NO_STAGES
            return
        if ex.reduction == "buffered":  # its fusion buffer starts the collectives (a fault: zeros there)
            self.buffers.add(self, ex)
            ex.started = NO_STAGES
            return
        if ex.settings.fusion and ex.reduction == "allgather" and not ex.alone:  # its fused exchange carries it
            self.fusion.add(ex, self.start)
            return
        if (ex.settings.overlap and ex.defer != "unnamed" or ex.direct) and ex.reduction in OVERLAPPED:
            self._start_now(ex)
        elif self._defers(ex):  # started at a decompress (``_start_deferred``)
            self._defer(ex)
        else:
            self._start_presence(ex)

    def _start_presence(self, ex):
        """The presence allreduce, after which the driver starts the chain (``_after_presence``)."""
        ex.stage = "presence"
        vector = protocol.presence_vector(len(ex.set_ranks), ex.set_rank)
        if ex.offsets is not None:  # a fusion buffer: one more entry, the ranks that could not encode it
            vector = np.append(vector, float(ex.fault is not None))
        ex.handle = self.collectives.allreduce(vector, f"{ex.route.exchange}.present", ex.group)
        self.driver.add(ex)

    def _start_now(self, ex):
        """``overlap``: the chain's first collective now, in compress (a fusion buffer's: as it closes),
        without a presence allreduce (no ``hvd.join`` support): every rank starts it at the same call,
        so Horovod's per-process handle numbers, which name unnamed collectives, stay aligned across
        ranks. A rank that could not encode starts the same chain with nothing (an empty payload, or
        empty chunks): its control vector makes every rank raise; a fusion buffer's members, whose
        control vectors were handed over before the buffer was encoded, raise on the empty payload
        or chunk, which every rank sees once every collective of the buffer's chain has run."""
        ex.present = list(range(len(ex.set_ranks)))
        if ex.fault is not None:
            ex.payload, ex.own_len, ex.splits = self._nothing(ex), 0, [0] * len(ex.set_ranks)
        if ex.chain.start(self, ex):
            self.driver.add(ex)
        else:
            ex.started = NO_STAGES

    @staticmethod
    def _nothing(ex):
        """An empty payload where the exchange's backend reads (``origin``: the adapter's (shape, dtype,
        device))."""
        return ex.backend.empty_bytes(SimpleNamespace(device=ex.origin[2] if ex.origin else None))

    def control(self, ex):
        """The control vector of the exchange (``hvd_qsgd.protocol``), for Horovod's allreduce."""
        base = ex.control_base or ex.control_fields()   # (its opening's, where it has one)
        # (hierarchical: the key holds the tensor's shape and dtype too, which no header checks where the node
        # stage sums the tensors uncompressed and no payload crosses a node: one node)
        key = (base, ex.route.key if ex.layout is None else protocol.small_hash(
            f"{ex.route.key}|{ex.expect.fingerprint}", protocol.TAG_RANGE ** 2), ex.fault is not None)
        vector = self._controls.get(key)
        if vector is None:  # (made once per tensor and outcome: Horovod reduces a copy in place)
            if len(self._controls) > 4096:
                self._controls.clear()
            tags = protocol.exchange_tags(base[3], self.creation_index, base[4].tag(base[5]), key[1])
            vector = self._controls[key] = protocol.control_vector(*base[:3], tags, failed=key[2])
        return vector.copy()

    # -- stages (hvd_qsgd.driver) -------------------------------------------------------------

    def _next_stage(self, ex):
        """The driver's step once ex's collective has completed: True when another collective was
        started that ex now waits on. Never raises (other exchanges' calls run it): an error is kept
        in ``ex.stage_error`` for its own decompress."""
        try:
            # (its decodes' results go on to other ranks: their verdicts are read in the call, also
            # where a decompress waiting for its own result runs this stage)
            with ex.backend.deferred_verdicts(None):
                if ex.stage == "presence":
                    return self._after_presence(ex)
                return ex.chain.advance(self, ex)
        except Exception as e:
            ex.stage_error = e
        return False

    def _after_presence(self, ex):
        """Every rank of the set took part: the chain's first collective. Some have joined: the
        allreduce of this rank's dequantized payload (the joined ranks add zeros)."""
        reduced, ex.handle = self.collectives.wait(ex.handle), None
        if ex.offsets is not None:  # a fusion buffer: its last entry, the ranks that could not encode it
            reduced = self.buffers.check_encoded(ex, reduced)
        ex.present = protocol.present_ranks(reduced, ex.where)  # a NumPy vector
        if ex.fault is not None:  # the control check raises on every rank; nothing more starts
            return False
        if len(ex.present) < len(ex.set_ranks) and ex.reduction != "fused":  # (fused: once it closes)
            refusal = joined_refusal(len(ex.set_ranks), ex.present)
            if refusal is not None:
                raise refusal   # (kept for its decompress: every stepping rank sees the same presence)
            ex.stage = "joined"
            own, ex.payload = ex.chain.own_dequantized(ex), None
            ex.handle = self.collectives.allreduce(own, f"{ex.route.exchange}.joined", ex.group)
            return False
        return ex.chain.start(self, ex)

    def timed(self, field, make, *after):
        """make(), its time added to the statistics field ``field`` (``after``: what it reads, which a
        graph-building runner orders it after)."""
        t0 = time.perf_counter()
        try:
            return make()
        finally:
            self.stats.add(**{field: time.perf_counter() - t0})

    def wait(self, handle):
        """The result of a collective, the time blocked on it counted in ``wait_s``."""
        t0 = time.perf_counter()
        try:
            return self.driver.wait(handle)
        finally:
            self.stats.add(wait_s=time.perf_counter() - t0)

    # -- decompress ---------------------------------------------------------------------------

    def finish(self, ex, reduced_control):
        """The exchange's result (the backend's float32 array of numel elements), once the reduced
        control vector (a NumPy array) checked; raises what went wrong, on every rank alike."""
        group = None if ex.fused is None else self.buffers if ex.reduction == "buffered" else self.fusion
        try:
            if ex.stage == "deferred" or group is self.fusion and ex.fused.stage == "deferred":
                self._start_deferred(ex, reduced_control)   # the step's deferred exchanges start now
            if group is self.buffers:  # a fusion buffer, closed here if still open: its first collective
                # at once where every rank steps alike (the presence allreduce could only confirm it)
                fused = group.close(self, ex, lambda: self._first_collective(ex, reduced_control))
            else:
                fused = None if group is None else group.close(self, ex)   # a fused exchange
        except Exception:
            # its first collective could not start: Horovod has stopped, as it does when a rank that
            # found this step's mismatch raised and exited first. The control vector, reduced already,
            # names that mismatch here too, where it shows one; else the error stands
            self.names.finish(ex.route)
            self.calls.end(ex)
            if group is not None:
                group.clear()
            protocol.check_control(reduced_control, ex.world, ex.set_ranks, ex.where)
            raise
        carrier = fused or ex   # the exchange whose collectives carry ex's payload
        try:
            alpha = ex.alpha = self._check_control(ex, reduced_control, carrier)
        except protocol.MismatchError as e:
            self.driver.forget(carrier)
            if fused is not None:  # every rank raises here: the step's open fused exchanges are dropped
                group.clear()
            raise e from ex.fault  # a numbered slot stays taken: its collectives may never complete
        finally:
            self.names.finish(ex.route)
            self.calls.end(ex)
        waited = 0.0
        try:
            t0 = time.perf_counter()
            self.driver.finish(carrier)  # every rank started its stages (the control check passed)
            waited = time.perf_counter() - t0
            if isinstance(carrier.stage_error, self.collectives.interrupts):
                # a collective failed or the hosts changed: the library's own error, unchanged, so that
                # elastic training (hvd.elastic.run) resets and restores instead of stopping
                raise carrier.stage_error
            if carrier.stage_error is not None:
                raise protocol.MismatchError(f"{ex.where}: {carrier.stage_error}") from carrier.stage_error
            with ex.backend.deferred_verdicts(self._verdicts):   # (the device's: read together, below)
                if fused is not None:
                    out = group.member_finish(self, fused, ex, alpha)
                    if fused.stage == "joined":
                        self._count_joined(ex)
                else:
                    out = self._finish_joined(ex, alpha) if ex.stage == "joined" else ex.chain.finish(self, ex, alpha)
        except BaseException:
            self.stats.add(wait_s=waited)
            raise
        finally:  # every rank waited for this exchange's collectives: its slot may be used again
            self.names.release_slot(ex.route.slot)
            if fused is not None:
                group.member_done(ex)
        return self._hand_over(ex, carrier, out, waited)

    def _hand_over(self, ex, carrier, out, waited):
        """The exchange's result, counted (``waited``: the seconds its decompress was blocked on its
        collectives), once the device's verdicts kept so far were read where this is the step's last
        result (no exchange left between compress and decompress), or one the bits policy reads, or
        too many wait."""
        if carrier.stage != "joined":
            self.stats.add(wait_s=waited,
                           allreduce_bytes=cost_model.fp32_allreduce_bytes(len(ex.set_ranks), ex.expect.numel))
            self._slowdown.observe(self.stats.as_dict, self.owner)
        else:
            self.stats.add(wait_s=waited)
        if self._verdicts and (not self.names.pending or self.policy.observes or len(self._verdicts) >= SETTLE_AT):
            ex.backend.settle(self._verdicts)
        if self.policy.observes:
            self.policy.observe(ex.route.residual_key, ex.backend.host(out).reshape(-1))
        return out

    def run_in_order(self, ex, alpha):
        """alpha * sum: the stages one after another, without presence or control vector, for blocking
        collectives matched by call order, every rank's exchange checked alike (``hvd_qsgd.mpi``)."""
        out = run_stages(self, ex, alpha)
        self.stats.add(allreduce_bytes=cost_model.fp32_allreduce_bytes(len(ex.set_ranks), ex.expect.numel))
        return out

    # -- elastic training ---------------------------------------------------------------------

    def reset(self, residuals=True):
        """Forget every exchange in progress, and with ``residuals`` the error-feedback residuals (and
        the bits policy's state); the exchange counters are kept."""
        self.names.reset()
        self.openings.clear()
        self.driver.reset()
        self.fusion.clear()
        self.buffers.clear()
        with self.lock:
            self._deferred = {}
        self.calls.clear()
        self._verdicts.clear()   # (of results the interrupted step will not use)
        if residuals:
            with self.lock:
                self.residuals.clear()
            self.policy.reset()
