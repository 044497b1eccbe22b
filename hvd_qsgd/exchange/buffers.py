"""Fusion buffers (``Settings.fusion_mb``): a step's compressed tensors quantized together, one
payload per buffer.

Without them every compressed tensor pays its own encode, payload collectives and decode, each at a
fixed price in Python and in Horovod's negotiation (docs/performance.md, "Per-tensor cost"). With
``fusion_mb``, a tensor that fits joins a buffer of its group (one group per process set, backend,
settings and dtype), at a multiple of ``bucket_size``, so that it keeps its own QSGD buckets (no
bucket holds two tensors): its planned buffer and offset, where the optimizer that hands it over
plans them (``hvd_qsgd.exchange.buffer_plan``), else the open buffer's next multiple; the buffer is
then one exchange of its own, through the chain of the reduction its size resolves to
(``hvd_qsgd.exchange.chains``):

    add         compress: the tensor kept (not copied: Horovod's contract, as for its own
                allreduce, is that it is not written before synchronize) at its offset; a planned
                buffer closes once its last member is there; otherwise a tensor that does not fit
                closes the open buffer first and opens the next one, and a buffer too full for any
                compressed tensor (``min_numel``) closes at once. The tensor's
                control vector carries the buffer and the offset in its exchange key, so ranks that
                fused differently fail the control check, on every rank, before any rank waits on a
                buffer
    close       when full, or at the first decompress of a member: the members encoded where they are
                (``codec_segments``: allgather's payload or scatter_allgather's chunk payloads, on
                the CPU; with error feedback ``error_feedback.encode_members``, each member's
                residual read and updated where it is) or copied into the group's staging array
                (zeros between them), encoded as one tensor with their error-feedback residuals;
                each residual is kept under its member's own key; and the buffer's
                presence allreduce started, with one more entry: the ranks that could not encode it
                (then nothing more starts, and every member raises on every rank). At a member's
                decompress, where that member's reduced control vector shows every rank stepping
                alike, the chain's first collective instead, as with ``overlap`` below. With
                ``overlap``, its chain's first collective instead (``ExchangeRunner._start_now``):
                a full buffer goes on the wire during the backward pass, as DDP's buckets do; a rank
                that could not encode it sends nothing, which every rank sees, and every member
                raises on every rank
    finish      the buffer's chain once, its decode scaled by the first finishing member's alpha (the
                same bits as alpha times the unscaled sum); each member: its slice of the result (a
                view, as DDP's gradients are views of its buckets). A member whose alpha differs (an
                ``hvd.allreduce_async`` of another op sharing the buffer) scales its slice by the
                ratio of the two, in place: the same on every rank, within rounding of alpha times
                its sum; the joined path's sum is scaled by each member

The payload's header records the buffer's numel and the fingerprint of its layout (each member's
fingerprint at its offset). A tensor larger than a buffer goes alone, as without fusion buffers.
Counted in ``stats`` by member: elements without the padding, one tensor per member.
"""
import collections
import functools
import operator
import threading

from hvd_qsgd import codec, codec_segments, protocol
from hvd_qsgd.exchange.buffer_plan import plan_of
from hvd_qsgd.exchange.deferred import NO_STAGES, on_thread
from hvd_qsgd.exchange.fused import opened_name
from hvd_qsgd.state import Route

RECENT = 16   # closed buffers whose layout ``recent`` keeps
KEPT_GROUPS = 4096   # groups ``BufferGroup.of`` keeps at most (then it starts again)


