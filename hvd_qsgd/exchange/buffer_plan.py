"""Fusion buffers laid out in advance from the optimizer's parameters (``Settings.fusion_mb``).

Where fusion buffers take tensors in the order they come, every rank must hand them over in the
same order: a parameter without a gradient on some ranks (a branch their batch did not take), whose
gradient Horovod's ``synchronize()`` hands over last there, would sit in another buffer, at another
offset, on those ranks. Horovod's optimizer knows every gradient it will hand over each step: the
parameters that required a gradient when it was made (``_requires_update``; one without a gradient
is handed over as zeros). So where the adapter can read them (``ParameterOrder``), a gradient's
buffer and offset come from that list instead, the same on every rank whatever the order of arrival:

    order       the parameters in reverse order of the optimizer's groups (the order the backward
                pass of a network built in that order produces them, as DDP's buckets assume), each
                with its numel, dtype and device
    plan        per buffer group (``hvd_qsgd.exchange.buffers.BufferGroup``: dtype, device, settings
                and set), its members in that order, packed as the buffers would take them arriving
                in it: each at the next multiple of ``bucket_size``, a new buffer where one does not
                fit in ``cap`` or where the buffer can take no compressed tensor any more (``room``);
                members only what would go in a buffer (at least ``min_numel`` and at most ``cap``
                elements)
    close       a planned buffer closes once all its members are there (with ``overlap``, it goes on
                the wire then; without, the plan's last buffer, where not full, waits as the last
                buffer did), or at the first decompress of a member, as before, with the members
                there packed in the plan's order: one that never comes (a sparse gradient, which
                Horovod reduces without the compressor) takes no room, and where it comes on some
                ranks only, the buffer's size and layout fingerprint say so on every rank

A planned buffer is named after its plan and index (``b<tag>.<index>``), not after the order in
which buffers opened. A gradient its plan does not hold (another shape than its parameter's, a call
of ``hvd.allreduce``) takes the open buffer of its group as before.
"""
import functools

from hvd_qsgd import protocol


class ParameterOrder:
    """The gradients an optimizer hands over each step, in the order their buffers are planned:
    (name, numel, dtype, device_type) each. Known by identity: the adapter keeps one per optimizer."""

    __slots__ = ("entries", "tag", "__weakref__")

    def __init__(self, entries):
        self.entries = tuple(entries)
        # (names the buffers: the same on every rank of the same model)
        self.tag = protocol.small_hash("|".join(f"{n}:{k}:{d}:{t}" for n, k, d, t in self.entries), 2 ** 24)


class BufferPlan:
    """Where each member of one group goes: ``places[name]`` = (buffer index, offset); per buffer
    its elements (``numels``) and its members (``counts``)."""

    __slots__ = ("places", "numels", "counts", "tag", "open_last")

    def __init__(self, order, bucket, cap, room, min_numel, dtype, device_type):
        self.places, self.numels, self.counts, self.tag = {}, [], [], order.tag
        end = None   # (the open buffer's end, None where none is open)
        for name, numel, d, t in order.entries:
            if d != dtype or t != device_type or not min_numel <= numel <= cap:
                continue
            offset = 0 if end is None else -(-end // bucket) * bucket
            if end is None or offset + numel > cap:
                self.numels.append(0)
                self.counts.append(0)
                offset = 0
            self.places[name] = (len(self.numels) - 1, offset)
            end = self.numels[-1] = offset + numel
            self.counts[-1] += 1
            if -(-end // bucket) * bucket > room:   # full: no compressed tensor fits any more
                end = None
        # (the last buffer, unless full, stays open until the first decompress without overlap, as a
        # buffer of tensors taken as they come does: its chain then starts without a presence allreduce)
        self.open_last = end is not None


@functools.lru_cache(maxsize=256)
def plan_of(order, group):
    """The plan of ``order``'s members in ``group`` (a ``BufferGroup``), worked out once."""
    min_numel = group.cap - group.room
    return BufferPlan(order, group.bucket, group.cap, group.room, min_numel, group.key[5], group.key[3])
