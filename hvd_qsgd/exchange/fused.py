"""Fusion (``Settings.fusion``): a step's allgather exchanges in one presence allreduce and one allgather.

Without fusion every compressed tensor costs three collectives: its control vector (Horovod's
allreduce of what compress returns), its presence allreduce and its allgather, each negotiated by
Horovod's background loop (docs/performance.md, "Per-tensor cost"). With fusion, a tensor whose
reduction resolves to allgather is encoded as it is compressed, exactly as the allgather chain
encodes it (its own buckets, header, fingerprint, seed and residual), and joins its group's open
fused exchange (one per process set and backend):

    open        the first member opens it (its name: the lowest free slot, ``hvd_qsgd.<k>.f<slot>``)
                and starts its presence allreduce, as an unfused exchange does in compress
    close       the first decompress of a member closes it: every rank gets there after the same
                compress calls (what the members' control vectors check), so every rank holds the
                same members
    gather      once closed and its presence known: one allgather of this rank's payloads back to
                back (ranks joined with ``hvd.join``: one allreduce of the dequantized payloads back
                to back instead)
    cut         once: the gathered bytes cut into each rank's payloads (the fixed coding at this
                rank's lengths, which every rank shares; else at each header's length)
    finish      each member at its own decompress, after its own control vector checked: its n
                payloads' headers checked and decoded as the allgather chain does, alpha * sum

Each member keeps its control vector (its name, settings, order and failures checked on every rank)
and its payloads' checks, and its result is the unfused allgather's bit for bit: the same payloads,
decoded in the same order. A member a rank could not encode sends nothing (zeros while ranks have
joined): every rank still starts the same collectives, and the cut fails on every rank alike.
Two collectives per fused exchange replace two per member.
"""
import threading
import time

from hvd_qsgd import codec, protocol
from hvd_qsgd.exchange.chains import AllgatherChain, Exchange
from hvd_qsgd.exchange.deferred import on_thread
from hvd_qsgd.exchange.joined import joined_refusal
from hvd_qsgd.state import Route


class FusedGroups:
    """The fused exchanges of one runner: the open one of each process set and backend."""

    def __init__(self, names):
        self._names = names
        self._lock = threading.Lock()
        self._open = {}
        self.closed = 0   # fused exchanges closed so far

    def add(self, ex, start):
        """Keep an encoded allgather exchange in its group's open fused exchange; the first member
        opens one and ``start``s its presence allreduce."""
        key = key_of(ex)
        with self._lock:
            fused = self._open.get(key)
            opened = fused is None
            if opened:
                name, slot = opened_name(self._names, ex, "f")
                fused = self._open[key] = Exchange(
                    route=Route(name, name, 0, 0, None, None, slot), where=f"hvd_qsgd: fused exchange {name}",
                    reduction="fused", chain=FusedAllgatherChain, backend=ex.backend, group=ex.group,
                    set_ranks=ex.set_ranks, world=ex.world, global_rank=ex.global_rank, set_rank=ex.set_rank,
                    nodes=ex.nodes, settings=ex.settings, members=[], lock=threading.Lock(),
                    defer="unnamed" if ex.defer == "unnamed" else None)   # (``hvd_qsgd.exchange.deferred``)
            fused.members.append(ex)
            ex.fused = fused
        if opened:
            start(fused)

    def close(self, run, ex):
        """The fused exchange of member ``ex``, closed on the first call for it: no member joins it
        any more, and once its presence allreduce has completed its collective starts."""
        fused = ex.fused
        with self._lock:
            if self._open.get(key_of(fused)) is fused:
                del self._open[key_of(fused)]
        with fused.lock:
            if fused.pending is not None:
                return fused
            fused.pending = len(fused.members)
            fused.where = f"{fused.where} of {len(fused.members)} tensors"
            self.closed += 1
            if fused.stage == "present":
                FusedAllgatherChain.launch(run, fused)
        return fused

    @staticmethod
    def member_finish(run, fused, ex, alpha):
        return FusedAllgatherChain.member_finish(run, fused, ex, alpha)

    def member_done(self, ex):
        """Member ``ex`` has its result: once every member has, the fused exchange's name is free."""
        fused = ex.fused
        with fused.lock:
            fused.pending -= 1
            last = fused.pending == 0
        if last:
            self._names.release_slot(fused.route.slot)

    def clear(self):
        """Forget the open fused exchanges (an elastic reset, or a step that raised)."""
        with self._lock:
            self._open = {}


def key_of(ex):
    """The group of an exchange: its process set and backend (a fused exchange's are its members'); of
    an unnamed call, its thread's too (``opened_name``)."""
    return (id(ex.group), ex.backend.name, tuple(ex.set_ranks), on_thread(ex))


def opened_name(names, first, kind):
    """(name, slot) of a fused exchange or fusion buffer (``kind``: "f", "b") opened by ``first``:
    after ``first``'s own name where its call names it (``ExchangeNames.route``; the name is its
    while it is in flight, so no other rank's thread takes it first), else the lowest free slot."""
    r = first.route
    if r.slot is None and r.param is None:
        return f"{r.exchange}{names.sep}{kind}", None
    slot = names.take_slot()
    return names.name(f"{kind}{slot}"), slot