class FusionBuffers:
    """The fusion buffers of one runner: the open one of each group, the staging arrays, the
    layouts of the last buffers closed (``recent``: name, occurrence, members' (label, offset,
    numel)). Thread-safe."""

    def __init__(self, names):
        self._names = names
        self._lock = threading.Lock()
        self._open = {}
        self._staging = {}
        self._occurrences = collections.Counter()
        self.recent = collections.deque(maxlen=RECENT)

    @staticmethod
    def takes(ex):
        """Whether a fusion buffer carries ``ex``: the setting is on, the rank is in the set, the
        tensor fits in a buffer and does not go alone (``ExchangeRunner.open``)."""
        s = ex.settings
        return (bool(s.fusion_mb) and ex.set_rank is not None and ex.expect.numel <= s.fusion_elements()
                and not ex.alone)

    def add(self, run, ex):
        """Place member ``ex`` (its input in ``ex.source``; None after a fault: zeros hold its place)
        in its planned buffer (``hvd_qsgd.exchange.buffer_plan``), or else in its group's open buffer,
        closing that buffer first where ``ex`` does not fit."""
        group = ex.group_key or BufferGroup.of(ex)   # (a member's: its opening's, hvd_qsgd.exchange.openings)
        numel, bucket, cap = ex.expect.numel, group.bucket, group.cap
        if ex.order is not None:
            plan = plan_of(ex.order, group)
            planned = plan.places.get(ex.route.param)
            if (planned is not None and plan.numels[planned[0]] >= planned[1] + numel
                    and self._add_planned(run, ex, group, plan, *planned)):
                return
        key = group, on_thread(ex)   # (an unnamed call's: its thread's buffers)
        with self._lock:
            buf = self._open.get(key)
            if buf is None:
                buf, offset = self._new(run, ex, key), 0
            else:
                offset = -(-buf.expect.numel // bucket) * bucket
                if offset + numel > cap:
                    del self._open[key]
                    self._close(run, buf)
                    buf, offset = self._new(run, ex, key), 0
            buf.members.append(ex)
            buf.offsets.append(offset)
            buf.expect.numel = end = offset + numel
            ex.fused, ex.offset = buf, offset
            r = ex.route   # (its key: the buffer's slot and the offset too)
            ex.route = _tuple_new(Route, (r.exchange, r.seed_name, r.occurrence,
                                          _member_key(r.key, buf.route.slot, offset), r.residual_key, r.param, r.slot))
            if -(-end // bucket) * bucket > group.room:  # full: no compressed tensor fits any more
                del self._open[key]
                self._close(run, buf)

    def _add_planned(self, run, ex, group, plan, index, offset):
        """Place ``ex`` at its planned ``offset`` in buffer ``index`` of its plan, which closes once its
        last member is there; False where that place is taken (a second gradient of the parameter
        before the buffer closed: it takes the open buffer of its group)."""
        key = group, plan, index
        with self._lock:
            buf = self._open.get(key)
            if buf is not None and offset in buf.offsets:
                return False
            if buf is None:
                buf = self._new(run, ex, key, self._names.name(f"b{plan.tag}.{index}"))
                buf.plan = plan
            buf.members.append(ex)
            buf.offsets.append(offset)
            ex.fused, ex.offset = buf, offset
            r = ex.route
            ex.route = _tuple_new(Route, (r.exchange, r.seed_name, r.occurrence,
                                          _member_key(r.key, buf.route.exchange, offset), r.residual_key, r.param,
                                          r.slot))
            if len(buf.members) == plan.counts[index] and (
                    ex.settings.overlap or not plan.open_last or index < len(plan.counts) - 1):
                del self._open[key]
                self._close(run, buf)
        return True

    def _new(self, run, first, key, planned_name=None):
        """A new open buffer of group ``key``, whose first member is ``first`` (named
        ``planned_name``, where its plan names it)."""
        name, slot = (planned_name, None) if planned_name is not None else opened_name(self._names, first, "b")
        if slot is None and planned_name is None:   # (named after a call's tensor: seeded as that tensor)
            seed_name, occurrence = first.route.seed_name, 0
        else:
            seed_name, occurrence = name, self._occurrences[name]
            self._occurrences[name] += 1
        buf = run.open_exchange(Route(name, seed_name, occurrence, 0, name, None, slot),
                                f"hvd_qsgd: fusion buffer {name}", first.settings, 0, first.expect.dtype,
                                first.device_type, first.group, first.set_ranks, first.global_rank, first.world,
                                first.per_node)
        buf.members, buf.offsets, buf.lock, buf.group_key = [], [], threading.Lock(), key
        buf.origin = first.origin   # (where an empty payload goes: overlap, a rank that cannot encode it)
        self._open[key] = buf
        return buf

    def close(self, run, ex, how=None):
        """Member ``ex``'s buffer, closed on the first call for it (the first decompress of a member);
        ``how()``: how it starts (``ExchangeRunner._first_collective``): "direct", its chain's first
        collective, without a presence allreduce (the member's reduced control vector shows every
        rank stepping alike); "presence"; None: nothing (ranks have joined, and Horovod would answer
        the presence allreduce by writing past its buffer: each member's control check raises)."""
        buf = ex.fused
        with self._lock:
            if self._open.get(buf.group_key) is buf:
                del self._open[buf.group_key]
                start = "presence" if how is None else how()
                buf.direct = start == "direct"
                if start is None:
                    buf.started = NO_STAGES
                else:
                    self._close(run, buf)
        return buf

    def _close(self, run, buf):
        """Encode the buffer (its members at their offsets) and start its presence allreduce."""
        if buf.plan is not None:   # (the members there in the plan's order, packed: one that never came
            buf.members.sort(key=_OFFSET)   # takes no room, as on every rank where it did not)
            bucket, end = buf.group_key[0].bucket, 0
            for m in buf.members:
                m.offset = -(-end // bucket) * bucket
                end = m.offset + m.expect.numel
            buf.offsets = list(map(_OFFSET, buf.members))
        members, offsets = buf.members, buf.offsets
        buf.expect.numel = numel = offsets[-1] + members[-1].expect.numel
        buf.pending = len(members)
        buf.where = f"{buf.where} of {len(members)} tensors ({_labels(members)})"
        buf.expect.fingerprint = _layout_fingerprint(tuple(map(_FINGERPRINT, members)), tuple(offsets), numel,
                                                     buf.expect.dtype)
        run.resolve(buf)
        self.recent.append((buf.route.exchange, buf.route.occurrence,
                            list(zip(map(_SEED_NAME, members), offsets, map(_NUMEL, members)))))
        try:
            if buf.fault is not None:
                raise buf.fault
            run.encode(buf, self._members(buf, numel) or self._stage(buf, numel), lr=None)
        except Exception as e:  # every rank learns it from the presence allreduce
            buf.fault = e
        run.start(buf)

    @staticmethod
    def _members(buf, numel):
        """The buffer as its members where they are (``codec_segments.Members``: no copy into the staging
        array), where its backend encodes it so: an allgather's payload or scatter_allgather's chunk
        payloads, with error feedback too (each member's residual then read and updated where it is:
        ``residual``); else None. With error feedback and a member that could not be encoded (the
        buffer fails on every rank), staged as before."""
        if (buf.reduction not in ("allgather", "scatter_allgather")
                or not buf.backend.encodes_members(buf.settings)):
            return None
        parts, offsets = list(map(_SOURCE, buf.members)), buf.offsets
        if _NONE in set(map(type, parts)):   # (members that could not be encoded: zeros)
            if buf.settings.error_feedback:
                return None
            offsets = [o for p, o in zip(parts, offsets) if p is not None]
            parts = [p for p in parts if p is not None]
        for m in buf.members:   # (the encode reads them before the buffer's first collective starts)
            m.source = None
        return codec_segments.Members(parts, offsets, numel)

    def _stage(self, buf, numel):
        """The members back to back at their offsets in the group's staging array, zeros between."""
        like = next((m.source for m in buf.members if m.source is not None), None)
        b, group = buf.backend, buf.group_key[0]   # (one array a group, whatever the thread: staged under the lock)
        out = self._staging.get(group)
        if out is None or b.length(out) < numel:
            out = b.zeros(max(numel, 0 if out is None else b.length(out)), like)
            self._staging[group] = out
        end = 0
        for m, o in zip(buf.members, buf.offsets):
            out[end:o] = 0
            out[o:o + m.expect.numel] = 0 if m.source is None else m.source
            m.source = None
            end = o + m.expect.numel
        return out[:numel]

    @staticmethod
    def check_encoded(buf, reduced):
        """The presence vector of a buffer without its last entry, once that says every rank encoded
        it (else MismatchError, which every rank raises for every member)."""
        failed = int(round(float(reduced[-1])))
        if failed:
            mine = f" (this rank: {buf.fault})" if buf.fault is not None else ""
            raise protocol.MismatchError(f"{buf.where}: {failed} rank(s) could not encode it{mine}")
        return reduced[:-1]

    # -- error feedback: each member's residual under its own key ------------------------------

    @staticmethod
    def residual(run, buf, x):
        """The members' residuals at their offsets (zeros between and for a member without one,
        each rescaled by its learning rates), and whether any member had one. Where ``x`` is the
        members where they are (``codec_segments.Members``), the same as a list: each member's own
        residual (the one kept, or its rescaled copy; zeros for a member without one)."""
        if type(x) is codec_segments.Members:
            kept = [run.kept_residual(m, p, m.expect.numel) for m, p in zip(buf.members, x.parts)]
            return ([buf.backend.zeros(m.expect.numel, p) if k is None else k
                     for m, p, k in zip(buf.members, x.parts, kept)], any(k is not None for k in kept))
        out, valid = buf.backend.zeros(buf.expect.numel, x), False
        for m, o in zip(buf.members, buf.offsets):
            kept = run.kept_residual(m, x, m.expect.numel)
            if kept is not None:
                out[o:o + m.expect.numel] = kept
                valid = True
        return out, valid

    @staticmethod
    def keep_residuals(run, buf, residual):
        """Each member's residual kept under its own key: its slice of the buffer's, or its own
        (``residual``'s list)."""
        if type(residual) is list:
            for m, r in zip(buf.members, residual):
                run.residuals.keep(m.route.residual_key, r, m.lr)
            return
        for m, o in zip(buf.members, buf.offsets):
            run.residuals.keep(m.route.residual_key, residual[o:o + m.expect.numel], m.lr)

    # -- decompress ----------------------------------------------------------------------------

    @staticmethod
    def member_finish(run, buf, ex, alpha):
        """Member ``ex``'s result: its slice of the buffer's, computed once, scaled by ``alpha``."""
        with buf.lock:
            if buf.gathered is None and buf.stage_error is None:
                try:
                    if buf.stage == "joined":   # (the stepping ranks' sum: each member scales its slice)
                        buf.gathered, buf.scale = run.wait(buf.handle), 1.0
                    else:   # the first member's alpha in the decode (the bits of alpha * the sum's slice)
                        buf.scale = alpha or 1.0
                        buf.gathered = buf.chain.finish(run, buf, buf.scale)
                        run.stats.add(elements=sum(m.expect.numel for m in buf.members) - buf.expect.numel,
                                      tensors=len(buf.members) - 1)   # (by member: no padding, one tensor each)
                except Exception as e:  # (a failed collective stays itself, for elastic training)
                    buf.stage_error = e if buf.fault is None or isinstance(e, run.collectives.interrupts) else \
                        protocol.MismatchError(f"{buf.where}: this rank could not encode it: {buf.fault}")
            if buf.stage_error is not None:
                if isinstance(buf.stage_error, run.collectives.interrupts):
                    raise buf.stage_error
                raise protocol.MismatchError(f"{ex.where}: {buf.stage_error}") from buf.stage_error
        o = ex.offset
        out = buf.gathered[o:o + ex.expect.numel]   # a view: no copy (the result pool hands the buffer's
        if alpha != buf.scale:                      # array out again only once no member's result holds it)
            out *= alpha / buf.scale   # (each member's slice is its own: scaled once, here; a member of
        return out                     # another op than the first's: within rounding of alpha * its sum)

    def member_done(self, ex):
        """Member ``ex`` has its result: once every member has, the buffer's name is free."""
        buf = ex.fused
        with buf.lock:
            buf.pending -= 1
            last = buf.pending == 0
        if last:  # (its result array to the backend's pool again; a member holds its buffer and back)
            buf.gathered = None
            self._names.release_slot(buf.route.slot)

    def clear(self):
        """Forget the open buffers (an elastic reset, or a step that raised)."""
        with self._lock:
            for buf in self._open.values():
                self._names.release_slot(buf.route.slot)
            self._open = {}


class BufferGroup:
    """The buffers a tensor may share: those of its process set, backend, settings and dtype (``key``),
    with what placing a member reads: the bucket size, the elements a buffer holds (``cap``) and the
    most a buffer may hold and still take a compressed tensor (``room``). Equal by key; hashed once."""

    __slots__ = ("key", "bucket", "cap", "room", "_hash")

    def __init__(self, key, settings):
        self.key, self._hash = key, hash(key)
        self.bucket, self.cap = settings.bucket_size, settings.fusion_elements()
        self.room = self.cap - settings.min_numel

    @classmethod
    def of(cls, ex):
        """Exchange ``ex``'s group: one object per key while ``_GROUPS`` keeps it (so that a dictionary
        finds it by identity; an equal one made after is found by its key)."""
        key = (id(ex.group), tuple(ex.set_ranks), ex.backend.name, ex.device_type, ex.settings, ex.expect.dtype)
        group = _GROUPS.get(key)
        if group is None:
            if len(_GROUPS) >= KEPT_GROUPS:
                _GROUPS.clear()
            group = _GROUPS[key] = cls(key, ex.settings)
        return group

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return type(other) is BufferGroup and other.key == self.key


_GROUPS = {}


@functools.lru_cache(maxsize=65536)
def _member_key(key, slot, offset):
    """The control vector's exchange key of a member: its own, its buffer's slot and its offset (the
    same members land at the same places step after step: hashed once each)."""
    return protocol.small_hash(f"{key}|{slot}|{offset}", protocol.TAG_RANGE ** 2)


_FINGERPRINT, _SEED_NAME = operator.attrgetter("expect.fingerprint"), operator.attrgetter("route.seed_name")
_NUMEL, _SOURCE = operator.attrgetter("expect.numel"), operator.attrgetter("source")
_OFFSET = operator.attrgetter("offset")
_NONE = type(None)
_tuple_new = tuple.__new__   # (a Route of its fields in order, without its generated __new__)


@functools.lru_cache(maxsize=256)
def _layout_fingerprint(fingerprints, offsets, numel, dtype):
    """A buffer's fingerprint: its members' at their offsets (a step's buffers have the layouts of the
    step before: worked out once each)."""
    return codec.tensor_fingerprint("|".join(f"{f}@{o}" for f, o in zip(fingerprints, offsets)), (numel,), dtype)


def _labels(members, shown=4):
    names = [m.route.param or m.route.seed_name.rsplit(".", 1)[-1] for m in members[:shown]]
    return ", ".join(names) + (f" and {len(members) - shown} more" if len(members) > shown else "")

