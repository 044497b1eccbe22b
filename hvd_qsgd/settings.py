"""What every adapter shares that is no framework's API: the compressor ``Settings`` (the one place
the settings parameters are spelled out, with their defaults and checks), the per-rank ``Stats``
counters, the creation index that names a compressor's exchanges, and a process set's ranks.

Defaults follow the QSGD paper's experiments (section 5): max-norm scaling, bucket size 512 for
4 and 8 bits and 128 for 2 bits or fewer, and tensors of fewer than 10,000 elements left
unquantized (they go through Horovod's own allreduce, with the same Sum/Average semantics).
The reduction defaults to "auto": per tensor, the faster of allgather and scatter_allgather by
``hvd_qsgd.cost_model`` (allgather on 2 ranks and for small tensors, scatter_allgather for large
tensors from 3 ranks on, whose bytes per rank stay flat as ranks are added).
"""
import collections
import functools
import inspect
import itertools
import math
import threading
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from hvd_qsgd import codec, cost_model, protocol

REDUCTIONS = ("allgather", "scatter_allgather", "hierarchical", "auto")
_creation_counter = itertools.count()
_creation_lock = threading.Lock()


def next_creation_index() -> int:
    """Compressors are numbered in creation order; the number is part of their exchange names, so
    every rank must create its compressors in the same order (a mismatch is detected, not hung on)."""
    with _creation_lock:
        return next(_creation_counter)


def set_ranks(process_set: Any, world_size: int) -> List[int]:
    """The global ranks of a Horovod process set, ascending (the global set: all ``world_size``)."""
    if process_set.process_set_id == 0:
        return list(range(world_size))
    if process_set.ranks is None:
        raise ValueError("hvd_qsgd: the compressor's process set was not registered with Horovod "
                         "(hvd.init(process_sets=...) or hvd.add_process_set)")
    return sorted(process_set.ranks)


def process_set_key(process_set: Any) -> Any:
    """A process set as a hashable value (None for none given)."""
    if process_set is None:
        return None
    return (process_set.process_set_id, tuple(process_set.ranks or ()))


def default_bucket_size(bits: int) -> int:
    """The QSGD paper's bucket size for ``bits``: 128 for 2 bits or fewer, 512 above."""
    return 128 if bits <= 2 else 512


