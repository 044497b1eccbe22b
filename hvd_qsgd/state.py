"""The per-compressor state both framework adapters keep, without any framework: how exchanges are
named (``ExchangeNames``) and the error-feedback residuals (``ResidualStore``).

Exchange names. Every collective a compressor starts carries a name every rank derives alike
(``<prefix> = hvd_qsgd<sep><k>``, k the compressor's creation index; sep "." in PyTorch, "_" in
TensorFlow, whose op names take no dots):

* a known parameter's gradient travels as ``<prefix>.p.<name>`` and its payload seed counts the
  exchanges of that name so far (``occurrence``), so ranks may hand gradients over in any order;
* a tensor that Horovod's call names (``hvd.allreduce(t, name=...)``; ``name[i]`` in a group)
  travels as ``<prefix>.c.<name>``: threads sharing a compressor may call in an order that differs
  between ranks. Its payload seed and messages use its number (below), which adds no state per name
  (a name may be new at every step);
* any other tensor is numbered in the order it reaches the compressor: the seq-th is labelled
  ``<prefix>.s<seq>`` (its payload seed, its messages) and travels as ``<prefix>.n<slot>``, where
  slot is the lowest number no unfinished numbered exchange holds. A slot is free again once
  decompress has waited for the exchange's collectives (after a failed control check it stays
  taken: they may never complete), so a step's numbered exchanges reuse the same few names step
  after step, as Horovod's response cache expects (a new name each step would evict its entries).
* with no name, a tensor's residual is keyed by its position within a step: the tensors compressed
  between two moments with no exchange pending (a static order of gradients is presumed).

The control vector proves that every rank gave the same tensor the same name before anyone waits
on it (``hvd_qsgd.protocol``).

Unnamed calls: ``hvd_qsgd.unnamed_calls`` (``ExchangeNames.take_call_slot``).

Residuals. ``ResidualStore`` keeps, per key, the residual e of worker error feedback, the learning
rate it was made at, and the server residual of scatter_allgather's reducing rank; the rules it
applies are ``hvd_qsgd.error_feedback``'s. The values are whatever the adapter stores (torch
tensors, NumPy arrays, ``tf.Variable``s); the adapter supplies conversions for checkpoints.

Holders. State kept by key (residuals, DQSGD's schedules) belongs to one tensor source per key: a
PyTorch parameter (keyed by its name) or a TensorFlow variable (keyed by its place in a traced
function). ``StateHolders`` remembers which, so that a second, live source under the same key (two
models of the same names handed one compressor, which Horovod's stateless compressors allow) is an
error instead of two sources' states mixed.
"""
import functools
import logging
import threading
import weakref
from typing import Any, Callable, Dict, Hashable, NamedTuple, Optional, Set

from hvd_qsgd import error_feedback, protocol
from hvd_qsgd.unnamed_calls import UnnamedCalls, warn_left

log = logging.getLogger("hvd_qsgd")


class Route(NamedTuple):
    """Where one exchange goes (``ExchangeNames.route``)."""

    exchange: str          # the collectives' name
    seed_name: str         # the name its payload seed and messages use
    occurrence: int        # earlier exchanges of seed_name (the payload seed's counter)
    key: int               # the control vector's exchange key
    residual_key: Hashable  # parameter name, the name Horovod's call gives it, or position within the step
    param: Optional[str]   # parameter name, or None
    slot: Optional[int]    # numbered slot taken, or None


KEPT_SEEDS = 4096   # parameters' base seeds kept at most (then the store starts again)


