"""What a compressor's counters say about the job: the summary ``compression.summary()`` returns,
and the two warnings nobody should have to ask for.

From one rank's cumulative ``Stats`` (``hvd_qsgd.settings``):

    received  = stats["bytes_received"]            payload bytes this rank took off the wire
    fp32      = stats["allreduce_bytes"]           what a ring allreduce of the same tensors in
                                                   fp32 would have made it receive: 2 (n-1)/n * 4 d
                                                   per exchange (``cost_model.received_bytes``)
    saved     = fp32 - received
    codec     = stats["encode_s"] + stats["decode_s"]

At a link of beta bytes/s the wire time saved is saved / beta, and the step-time change the cost
model projects, over everything counted so far, is

    change(beta) = codec - saved / beta            (negative: compression makes steps faster)

This ignores latency terms and overlap with computation: a bandwidth-bound projection, said so
wherever it is printed. The break-even link is saved / codec bytes/s: on links slower than that,
compression pays.

Warnings (each once per compressor, on the ``hvd_qsgd`` logger):

* ``SlowdownWatch``: after ``MIN_EXCHANGES`` compressed exchanges, if the codec time exceeds the
  wire time the bytes saved at the configured link (``link_gbps``, ``HVD_QSGD_BANDWIDTH_GBITS``,
  else 10 Gbit/s): compression then costs more than it saves there.
* ``never_called``: a compressor that has not compressed anything while optimizer steps happen
  (the adapter counts the steps it can see) is a no-op: it was passed to an optimizer that never
  calls it, or to none at all.
"""
import logging
import threading
from typing import Any, Dict, Iterable, Optional

from hvd_qsgd import cost_model

log = logging.getLogger("hvd_qsgd")

DEFAULT_LINKS_GBPS = (1.0, 10.0, 100.0)
MIN_EXCHANGES = 50      # exchanges counted before the slowdown check speaks (first calls warm up)
CHECK_EVERY = 32        # exchanges between two slowdown checks after that (``SlowdownWatch.observe``)
NEVER_CALLED_STEPS = 3  # optimizer steps with no compression before the no-op warning
MANY_COMPRESSORS = 256  # compressors used in one process of a multi-rank job before ``note_used`` warns


def summary(stats: Dict[str, Any], links_gbps: Iterable[float] = DEFAULT_LINKS_GBPS) -> Dict[str, Any]:
    """The summary of one rank's stats (see the module docstring): bytes, codec seconds, and per link
    speed the projected change of the time spent so far (seconds; negative: faster)."""
    received = float(stats.get("bytes_received", 0))
    fp32 = float(stats.get("allreduce_bytes", 0))
    codec_s = float(stats.get("encode_s", 0.0)) + float(stats.get("decode_s", 0.0))
    saved = fp32 - received
    out = {
        "tensors": int(stats.get("tensors", 0)),
        "bytes_sent": int(stats.get("bytes_sent", 0)),
        "bytes_received": int(received),
        "fp32_allreduce_bytes": int(fp32),
        "bytes_saved": int(saved),
        "encode_s": float(stats.get("encode_s", 0.0)),
        "decode_s": float(stats.get("decode_s", 0.0)),
        "wait_s": float(stats.get("wait_s", 0.0)),
        "codec_s": codec_s,
        "break_even_gbps": (saved * 8e-9 / codec_s) if codec_s > 0 and saved > 0 else None,
        "projected_change_s": {},
    }
    if "cross_bytes_sent" in stats:   # (not counted by the TensorFlow adapter: no keys, not zeros)
        out.update(cross_bytes_sent=int(stats["cross_bytes_sent"]), cross_bytes_received=int(stats["cross_bytes_received"]))
    for gbps in links_gbps:
        gbps = float(gbps)
        if not gbps > 0:
            raise ValueError(f"summary: link speeds must be positive Gbit/s, got {gbps!r}")
        out["projected_change_s"][gbps] = codec_s - saved / (gbps * 1e9 / 8)
    return out


