"""``hvd_qsgd.horovod_caller``: what Horovod's calling frames say, read the same way step after step.

The walk keeps what it learned of each code object (``_KINDS``), so these tests call the same
functions several times, from frames of modules named as Horovod's, this package's and a user's."""
import types

import pytest

from hvd_qsgd import horovod_caller as hc


def _module(name, source, **names):
    """Functions defined in a module called ``name`` (their frames' ``__name__``)."""
    module = types.ModuleType(name)
    module.__dict__.update(names)
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


class _ProcessSet:
    process_set_id, ranks = 3, [0, 1]


class _Optimizer:
    """What Horovod's optimizer has: ``process_set`` and ``_parameter_names``."""

    def __init__(self, parameter):
        self.process_set = _ProcessSet()
        self._parameter_names = {parameter: "fc.weight"}


HOROVOD = """
def _allreduce_grad_async(self, p, compress):
    name = self._parameter_names.get(p)
    return compress(p)

def allreduce(tensor, compress, process_set=None):
    return compress(tensor)
"""
OURS = """
def compress(tensor):
    return _open(tensor)

def _open(tensor):
    return horovod_caller(ours=2)

def direct(tensor):
    return horovod_caller()
"""


@pytest.fixture(scope="module")
def modules():
    horovod = _module("horovod.torch.optimizer", HOROVOD)
    ours = _module("hvd_qsgd.testing_frames", OURS, horovod_caller=hc.horovod_caller)
    return horovod, ours


def test_the_optimizers_frame_gives_the_set_name_and_parameter_every_time(modules):
    horovod, ours = modules
    parameter = object()
    opt = _Optimizer(parameter)

    def user_wrapper_compress(t):   # a user's compression wrapper: its method is named compress
        return ours.compress(t)
    user_wrapper_compress.__code__ = user_wrapper_compress.__code__.replace(co_name="compress")
    for _ in range(3):
        caller = horovod._allreduce_grad_async(opt, parameter, user_wrapper_compress)
        assert caller.process_set is opt.process_set and caller.name == "fc.weight"
        assert caller.parameter is parameter
        assert caller.where == "horovod.torch.optimizer._allreduce_grad_async"


def test_a_collectives_process_set_argument_is_read(modules):
    horovod, ours = modules
    ps = _ProcessSet()
    for _ in range(2):
        caller = horovod.allreduce(object(), ours.compress, process_set=ps)
        assert (caller.process_set, caller.name, caller.parameter) == (ps, None, None)
        assert caller.where == "horovod.torch.optimizer.allreduce"


def test_a_users_function_between_stops_the_walk(modules):
    """A function of the user's (not named ``compress``) between Horovod and the compressor: nothing is
    learned, each time (what a frame is, once known, is not confused with another function's)."""
    horovod, ours = modules
    parameter = object()

    def helper(t):
        return ours.compress(t)
    for _ in range(2):
        assert horovod._allreduce_grad_async(_Optimizer(parameter), parameter, helper) is hc.NOT_LEARNED
        assert ours.compress(object()) is hc.NOT_LEARNED   # (called by the user directly)
    assert horovod._allreduce_grad_async(_Optimizer(parameter), parameter, ours.direct).name == "fc.weight"


def test_the_optimizers_frame_read_directly_agrees_with_the_walk(modules):
    """The optimizer's frame is read directly where it names the parameter and holds a process set
    (``OPTIMIZER_HOOK``); where it does not, the walk reads it as any Horovod frame, each time."""
    horovod, ours = modules
    parameter, stranger = object(), object()
    opt = _Optimizer(parameter)
    for _ in range(2):
        unnamed = horovod._allreduce_grad_async(opt, stranger, ours.compress)   # (not in _parameter_names)
        assert (unnamed.process_set, unnamed.name, unnamed.parameter) == (opt.process_set, None, None)
        assert unnamed.where == hc.OPTIMIZER_HOOK
        no_set = _Optimizer(parameter)
        no_set.process_set = None   # (an optimizer without one: the name is still learned)
        caller = horovod._allreduce_grad_async(no_set, parameter, ours.compress)
        assert (caller.process_set, caller.name, caller.parameter) == (None, "fc.weight", parameter)