@dataclass(frozen=True)
class Settings:
    """Compressor settings. Those in ``tag()`` must agree on every rank; ``seed``, ``checksum``,
    ``error_feedback`` and ``server_error_feedback`` are each rank's own choice in PyTorch (in
    TensorFlow error feedback changes the traced graph, whose uncompressed allreduces Horovod names
    by their nodes' places in it: ranks that differ wait on different names). ``link_gbps`` only
    enters through the reduction "auto" resolves to, which is in the tag: ranks whose links make them
    resolve a tensor differently are told apart, never left to wait on different collectives."""

    bits: int = 4
    bucket_size: int = 512
    norm: str = "max"
    coding: str = "fixed"
    min_numel: int = 10000
    seed: int = 0
    error_feedback: bool = False
    checksum: bool = True
    reduction: str = "auto"
    server_error_feedback: bool = False
    link_gbps: Optional[float] = None
    fusion: bool = False
    overlap: bool = False
    encoder: int = codec.DEFAULT_ENCODER
    fusion_mb: float = 0.0
    join: bool = True

    def __hash__(self) -> int:
        """The fields' hash, worked out once (settings key the exchanges' caches at every compress)."""
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> Dict[str, Any]:
        """The fields, without the hash (another process hashes strings with another seed)."""
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @classmethod
    def make(cls, bits: int = 4, bucket_size: Optional[int] = None, norm: str = "max", coding: str = "fixed",
             min_numel: int = 10000, seed: int = 0, error_feedback: bool = False, checksum: bool = True,
             reduction: str = "auto", server_error_feedback: bool = False,
             link_gbps: Optional[float] = None, fusion: bool = False, overlap: bool = False,
             encoder: int = codec.DEFAULT_ENCODER, fusion_mb: float = 0.0, join: bool = True) -> "Settings":
        """Settings with every parameter checked (ValueError naming the parameter).

        This signature is the one place the settings parameters are written out: the compressors
        (``hvd_qsgd.QSGD``, the framework adapters) take them through ``from_arguments`` and show
        them through ``signature``."""
        if bucket_size is None:
            bucket_size = default_bucket_size(codec._check_bits(bits))
        codec.make_config(bits, bucket_size, norm, seed, coding)  # checks bits, bucket, norm, coding, seed
        encoder = codec.check_encoder(encoder)  # 1 or 2 (ValueError naming encoder)
        if not codec.is_integer(min_numel) or min_numel < 1:
            raise ValueError(f"min_numel must be a positive integer, got {min_numel!r}")
        if not isinstance(reduction, str) or reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        for name, flag in (("error_feedback", error_feedback), ("checksum", checksum),
                           ("server_error_feedback", server_error_feedback), ("fusion", fusion),
                           ("overlap", overlap), ("join", join)):
            if not codec.is_bool(flag):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        if link_gbps is not None:
            if codec.is_bool(link_gbps) or not isinstance(link_gbps, (int, float)) or not (
                    math.isfinite(link_gbps) and link_gbps > 0):
                raise ValueError(f"link_gbps must be a positive number of Gbit/s (or None: "
                                 f"HVD_QSGD_BANDWIDTH_GBITS, else {cost_model.BANDWIDTH_BPS * 8e-9:g}), "
                                 f"got {link_gbps!r}")
            link_gbps = float(link_gbps)
        if server_error_feedback and reduction in ("allgather", "hierarchical"):
            raise ValueError(f"server_error_feedback=True needs reduction=\"scatter_allgather\" (or \"auto\", where it "
                             f"chooses scatter_allgather): with reduction={reduction!r} no rank re-quantizes a sum, "
                             "so there is no server residual to keep")
        fusion_mb = _check_fusion_mb(fusion_mb, min_numel, fusion, server_error_feedback)
        cost_model.check_environment()   # (the link variables, read later by "auto" and the reports)
        return cls(int(bits), int(bucket_size), norm, coding, int(min_numel), int(seed),
                   bool(error_feedback), bool(checksum), reduction, bool(server_error_feedback), link_gbps,
                   bool(fusion), bool(overlap), encoder, fusion_mb, bool(join))

    @classmethod
    def from_arguments(cls, owner: str, args: Sequence[Any], kwargs: Dict[str, Any]) -> "Settings":
        """The settings of a compressor constructed as ``owner(*args, **kwargs)``, where ``args`` and
        ``kwargs`` are the parameters of ``make`` (positionally in its order, or by name): a
        TypeError naming ``owner`` for an unknown or repeated parameter, as Python gives for a
        written-out signature."""
        try:
            bound = inspect.signature(cls.make).bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{owner}: {e}") from None
        return cls.make(*bound.args, **bound.kwargs)

    @classmethod
    def given(cls, owner: str, settings: Optional["Settings"], args: Sequence[Any],
              kwargs: Dict[str, Any]) -> "Settings":
        """``settings`` when a compressor was handed one, else ``from_arguments``; a TypeError when it
        was handed both."""
        if settings is None:
            return cls.from_arguments(owner, args, kwargs)
        if args or kwargs:
            raise TypeError(f"{owner}: pass either settings= or the settings' parameters, not both")
        return settings

    @classmethod
    def signature(cls, **extra: Any) -> inspect.Signature:
        """``make``'s parameters, then ``extra`` (name -> default) as keyword-only parameters: the
        signature ``help()`` and ``inspect`` show for a compressor that takes the settings."""
        params = list(inspect.signature(cls.make).parameters.values())
        params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
                   for name, default in extra.items()]
        return inspect.Signature(params)

    def described(self, always: Tuple[str, ...], hidden: Tuple[str, ...] = ()) -> str:
        """``name=value, ...`` of the settings named in ``always``, then of every other one that is not
        ``make``'s default (but those ``hidden``: fixed by the compressor class): a compressor's repr."""
        mine = asdict(self)
        defaults = {n: p.default for n, p in inspect.signature(Settings.make).parameters.items()}
        shown = list(always) + [k for k, v in mine.items() if k in defaults and k not in always and k not in hidden
                                and k != "bucket_size" and v != defaults[k]]
        return ", ".join(f"{k}={mine[k]:g}" if isinstance(mine[k], float) else f"{k}={mine[k]!r}" for k in shown)

    def replace(self, **changes: Any) -> "Settings":
        """These settings with some fields changed (checked as ``make`` checks them)."""
        return Settings.make(**{**asdict(self), **changes})

    def tag(self, reduction: Optional[str] = None) -> int:
        """The settings every rank must share, hashed into a control-vector tag; ``reduction`` is the
        reduction an exchange resolved to (``exchange_reduction``), so ranks that resolve "auto"
        differently are told apart too."""
        return _tag(self, reduction)

    def _tag_text(self, reduction: Optional[str]) -> int:
        # (fusion, overlap, encoder version 2, fusion buffers and join=False appear only when on: without
        # them the tags stay those of earlier releases, whose payloads encoder=1 reproduces; ranks on
        # different encoders differ)
        extra = (("|fused" if self.fusion else "") + ("|overlap" if self.overlap else "")
                 + ("|encoder2" if self.encoder == 2 else "") + (f"|buffers{self.fusion_mb!r}" if self.fusion_mb else "")
                 + ("" if self.join else "|nojoin"))
        return protocol.small_hash(f"{self.bits}|{self.bucket_size}|{self.norm}|{self.coding}|"
                                   f"{self.min_numel}|{self.reduction}|{reduction or self.reduction}{extra}")

    def exchange_reduction(self, n: int, numel: int, per_node: Optional[int] = None, device: str = "cpu") -> str:
        """The reduction of one exchange of a numel-element tensor among n ranks: the setting, or for
        "auto" the faster by the cost model (the same on every rank: it depends on n, numel, the
        settings and the layout only). ``per_node``: the ranks of each node, where the n ranks are the
        whole job on nodes of that many consecutive ranks; with more than one node of more than one
        rank, "auto" weighs the hierarchical reduction too (``cost_model.choose_in_nodes``; not with
        server error feedback, which it cannot run), with the link inside a node of the tensors'
        ``device`` ("cuda" or "cpu": ``cost_model.intra_link``)."""
        if self.reduction != "auto":
            return self.reduction
        if per_node and per_node > 1 and n % per_node == 0 and n > per_node:
            return cost_model.choose_in_nodes(per_node, n // per_node, numel, self.bits, self.bucket_size,
                                              hierarchical=not self.server_error_feedback,
                                              bandwidth_bps=self.link_bps(),
                                              intra_bps=cost_model.intra_link(device=device))
        return cost_model.choose(n, numel, self.bits, self.bucket_size, bandwidth_bps=self.link_bps())

    def fusion_elements(self) -> int:
        """The elements a fusion buffer holds (``fusion_mb`` MiB of float32), 0 when off."""
        return int(self.fusion_mb * 2 ** 20) // 4

    def link_bps(self) -> Optional[float]:
        """The link bandwidth in bytes/s that ``link_gbps`` sets, or None (the cost model's default:
        ``HVD_QSGD_BANDWIDTH_GBITS``, else 10 Gbit/s)."""
        return None if self.link_gbps is None else self.link_gbps * 1e9 / 8

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def check_checkpoint(self, state: Dict[str, Any], who: str) -> None:
        """Refuse a compressor's checkpoint (``state``) made with other codec settings: its residuals
        hold what another quantizer dropped. A checkpoint that names no settings is taken."""
        mine = self.as_dict()
        theirs = state.get("settings", mine)
        changed = [k for k in ("bits", "bucket_size", "norm", "coding") if theirs.get(k) != mine[k]]
        if changed:
            raise ValueError(f"{who}: the checkpoint was made with different settings "
                             f"({', '.join(f'{k}={theirs.get(k)!r}' for k in changed)}; this compressor's: "
                             f"{', '.join(f'{k}={mine[k]!r}' for k in changed)}): its residuals hold what "
                             "another quantizer dropped")