class Summarized:
    """``summary()`` from a compressor's ``stats``: ``hvd_qsgd.QSGD`` and the adapters users may pass
    themselves (``hvd_qsgd.torch.QSGD``, ``hvd_qsgd.tensorflow.QSGD``), which name themselves by
    ``PUBLIC_NAME`` and say their Horovod rank by ``_horovod_rank()``."""

    PUBLIC_NAME = "hvd_qsgd.QSGD"

    def summary(self, links_gbps: Iterable[float] = DEFAULT_LINKS_GBPS, print_on_rank0: bool = False
                ) -> Dict[str, Any]:
        """This rank's bytes saved against an fp32 allreduce, its codec and waiting time, and the
        projected change of the time spent so far at each link speed (``hvd_qsgd.report.summary``:
        a bandwidth-only projection). With ``print_on_rank0``, rank 0 also prints it."""
        stats = self.stats
        if any(not isinstance(v, (int, float)) for v in stats.values()):
            raise TypeError(f"{self.PUBLIC_NAME}.summary: the statistics are graph tensors here; call it when "
                            "executing eagerly (or evaluate .stats in the session)")
        s = summary(stats, links_gbps)
        if print_on_rank0 and self._horovod_rank() == 0:
            print(format_summary(s, repr(self)), flush=True)
        return s

    def _horovod_rank(self) -> int:
        raise NotImplementedError


def format_summary(s: Dict[str, Any], name: str = "hvd_qsgd") -> str:
    """The summary as a few lines of text."""
    lines = [f"{name}: {s['tensors']} compressed exchanges; received {s['bytes_received']:,} bytes where an fp32 "
             f"allreduce would have received {s['fp32_allreduce_bytes']:,} (saved {s['bytes_saved']:,})",
             (f"  to and from other nodes: sent {s['cross_bytes_sent']:,} bytes, received "
              f"{s['cross_bytes_received']:,}" if "cross_bytes_sent" in s else
              "  to and from other nodes: not counted (the TensorFlow adapter does not count them)"),
             f"  codec time {s['codec_s']:.3f} s (encode {s['encode_s']:.3f}, decode {s['decode_s']:.3f}); "
             f"waiting for collectives {s['wait_s']:.3f} s"]
    be = s["break_even_gbps"]
    lines.append("  break-even link: " + (f"{be:.2f} Gbit/s (compression pays on slower links)" if be
                                          else "none (no bytes saved)"))
    for gbps, change in s["projected_change_s"].items():
        lines.append(f"  projected at {gbps:g} Gbit/s (bandwidth only, no overlap): {change:+.3f} s "
                     f"({'faster' if change < 0 else 'slower'} than fp32 allreduce)")
    return "\n".join(lines)


class SlowdownWatch:
    """Warns once when the codec time exceeds the wire time its saved bytes buy at the link."""

    def __init__(self, bandwidth_bps: Optional[float] = None):
        self.bandwidth_bps = bandwidth_bps
        self._warned = threading.Event()
        self._calls = 0

    def observe(self, stats_of, where: str) -> bool:
        """One more exchange: ``check(stats_of())`` at the ``MIN_EXCHANGES``-th call and every
        ``CHECK_EVERY``-th after it (reading the stats costs more than the exchange's own counting);
        True if it warned."""
        self._calls += 1
        due = self._calls - MIN_EXCHANGES
        if due < 0 or due % CHECK_EVERY or self._warned.is_set():
            return False
        return self.check(stats_of(), where)

    def check(self, stats: Dict[str, Any], where: str) -> bool:
        """Check the cumulative stats; True if this call warned."""
        if self._warned.is_set() or stats.get("tensors", 0) < MIN_EXCHANGES:
            return False
        beta = cost_model.link(bandwidth_bps=self.bandwidth_bps)[1]
        s = summary(stats, ())
        wire = s["bytes_saved"] / beta
        if s["codec_s"] <= wire:
            return False
        self._warned.set()
        log.warning("%s: encoding and decoding took %.3g s over %d exchanges, more than the %.3g s its %s saved "
                    "bytes take at %.3g Gbit/s: at this link speed compression slows the job down (set "
                    "link_gbps= or HVD_QSGD_BANDWIDTH_GBITS to your link; compression.summary() shows the "
                    "break-even link)", where, s["codec_s"], s["tensors"], wire, f"{s['bytes_saved']:,}",
                    beta * 8e-9)
        return True


