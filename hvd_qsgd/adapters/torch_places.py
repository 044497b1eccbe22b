"""Where a PyTorch gradient's exchanges go, learned once per tensor and kept (``TensorPlaces``).

Every compress must know the exchange's process set, the parameter's name and Horovod's ranks per
node. They come from Horovod's call (``hvd_qsgd.horovod_caller``), the names the compressor was
given (``bind``) and the compressor's own ``process_set=``, and they are the same at every step for
the same tensor: a ``Place`` is worked out the first time and found again by what it was worked out
from (Horovod's name and process set for the gradient, the bound name, shape, dtype, device, world
size and rank). A place whose process set or names disagree, or whose node layout cannot be read, is
that exchange's fault (raised on every rank through the control vector) and is not kept, so each
exchange of that tensor works it out again and raises it.

A compressor that keeps state by parameter name (error-feedback residuals, DQSGD's schedules) can
serve one parameter of each name (``hvd_qsgd.state.StateHolders``): a second, live parameter of a
name it holds (a second model, or optimizer, of the same layer names handed the same compressor
object, which Horovod's stateless compressors allow) would mix the two parameters' states, so its
exchanges fail, on every rank.
"""
import logging
import threading
import weakref

import horovod.torch as hvd

from hvd_qsgd import protocol
from hvd_qsgd.exchange.buffer_plan import ParameterOrder
from hvd_qsgd.exchange.hierarchical import horovod_ranks_per_node
from hvd_qsgd.horovod_caller import exchange_process_set
from hvd_qsgd.settings import set_ranks as process_set_ranks
from hvd_qsgd.state import StateHolders

KEPT = 4096   # places kept at most (then the store starts again)
log = logging.getLogger("hvd_qsgd")


class Place:
    """Where a tensor's exchanges go: process set and its global ranks, parameter name, Horovod's
    ranks per node, or the fault that keeps it from being kept. Known by its identity (the runner's
    ``hvd_qsgd.exchange.openings`` finds the tensor's opening by it)."""

    __slots__ = ("ps", "set_ranks", "param", "per_node", "fault", "alone", "order")

    def __init__(self, ps, set_ranks, param, per_node, fault, alone=False, order=None):
        self.ps, self.set_ranks, self.param, self.per_node, self.fault = ps, set_ranks, param, per_node, fault
        self.alone, self.order = alone, order