@functools.lru_cache(maxsize=65536)
def _named_route(prefix: str, sep: str, name: str, kind: str = "p") -> tuple:
    """The exchange name and control key (odd) of a parameter's gradient (``kind`` "p") or of a
    tensor that a Horovod call names (``name=``; "c": keyed apart, by "call:" + the name); made once:
    one is needed per exchange."""
    hashed = name if kind == "p" else "call:" + name
    return f"{prefix}{sep}{kind}{sep}{name}", 2 * protocol.small_hash(hashed, protocol.TAG_RANGE ** 2 // 2) + 1


@functools.lru_cache(maxsize=65536)
def named_where(param: str) -> str:
    """How messages name the exchange of parameter ``param`` (made once a name)."""
    return f"hvd_qsgd: tensor {param!r}"


class ExchangeNames:
    """The naming state of one compressor (see the module docstring). Thread-safe."""

    def __init__(self, creation_index: int, sep: str = "."):
        self.sep = sep
        self.prefix = f"hvd_qsgd{sep}{creation_index}"
        self._lock = threading.Lock()
        self.seq = 0              # numbered exchanges started (TensorFlow: every exchange)
        self.slots: Set[int] = set()       # numbered slots held by unfinished exchanges
        self.occurrences: Dict[str, int] = {}  # exchanges started per parameter name
        self.in_flight: Set[str] = set()   # exchange names of parameters and named calls with one pending
        self.pending = 0          # exchanges between compress and decompress
        self.position = 0         # position within the current step
        self._seeds: Dict[tuple, int] = {}   # the parameters' base payload seeds (``payload_seed``)
        self.calls = UnnamedCalls()   # the slots of each thread's last unnamed call (``take_call_slot``)

    def name(self, label: str) -> str:
        return f"{self.prefix}{self.sep}{label}"

    def next_seq(self) -> int:
        with self._lock:
            seq, self.seq = self.seq, self.seq + 1
            return seq

    def take_slot(self) -> int:
        """The lowest slot no unfinished numbered exchange holds, now held."""
        with self._lock:
            return self._take_slot()

    def _take_slot(self):
        slot = 0
        while slot in self.slots:
            slot += 1
        self.slots.add(slot)
        return slot

    def take_call_slot(self, frame: Any) -> int:
        """``take_slot`` for an exchange of the unnamed call of Horovod's running in ``frame`` (None:
        not Horovod's), after letting go of the slots an earlier call on this thread left (logged:
        ``hvd_qsgd.unnamed_calls``)."""
        if frame is None:
            return self.take_slot()
        left = self.calls.begin(frame)
        if left:
            warn_left(len(left), f"compressor {self.prefix}", "their names are free again")
        with self._lock:
            self.slots.difference_update(left)
            slot = self._take_slot()
        self.calls.hold(frame, slot)
        return slot

    def release_slot(self, slot: Optional[int]) -> None:
        """Free a slot once every rank has waited for its exchange's collectives."""
        if slot is not None:
            with self._lock:
                self.slots.discard(slot)
            self.calls.end(slot)

    def route(self, param: Optional[str], call_name: Optional[str] = None) -> Route:
        """The route of the next exchange of a tensor (``param``: its parameter's name, or None;
        ``call_name``: the name an unnamed Horovod call gives it, which routes it and keys its
        residual). A name whose exchange is still in flight (given twice at once) is numbered."""
        with self._lock:
            if self.pending == 0:
                self.position = 0
            position = self.position
            self.position += 1
            self.pending += 1
            if param is not None:
                exchange, key = _named_route(self.prefix, self.sep, param)
                if exchange not in self.in_flight:
                    self.in_flight.add(exchange)
                    occurrence = self.occurrences.get(param, 0)
                    self.occurrences[param] = occurrence + 1
                    return Route(exchange, exchange, occurrence, key, param, param, None)
            seq, self.seq = self.seq, self.seq + 1
            if call_name is not None:
                exchange, key = _named_route(self.prefix, self.sep, call_name, "c")
                if exchange not in self.in_flight:
                    self.in_flight.add(exchange)
                    return Route(exchange, self.name(f"s{seq}"), 0, key, call_name, None, None)
            slot = self._take_slot()
            return Route(self.name(f"n{slot}"), self.name(f"s{seq}"), 0, numbered_key(slot),
                         position if call_name is None else call_name, None, slot)

    def payload_seed(self, seed: int, set_rank: int, route: Route) -> int:
        """``protocol.payload_seed`` of the exchange on ``route``. A parameter's exchanges keep their
        name step after step, so its base seed is kept (a numbered exchange's name is new each time)."""
        if route.param is None:
            return protocol.payload_seed(seed, set_rank, route.seed_name, route.occurrence)
        key = (seed, set_rank, route.seed_name)
        base = self._seeds.get(key)
        if base is None:
            if len(self._seeds) >= KEPT_SEEDS:
                self._seeds.clear()
            base = self._seeds[key] = protocol.exchange_seed(*key)
        return protocol.step_seed(base, route.occurrence)

    def finish(self, route: Route) -> None:
        """The exchange left compress-to-decompress (its collectives may still be pending)."""
        with self._lock:
            self.pending = max(0, self.pending - 1)
            if route.slot is None:   # (a parameter's, or a call's by its name)
                self.in_flight.discard(route.exchange)

    def reset(self) -> None:
        """Forget every exchange in progress (the counters stay: see ``counters``)."""
        with self._lock:
            self.pending = 0
            self.position = 0
            self.in_flight = set()
            self.slots = set()
        self.calls.clear()

    def counters(self) -> Dict[str, Any]:
        """What names and seeds the next exchanges: numbered exchanges so far, exchanges per name."""
        with self._lock:
            return {"seq": self.seq, "occurrences": dict(self.occurrences)}

    def load_counters(self, counters: Dict[str, Any]) -> None:
        seq = int(counters["seq"])
        occurrences = {str(k): int(v) for k, v in counters["occurrences"].items()}
        with self._lock:
            self.seq, self.occurrences = seq, occurrences


def checkpoint_origin(hvd: Any) -> Dict[str, Optional[int]]:
    """The rank and job size a checkpoint is made on (``state_dict``'s ``rank`` and ``size``; None
    before Horovod is initialised)."""
    try:
        return {"rank": int(hvd.rank()), "size": int(hvd.size())}
    except ValueError:
        return {"rank": None, "size": None}


def residuals_belong_here(state: Dict[str, Any], hvd: Any, who: str) -> bool:
    """Whether a checkpoint's error-feedback residuals (worker and server) are this rank's own.

    A residual is the part of one rank's own gradients that quantization has not yet delivered,
    owed to the average over the ranks of its job: it is that rank's and that job's. Another rank's
    (rank 0's checkpoint loaded on every rank, as Horovod's examples resume) would pay rank 0's debt
    on every rank, and one of a job of another size would pay it at another share; this rank's start
    from zero then, the state of a new job (as after an elastic reset), and it says so. Everything
    else in the checkpoint (counters, statistics, schedules) is the same on every rank and loads. A
    checkpoint that names no rank (earlier releases) loads them."""
    saved, here = (state.get("rank"), state.get("size")), tuple(checkpoint_origin(hvd).values())
    if saved[0] is None or here[0] is None or saved == here:
        return True
    if not any(map(state.get, RESIDUAL_FIELDS)):   # (none to drop, no error feedback: not a word)
        return False
    log.warning("%s: the checkpoint was made on rank %s of %s, this is rank %s of %s: its error-feedback "
                "residuals are that rank's (the part of its own gradients not yet delivered), so this rank's start "
                "from zero; to resume each rank's, save and load a checkpoint per rank (e.g. "
                "f'compressor-{hvd.rank()}.pt')", who, saved[0], saved[1], here[0], here[1])
    return False


RESIDUAL_FIELDS = ("residuals", "residual_lr", "server_residuals")


def loadable(state: Dict[str, Any], settings: Any, hvd: Any, who: str) -> Dict[str, Any]:
    """A checkpoint ``state`` as it is to be loaded here: refused where made with other codec settings
    (``Settings.check_checkpoint``); without the residuals that are not to be loaded, saying which:
    another rank's or job's (``residuals_belong_here``), and residuals of a kind this compressor does
    not keep (error_feedback or server_error_feedback off: never used, they would only be carried
    into every later checkpoint)."""
    settings.check_checkpoint(state, who)
    if not residuals_belong_here(state, hvd, who):
        return {k: v for k, v in state.items() if k not in RESIDUAL_FIELDS}
    kinds = {"residuals": ("error-feedback residuals", "error_feedback", ("residuals", "residual_lr")),
             "server_residuals": ("server error-feedback residuals", "server_error_feedback", ("server_residuals",))}
    unkept = [kinds[f] for f in kinds if state.get(f) and not getattr(settings, kinds[f][1])]
    for what, setting, _ in unkept:
        log.warning("%s: the checkpoint holds %s, and this compressor keeps none (%s=False): not loaded",
                    who, what, setting)
    dropped = {field for _, _, fields in unkept for field in fields}
    return {k: v for k, v in state.items() if k not in dropped} if dropped else state


def state_by_key(settings: Any, observes: bool) -> Optional[str]:
    """What a compressor of ``settings`` keeps by key, in words, or None; ``observes``: its bits
    policy keeps a schedule per key (DQSGD)."""
    kept = ((["error-feedback residuals"] if settings.error_feedback else [])
            + (["server error-feedback residuals"] if settings.server_error_feedback else [])
            + (["bit-width schedules"] if observes else []))
    return " and ".join(kept) or None


class StateHolders:
    """The source (a parameter, a variable) that holds each key of a compressor's state (see the
    module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._held: Dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def other(self, key: Hashable, source: Any) -> Any:
        """The live source other than ``source`` that holds ``key``, or None: then ``source`` holds
        it (a source no longer alive, a model replaced, leaves its keys)."""
        with self._lock:
            ref = self._held.get(key)
            held = None if ref is None else ref()
            if held is None:
                self._held[key] = weakref.ref(source)
                return None
        return None if held is source else held

    def clear(self) -> None:
        with self._lock:
            self._held = {}


def element_count(array: Any) -> int:
    """The elements of a NumPy array, a tensor or a variable."""
    numel = getattr(array, "numel", None)
    return int(numel()) if callable(numel) else int(array.size)


def called_where(route: Route, call_name: Optional[str], shape) -> str:
    """How messages name a tensor of no parameter: by its label (``s<seq>``) and the name its call
    gives it, if any."""
    named = f" named {call_name!r}" if call_name is not None else ""
    return f"hvd_qsgd: compressed tensor {route.seed_name.rsplit('.', 1)[1]}{named} (shape {tuple(shape)})"


def numbered_key(n: int) -> int:
    """The control vector's exchange key of numbered exchange n (even; parameter keys are odd)."""
    return (2 * n) % protocol.TAG_RANGE ** 2


def traced_label(state_key: str) -> str:
    """The name label of a traced exchange (TensorFlow), from its state key ``<function>:<position>``:
    ``f<function>.<position>``, the same in every trace of the function, so that a rank that traces
    it again (a batch of another shape on that rank alone) still meets the others' collectives.
    Characters a TensorFlow op name cannot hold become "_"."""
    return "f" + "".join(c if c.isascii() and (c.isalnum() or c in "_.") else "_" for c in state_key.replace(":", "."))


def traced_key(state_key: str) -> int:
    """The control vector's exchange key of a traced exchange (even, as numbered ones are)."""
    return 2 * protocol.small_hash(f"traced|{state_key}", protocol.TAG_RANGE ** 2 // 2)


class ResidualStore:
    """Error-feedback state of one compressor, by key (see the module docstring)."""

    def __init__(self) -> None:
        self.residuals: Dict[Hashable, Any] = {}
        self.rates: Dict[Hashable, Any] = {}     # the learning rate each residual was made at
        self.server: Dict[Hashable, Any] = {}    # the reducing rank's residual of its chunk

    def __len__(self) -> int:
        return len(self.residuals)

    def get(self, key: Hashable) -> Any:
        return self.residuals.get(key)

    def factor(self, key: Hashable, lr_now: Any) -> float:
        """lr_made / lr_now for the residual of ``key`` (``error_feedback.rescale_factor``)."""
        return error_feedback.rescale_factor(self.rates.get(key), lr_now)

    def keep(self, key: Hashable, residual: Any, lr_made: Any = None) -> None:
        """Store the new residual, and the rate it was made at where that rate is usable."""
        self.residuals[key] = residual
        if error_feedback.usable_rate(lr_made):
            self.rates[key] = float(lr_made)

    def server_residual(self, key: Hashable, size: int, make: Callable[[int], Any], where: str,
                        place: Optional[Callable[[Any], Any]] = None) -> Any:
        """The reducing rank's residual of ``key``: ``make(size)`` on first use, else the one kept,
        moved by ``place`` to where the reduce step reads it (and kept there: a residual loaded from
        a checkpoint moves once); checked for size before it is kept."""
        residual = self.server.get(key)
        residual = make(size) if residual is None else place(residual) if place is not None else residual
        count = element_count(residual)
        if count != size:
            raise protocol.MismatchError(
                f"{where}: its server error-feedback residual has {count} elements, this "
                f"rank's chunk {size}: the tensor or the number of ranks changed")
        self.server[key] = residual
        return residual

    def rescale(self, factor: float, multiply: Callable[[Any, float], Any]) -> None:
        """Every worker residual times ``factor``."""
        self.residuals = {k: multiply(v, factor) for k, v in self.residuals.items()}

    def clear(self) -> None:
        self.residuals, self.rates, self.server = {}, {}, {}

    def state_dict(self, residual: Callable[[Any], Any], rate: Callable[[Any], float] = float,
                   server: Optional[Callable[[Any], Any]] = None) -> Dict[str, Dict]:
        """``residuals``, ``residual_lr`` (and ``server_residuals``), each value converted."""
        state = {"residuals": {k: residual(v) for k, v in self.residuals.items()},
                 "residual_lr": {k: rate(v) for k, v in self.rates.items()}}
        if server is not None:
            state["server_residuals"] = {k: server(v) for k, v in self.server.items()}
        return state