class NeverCalledWatch:
    """Counts optimizer steps seen while a compressor has compressed nothing; warns once."""

    def __init__(self):
        self.steps = 0
        self.patience = NEVER_CALLED_STEPS  # steps without a call before the warning
        self._warned = threading.Event()

    def expect_calls_every(self, steps: int) -> None:
        """The compressor is called once every ``steps`` optimizer steps (PQASGD's period): wait for
        ``steps - 1 + NEVER_CALLED_STEPS`` steps without a call before warning."""
        self.patience = max(self.patience, int(steps) - 1 + NEVER_CALLED_STEPS)

    def step(self, calls: int, where: str, compressed: Optional[int] = None) -> bool:
        """One optimizer step; ``calls``: tensors the compressor has been handed so far; ``compressed``:
        how many of them it compressed (None: not known). True if it warned: never called, or handed
        only tensors it sends uncompressed (each below ``min_numel``, or not floating point)."""
        if calls and compressed != 0 or self._warned.is_set():
            return False
        self.steps += 1
        if self.steps < self.patience:
            return False
        if calls:
            self._warned.set()
            log.warning("%s was handed %d tensors in %d optimizer steps and compressed none of them: each had fewer "
                        "elements than min_numel, or was not a floating-point tensor, and went uncompressed "
                        "(stats['raw_tensors']). Pass a smaller min_numel= to compress small tensors", where, calls,
                        self.steps)
            return True
        return self._warn(where, f"has not been called in {self.steps} optimizer steps")

    def at_exit(self, calls: int, where: str) -> bool:
        """The process ends (in a Horovod job): warn if the compressor was never called at all."""
        if calls or self._warned.is_set():
            return False
        return self._warn(where, "was created in this Horovod job but never called")

    def _warn(self, where: str, what: str) -> bool:
        self._warned.set()
        log.warning("%s %s: it compresses nothing. Pass it as "
                    "compression= to hvd.DistributedOptimizer (PyTorch) or to Horovod's TensorFlow tape or "
                    "optimizer; Horovod's Keras DistributedOptimizer never calls it for a Keras 3 optimizer "
                    "(docs/compressor.md#tensorflow)", where, what)
        return True


_used = 0
_used_lock = threading.Lock()


def note_used(world_size: Any) -> bool:
    """A compressor's framework adapter is made (the front ``QSGD`` makes it at its first use), in a
    job of ``world_size()`` ranks (Horovod's ``size``; not initialised: one); True where that makes
    ``MANY_COMPRESSORS`` in this process of a multi-rank job, and it warned: a compressor made anew
    for each step or call (``hvd.allreduce(x, compression=hvd_qsgd.QSGD(4))`` in a loop) names every
    collective anew, as its creation index is in every name, and Horovod negotiates each again and
    evicts its cached ones (measured 1.6x slower a step, docs/compressor.md, "How payloads find each
    other")."""
    global _used
    with _used_lock:
        _used += 1
        count = _used
    if count != MANY_COMPRESSORS:
        return False
    try:
        if world_size() <= 1:
            return False
    except ValueError:   # (Horovod not initialised)
        return False
    log.warning("hvd_qsgd: %d compressors have been used in this process: a compressor made anew for each step or "
                "call names every collective anew (its creation index is in every name), which Horovod negotiates "
                "again and again, evicting its cache (measured 1.6x slower a step). Make each compressor once "
                "and keep it (docs/compressor.md, \"How payloads find each other\")", count)
    return True