class FusedAllgatherChain:
    """The stages of a fused exchange (see the module docstring)."""

    name = "fused"

    @staticmethod
    def start(run, ex):
        """The presence allreduce has completed: the collective starts now if the exchange is closed,
        else when it closes (``FusedGroups.close``)."""
        with ex.lock:
            ex.stage = "present"
            if ex.pending is not None:
                FusedAllgatherChain.launch(run, ex)
        return False

    @staticmethod
    def launch(run, ex):
        """Every member's payload back to back in one allgather; with ranks joined (``hvd.join``),
        their dequantized payloads back to back in one allreduce (a member this rank could not
        encode adds nothing to the allgather, zeros to the allreduce: every rank starts the same
        collective, and every member raises)."""
        b = ex.backend
        if len(ex.present) < len(ex.set_ranks):
            ex.stage, ex.stage_error = "joined", joined_refusal(len(ex.set_ranks), ex.present)
            if ex.stage_error is not None:   # (every member's decompress raises it, alike on every stepping rank)
                return
            like = next((m.payload for m in ex.members if m.payload is not None), None)
            own = b.concat([b.zeros(m.expect.numel, like) if m.payload is None else AllgatherChain.own_dequantized(m)
                            for m in ex.members])
            ex.handle = run.collectives.allreduce(own, f"{ex.route.exchange}.joined", ex.group)
        else:
            ex.stage = "gather"
            ex.handle = run.collectives.allgather(b.concat([m.payload for m in ex.members if m.payload is not None]),
                                                  ex.route.exchange, ex.group)
        for m in ex.members:
            m.payload = None

    @staticmethod
    def advance(run, ex):
        raise AssertionError("a fused exchange has one collective after its presence allreduce")

    @staticmethod
    def member_finish(run, ex, member, alpha):
        """Member's result: alpha * the decoded sum of its n payloads."""
        b, where, n = ex.backend, member.where, len(ex.set_ranks)
        k = ex.members.index(member)
        if ex.stage == "joined":
            joined = FusedAllgatherChain._cut(run, ex)
            begin = sum(m.expect.numel for m in ex.members[:k])
            out = joined[begin:begin + member.expect.numel]
            return out * alpha if alpha != 1.0 else out
        t0 = time.perf_counter()
        payloads = FusedAllgatherChain._cut(run, ex)[k::len(ex.members)]   # member k's, rank after rank
        try:
            protocol.check_gathered(headers := b.read_headers(payloads, where), member.expect, where)
        except Exception:
            if ex.cut == "by headers":  # cut at this rank's lengths: cut again at the headers', whose checks say what differs
                raise
            with ex.lock:
                ex.cut = "by headers"
                ex.payload = b.split_fused(ex.gathered, n, _lengths(ex), True, ex.where)
            payloads = ex.payload[k::len(ex.members)]
            protocol.check_gathered(headers := b.read_headers(payloads, where), member.expect, where)
        out = b.decode_sum(payloads, alpha, where, headers)
        remote = ex.remote_ranks()
        run.stats.add(decode_s=time.perf_counter() - t0)
        run.stats.exchanged(member.expect.numel, member.own_len, sum(len(p) for p in payloads) - member.own_len,
                            member.own_len * len(remote), sum(len(payloads[j]) for j in remote))
        return out

    @staticmethod
    def _cut(run, ex):
        """The fused collective's result once: the joined allreduce's sum, or the gathered payloads
        rank after rank (a failure kept and raised for every member alike)."""
        with ex.lock:
            if ex.payload is None and ex.stage_error is None:
                try:
                    result = run.wait(ex.handle)
                    ex.handle = None
                    if ex.stage == "joined":
                        ex.payload = result
                    else:
                        ex.gathered, by_headers = result, ex.settings.coding != "fixed"
                        ex.cut = "by headers" if by_headers else "by lengths"
                        ex.payload = ex.backend.split_fused(result, len(ex.set_ranks), _lengths(ex), by_headers,
                                                            ex.where)
                except Exception as e:
                    ex.stage_error = e
            if isinstance(ex.stage_error, run.collectives.interrupts):
                raise ex.stage_error   # as the runner raises it: elastic training resets on it
            if ex.stage_error is not None:
                mine = [m for m in ex.members if m.fault is not None]
                said = str(ex.stage_error)   # (the cut's own error names the exchange already)
                raise protocol.MismatchError(
                    (said if said.startswith(ex.where) else f"{ex.where}: {said}")
                    + (f" (this rank could not encode {mine[0].where}: {mine[0].fault})" if mine else
                       f"; {protocol.FUSED_HINT}" if isinstance(ex.stage_error, codec.PayloadError) else "")
                ) from ex.stage_error
            return ex.payload


def _lengths(ex):
    """This rank's payload length of each member (0 for one it could not encode: it sent nothing)."""
    return [m.own_len or 0 for m in ex.members]