@functools.lru_cache(maxsize=1024)
def _tag(settings: Settings, reduction: Optional[str]) -> int:
    """``Settings.tag``, hashed once per settings and reduction (it is asked for at every exchange)."""
    return settings._tag_text(reduction)


def _check_fusion_mb(fusion_mb: Any, min_numel: int, fusion: bool, server_error_feedback: bool) -> float:
    """``fusion_mb`` as a float, checked, and against the settings it cannot go with."""
    if codec.is_bool(fusion_mb) or not isinstance(fusion_mb, (int, float)) or not (
            math.isfinite(fusion_mb) and fusion_mb >= 0):
        raise ValueError(f"fusion_mb must be a non-negative number of MiB (0: no fusion buffers), got {fusion_mb!r}")
    fusion_mb = float(fusion_mb)
    if not fusion_mb:
        return fusion_mb
    if int(fusion_mb * 2 ** 20) // 4 < min_numel:
        raise ValueError(f"fusion_mb={fusion_mb:g} holds {int(fusion_mb * 2 ** 20) // 4} float32 elements, fewer than "
                         f"min_numel={min_numel}: no compressed tensor would fit in a fusion buffer")
    for name, on in (("fusion", fusion), ("server_error_feedback", server_error_feedback)):
        if on:
            raise ValueError(f"fusion_mb and {name}=True cannot be combined: " + {
                "fusion": "both fuse a step's tensors (fusion=True keeps each tensor's own payload); pass one",
                "server_error_feedback": "the reducing rank's residual belongs to a chunk of one tensor, and a "
                                         "buffer's chunks change with its members"}[name])
    return fusion_mb


