"""What every exchange of one tensor starts with, kept across steps (``ExchangeRunner.open``).

A tensor (its parameter's name, shape, dtype, device and process set) exchanged with the same
settings opens the same way at every step: the same expectation of the headers, backend, node layout
and reduction. Working them out is most of what compress costs a tensor in Python, so each
tensor's opening is made once (``make``: ``ExchangeRunner.open_exchange`` and ``resolve``, or its
fusion buffer) and each exchange of it starts from a copy of its fields (``Exchange.of``); the
backend's fallback, when there is one, is counted and logged for each exchange as before. An opening
whose resolution found a fault (a node layout the hierarchical reduction cannot use) is not kept:
each exchange of that tensor is opened anew and raises it, on every rank.
"""
from types import SimpleNamespace

from hvd_qsgd.exchange.buffers import FusionBuffers, group_of

KEPT = 4096   # openings kept at most (then the store starts again: DQSGD's settings vary by step)
UNIQUE = ("route", "where")   # the fields that are each exchange's own


class Openings:
    """The openings of one runner, by the key ``ExchangeRunner.open`` makes of a tensor and its
    settings (every value it reads from the exchange's arguments)."""

    def __init__(self):
        self._kept = {}

    def get(self, key):
        return self._kept.get(key)

    def make(self, run, key, route, where, settings, group, set_ranks, fingerprint):
        """The opening of ``key`` = (id(settings), numel, dtype, shape, name, device type, id(group),
        tuple(set_ranks), global rank, world, ranks per node), made through ``run`` and kept (with
        ``settings`` and ``group`` in its fields, so that their ids stay theirs while it is kept; the
        bits policies hand out one settings object per bit width)."""
        _, numel, dtype, _, _, device_type, _, _, global_rank, world, per_node = key
        ex = run.open_exchange(route, where, settings, numel, dtype, device_type, group, set_ranks, global_rank,
                               world, per_node, fingerprint)
        fallback = None
        if FusionBuffers.takes(ex):
            ex.reduction = "buffered"   # its fusion buffer's chain carries it (hvd_qsgd.exchange.buffers)
            ex.group_key = group_of(ex)  # (the buffers it may share)
        else:
            fallback = run.resolve(ex, count=False)
        opening = SimpleNamespace(fields={k: v for k, v in ex.__dict__.items() if k not in UNIQUE},
                                  fallback=fallback)
        if ex.fault is None:
            if len(self._kept) >= KEPT:
                self._kept.clear()
            self._kept[key] = opening
        return opening

    def clear(self):
        self._kept.clear()
