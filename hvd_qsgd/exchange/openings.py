"""What every exchange of one tensor starts with, kept across steps (``ExchangeRunner.open``).

A tensor (its parameter's name, shape, dtype, device and process set) exchanged with the same
settings opens the same way at every step: the same expectation of the headers, backend, node layout
and reduction. Working them out is most of what compress costs a tensor in Python, so each
tensor's opening is made once (``of``: ``ExchangeRunner.open_exchange`` and ``resolve``, or its
fusion buffer) and each exchange of it starts from a copy of its fields (``Exchange.of``); the
backend's fallback, when there is one, is counted and logged for each exchange as before. An opening
whose resolution found a fault (a node layout the hierarchical reduction cannot use) is not kept:
each exchange of that tensor is opened anew and raises it, on every rank.
"""
from types import SimpleNamespace

from hvd_qsgd import codec
from hvd_qsgd.exchange.buffers import BufferGroup, FusionBuffers

KEPT = 4096   # openings kept at most (then the store starts again: DQSGD's settings vary by step)
UNIQUE = ("route", "where")   # the fields that are each exchange's own


class Openings:
    """The openings of one runner, by tensor and settings."""

    def __init__(self):
        self._kept = {}

    def of(self, run, route, where, settings, numel, dtype, shape, device_type, group, set_ranks, global_rank,
           world, per_node, place=None, alone=False, order=None):
        """The opening of a tensor (``ExchangeRunner.open``'s arguments), made through ``run`` the first
        time and kept. Settings and group are known by their ids: the opening holds both in its fields,
        so each id stays theirs while it is kept (the bits policies hand out one settings object per
        bit width). ``place``: the caller's object for the other arguments (known by its identity,
        and kept in the key), or None. ``alone``: the tensor goes in no fused exchange or fusion buffer
        (``ExchangeRunner.open``); ``order``: the ``ParameterOrder`` that plans its fusion buffer, or None."""
        if place is not None:
            key = (id(settings), route.param, place, alone, order)
        else:
            key = (id(settings), numel, dtype, tuple(shape), route.param, device_type, id(group), tuple(set_ranks),
                   global_rank, world, per_node, alone, order)
        opening = self._kept.get(key)
        if opening is not None:
            return opening
        ex = run.open_exchange(route, where, settings, numel, dtype, device_type, group, set_ranks, global_rank,
                               world, per_node, codec.tensor_fingerprint(route.param or "", shape, dtype))
        ex.alone, ex.order = alone, order
        fallback = None
        if FusionBuffers.takes(ex):
            ex.reduction = "buffered"   # its fusion buffer's chain carries it (hvd_qsgd.exchange.buffers)
            ex.group_key = BufferGroup.of(ex)  # (the buffers it may share)
        else:
            fallback = run.resolve(ex, count=False)
        ex.control_base = ex.control_fields()
        opening = SimpleNamespace(fields={k: v for k, v in ex.__dict__.items() if k not in UNIQUE},
                                  fallback=fallback)
        if ex.fault is None:
            if len(self._kept) >= KEPT:
                self._kept.clear()
            self._kept[key] = opening
        return opening

    def clear(self):
        self._kept.clear()