class Stats:
    """Cumulative counters of one rank, safe to update from several threads.

    elements:       elements of the tensors this rank compressed
    bytes_sent:     payload bytes this rank put on the wire (its own payloads)
    bytes_received: payload bytes this rank took off the wire (the other ranks' payloads)
    ratio:          4 * elements / bytes_sent, the size of fp32 over what was sent
    tensors:        compressed exchanges; raw_elements / raw_tensors: those sent uncompressed
    host_fallbacks: steps that took a device tensor through the host because no device kernel does
                    them (``hvd_qsgd.backends``; each reason is also logged once)
    joined_exchanges: exchanges made while ranks of the set had joined (``hvd.join``): reduced by
                    Horovod's allreduce of the dequantized payloads, uncompressed on the wire (also
                    counted in raw_elements / raw_tensors; logged once)
    allreduce_bytes: bytes a ring allreduce of the compressed tensors in fp32 would have made this
                    rank receive, 2 (n-1)/n * 4 d per exchange (what ``hvd_qsgd.report`` compares with)
    cross_bytes_sent / cross_bytes_received: the bytes addressed to (or from) ranks on other nodes
                    (the node layout: HVD_QSGD_RANKS_PER_NODE, else the framework's local size; 0
                    where it is not known), counted per destination as a direct send: what the node's
                    link must carry (PyTorch and hvd_qsgd.mpi). So under allgather a payload counts
                    once per rank on another node, and cross_bytes_sent can exceed bytes_sent, which
                    counts it once
    encode_s:       seconds this rank spent encoding (compress: quantize, pack, error feedback)
    decode_s:       seconds spent decoding (decode-sum; scatter_allgather's reduce step, which decodes
                    and re-quantizes a chunk, counts here)
    wait_s:         seconds decompress spent blocked on the exchange's collectives
    """

    FIELDS = ("elements", "bytes_sent", "bytes_received", "tensors", "raw_elements", "raw_tensors",
              "host_fallbacks", "joined_exchanges", "allreduce_bytes", "cross_bytes_sent", "cross_bytes_received")
    TIME_FIELDS = ("encode_s", "decode_s", "wait_s")
    # what the TensorFlow adapter counts in graph variables (its ops run on the host: no fallback)
    GRAPH_FIELDS = FIELDS[:6]

    def __init__(self):
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.FIELDS, 0)
        self._values.update(dict.fromkeys(self.TIME_FIELDS, 0.0))
        # the counts added since the last read, one record a call, folded into _values when read (or
        # when FOLD_AT have gathered): appending costs a call a few instructions, and is atomic
        self._added = collections.deque()

    FOLD_AT = 4096

    def add(self, **counts: float) -> None:
        self._added.append(counts)
        if len(self._added) > self.FOLD_AT:
            self._fold()

    def exchanged(self, elements: int, sent: int, received: int, cross_sent: int = 0, cross_received: int = 0) -> None:
        """One compressed exchange's counts (``add`` of each, in one call: one is made per tensor)."""
        self._added.append((elements, sent, received, cross_sent, cross_received))
        if len(self._added) > self.FOLD_AT:
            self._fold()

    def _fold(self) -> None:
        """Add the records gathered into the counters (a record added meanwhile waits for the next)."""
        values, added = self._values, self._added
        with self._lock:
            while added:
                record = added.popleft()
                if type(record) is tuple:
                    for k, v in zip(_EXCHANGED, record):
                        values[k] += v
                    values["tensors"] += 1
                else:
                    for k, v in record.items():
                        values[k] += v

    def as_dict(self) -> Dict[str, float]:
        """The counters (counts as int, times as float), and ``ratio``."""
        self._fold()
        with self._lock:
            d = {k: _STAT_KINDS[k](v) for k, v in self._values.items()}
        d["ratio"] = protocol.ratio(d["elements"], d["bytes_sent"])
        return d

    def load(self, values: Dict[str, Any]) -> None:
        self._fold()
        with self._lock:
            for k in self.FIELDS:
                self._values[k] = int(values.get(k, 0))
            for k in self.TIME_FIELDS:
                self._values[k] = float(values.get(k, 0.0))

    @staticmethod
    def merge(dicts: Iterable[Dict[str, Any]]) -> Dict[str, float]:
        total: Dict[str, float] = dict.fromkeys(Stats.FIELDS, 0)
        total.update(dict.fromkeys(Stats.TIME_FIELDS, 0.0))
        for d in dicts:
            for k in total:
                total[k] += d.get(k, 0)
        total["ratio"] = protocol.ratio(total["elements"], total["bytes_sent"])
        return total


# each statistic as ``Stats.as_dict`` gives it: counts as int, times as float
_STAT_KINDS = {**dict.fromkeys(Stats.FIELDS, int), **dict.fromkeys(Stats.TIME_FIELDS, float)}
# the fields of a record of ``Stats.exchanged``, in order (and one more tensor)
_EXCHANGED = ("elements", "bytes_sent", "bytes_received", "cross_bytes_sent", "cross_bytes_received")