class TensorPlaces:
    """The places of one compressor's tensors, and what they are learned from besides Horovod's call:
    the bound (name, parameter) pairs, the process set given, Horovod's ranks per node (read once,
    again after ``reset``). Thread-safe."""

    def __init__(self, given_process_set, state_by_name=None, planned_dtypes=None):
        self._given = given_process_set   # None: Horovod's call says
        self._planned_dtypes = planned_dtypes   # {torch dtype: its name} where fusion buffers are planned, or None
        self._orders = weakref.WeakKeyDictionary()   # Horovod's optimizer -> its ParameterOrder
        self._state_by_name = state_by_name   # what the compressor keeps by parameter name, or None
        self._holders = StateHolders()        # the parameter that holds each name
        self._lock = threading.Lock()
        self.params = None            # the bound (name, parameter) pairs, or None
        self._by_parameter = {}       # id(parameter) -> (name, parameter)
        self._by_grad = {}            # id(parameter.grad) -> (name, parameter), as last seen
        self._kept = {}
        self._per_node = None
        self._positional_residuals = False   # a checkpoint's residuals keyed by position (``positional``)

    def bind(self, params):
        """Match gradients to these (name, parameter) pairs."""
        with self._lock:
            self.params = params
            self._by_parameter = {id(p): (n, p) for n, p in params}
            self._by_grad, self._kept = {}, {}

    def positional(self, flag):
        """A checkpoint with residuals keyed by position was loaded (``flag``): the next exchange of a
        gradient Horovod names says that its residual starts from zero."""
        with self._lock:
            self._positional_residuals, self._kept = flag, {}

    def reset(self, holders=False):
        """Forget what was learned (an elastic reset: ranks and nodes may have changed), and with
        ``holders`` which parameter holds each name (the state kept by name was forgotten)."""
        with self._lock:
            self._by_grad, self._kept, self._per_node = {}, {}, None
            if holders:
                self._holders.clear()

    def of(self, tensor, shape, dtype, device, caller, world, rank):
        """The place of ``tensor``'s exchange (its shape, dtype and device as read), called by Horovod as
        ``caller`` says."""
        named = None
        if self.params is not None:
            with self._lock:
                named = self.bound_name(tensor, caller.parameter)
        key = (caller.name, id(caller.process_set), named, shape, dtype, device, world, rank, caller.late)
        place = self._kept.get(key)
        if place is None:
            place = self._work_out(caller, named, world)
            if place.fault is None:  # (kept with its process set, so that its id stays its own)
                with self._lock:
                    if len(self._kept) >= KEPT:
                        self._kept = {}
                    self._kept[key] = place
        if self._state_by_name is not None and caller.parameter is not None:
            fault = self._held_by_another(caller)
            if fault is not None:   # (this exchange's own place, not kept)
                return Place(place.ps, place.set_ranks, place.param, place.per_node, place.fault or fault, place.alone,
                             place.order)
        return place

    def _held_by_another(self, caller):
        """The fault of a gradient of a parameter named as another live parameter that this
        compressor keeps state for (see the module docstring), or None; the first holds the name."""
        name = caller.name
        if self._holders.other(name, caller.parameter) is None:
            return None
        return protocol.MismatchError(
            f"two parameters named {name!r} (of two models, or of two optimizers) hand their gradients to one "
            f"compressor, which keeps {self._state_by_name} by parameter name, and theirs would mix: give each "
            "DistributedOptimizer its own compressor (a hvd_qsgd.QSGD(...) each)")

    def bound_name(self, tensor, parameter=None):
        """The name ``bind`` gave the parameter whose .grad is ``tensor`` (``parameter``, where Horovod's
        call says which), or None. Call with the lock held."""
        if self.params is None:
            return None
        if parameter is not None:
            hit = self._by_parameter.get(id(parameter))
            return hit[0] if hit is not None and hit[1] is parameter else None
        hit = self._by_grad.get(id(tensor))
        if hit is not None and hit[1].grad is tensor:
            return hit[0]
        self._by_grad = {id(p.grad): (n, p) for n, p in self.params if p.grad is not None}
        hit = self._by_grad.get(id(tensor))
        return hit[0] if hit is not None and hit[1].grad is tensor else None

    def _work_out(self, caller, named, world):
        """A tensor's place, from Horovod's call, the bound name (``named``) and the compressor's
        process set: a disagreement is the exchange's fault."""
        ps, disagreement = exchange_process_set(caller, self._given, hvd.global_process_set, world)
        fault = None if disagreement is None else protocol.MismatchError(disagreement)
        param = named
        if caller.name is not None:
            if named is not None and named != caller.name:
                fault = fault or protocol.MismatchError(
                    f"the compressor's named_parameters call this gradient {named!r}, Horovod's "
                    f"optimizer {caller.name!r}: give both the same names, or none to the compressor (it "
                    "takes the optimizer's)")
            param = caller.name
            if self._positional_residuals:
                self._positional_residuals = False
                log.warning("hvd_qsgd: the checkpoint loaded keys its error-feedback residuals by position (a "
                            "compressor that numbered the optimizer's gradients); gradients from Horovod's "
                            "optimizer are matched by its parameter names now, so their residuals start from zero")
        per_node = self._per_node
        if per_node is None:
            try:
                per_node = self._per_node = horovod_ranks_per_node(hvd)   # until reset (elastic)
            except ValueError as e:  # HVD_QSGD_RANKS_PER_NODE malformed: this exchange's fault, on every rank
                per_node, fault = 0, fault or e
        # (a gradient Horovod's synchronize() hands over comes in an order that differs between ranks:
        # it goes alone, unless its fusion buffer is planned from the optimizer's parameters)
        order = self._order_of(caller.optimizer) if caller.name is not None and caller.optimizer is not None else None
        return Place(ps, process_set_ranks(ps, world), param, per_node, fault, alone=caller.late and order is None,
                     order=order)

    def _order_of(self, optimizer):
        """The ``ParameterOrder`` of Horovod's optimizer ``optimizer`` (worked out once), where fusion
        buffers are planned (``hvd_qsgd.exchange.buffer_plan``); else None: the gradients take the
        open buffers in the order they come."""
        if self._planned_dtypes is None:
            return None
        with self._lock:
            if optimizer not in self._orders:
                self._orders[optimizer] = order = parameter_order(optimizer, self._planned_dtypes)
                if order is None:
                    log.warning("hvd_qsgd: the fusion buffers of %s's gradients are not planned (its parameters "
                                "could not be read): they take their places in the order they come, which must "
                                "be the same on every rank", type(optimizer).__name__)
            return self._orders[optimizer]


def parameter_order(optimizer, dtypes):
    """The gradients Horovod's PyTorch ``optimizer`` hands over each step (those of the parameters
    that required one when it was made; ``synchronize()`` hands zeros for one that got none), in
    reverse order of its parameter groups, those of ``dtypes`` only; None where it has not the fields
    read (not Horovod's ``_DistributedOptimizer``)."""
    try:
        names, wanted, groups = optimizer._parameter_names, optimizer._requires_update, optimizer.param_groups
        params = [p for g in groups for p in g["params"] if p in wanted]
        return ParameterOrder((names[p], p.numel(), dtypes[p.dtype], p.device.type)
                              for p in reversed(params) if p.dtype in dtypes)
    except (AttributeError, KeyError, TypeError):
        return None
