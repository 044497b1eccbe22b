"""What the PyTorch adapter and the optimizers built on it share about parameters: checked
(name, parameter) lists, the averaging of named tensors through a compressor, and the learning
rate of a parameter's group (for error feedback that follows the learning rate)."""
import weakref

import horovod.torch as hvd

from hvd_qsgd.state import state_by_key


def named_parameter_list(named_parameters, who, empty_ok=False):
    """``named_parameters`` as a list of (name, parameter) pairs with unique names (non-empty unless
    ``empty_ok``), or a ValueError naming ``who``."""
    named = list(named_parameters)
    pairs = all(isinstance(t, tuple) and len(t) == 2 and isinstance(t[0], str) for t in named)
    if (not named and not empty_ok) or not pairs:
        raise ValueError(f"{who}: named_parameters must be a {'' if empty_ok else 'non-empty '}list of (name, "
                         "parameter) pairs, as from model.named_parameters()")
    if len({n for n, _ in named}) != len(named):
        raise ValueError(f"{who}: parameter names must be unique")
    return named


def claim_compressor(compression, owner, who):
    """Refuse ``compression`` for the averaging optimizer ``owner`` (``who``) where another live one
    holds it and it keeps state by key (error-feedback residuals, DQSGD's schedules): the tensors
    ``average_named`` hands it are keyed by their place in each optimizer's step, so two optimizers'
    states would mix, silently. A compressor without such state may be shared."""
    settings, policy = getattr(compression, "settings", None), getattr(compression, "_policy", None)
    kept = None if settings is None or policy is None else state_by_key(settings, policy("torch").observes)
    if kept is None:
        return
    held = getattr(compression, "_averaged_by", None)
    other = None if held is None else held()
    if other is not None and other is not owner:
        raise ValueError(f"{who}: this compressor already serves another averaging optimizer ({type(other).__name__}) "
                         f"and keeps {kept} by the place of each update in a step, where the two optimizers' would "
                         "mix: give each optimizer its own compressor")
    compression._averaged_by = weakref.ref(owner)


def average_named(compression, named_tensors, prefix, process_set):
    """[(name, average over the process set of that tensor)] in the order given: each tensor goes
    through ``compression`` (compress, ``hvd.allreduce_async_`` with op Average as ``<prefix>.<name>``,
    decompress), all exchanges started before the first is waited on; each average has its tensor's
    shape and dtype. What the optimizers that average their own updates share (``EFSGDM``,
    ``PeriodicQuantizedAveraging``)."""
    pending = []
    for name, t in named_tensors:
        compressed, ctx = compression.compress(t)
        handle = hvd.allreduce_async_(compressed, op=hvd.Average, name=f"{prefix}.{name}", process_set=process_set)
        pending.append((name, t, handle, ctx))
    return [(name, compression.decompress(hvd.synchronize(handle), ctx).view_as(t).to(t.dtype))
            for name, t, handle, ctx in pending]


def group_learning_rate(optimizer, named):
    """(key, stepping) -> the lr of the parameter group holding the parameter of that name
    (``named()``: the bound (name, parameter) pairs, or None), or for position keys the lr every
    group shares. The groups are those of ``stepping``, the optimizer that applies the update
    (Horovod's, where it handed the gradient over; made from ``optimizer``, it has groups of its own
    once its ``load_state_dict`` has run), and where it holds no such parameter (or is None)
    ``optimizer``'s. Which group holds which name is worked out once per optimizer, again only when
    its groups or the bound parameters change."""
    held = {}   # id(an optimizer) -> (what its table was made of, {name: its group})

    def group_of(opt, key, params):
        groups = opt.param_groups
        of = (id(groups), tuple(len(g["params"]) for g in groups), id(params))
        table = held.get(id(opt))
        if table is None or table[0] != of:
            holder = {id(p): g for g in groups for p in g["params"]}
            table = held[id(opt)] = (of, {n: holder.get(id(p)) for n, p in params})
        return table[1].get(key)

    def lr(key, stepping=None):
        params, first = named(), optimizer if stepping is None else stepping
        if isinstance(key, str) and params is not None:
            for opt in (first,) if first is optimizer else (first, optimizer):
                group = group_of(opt, key, params)
                if group is not None:
                    return float(group["lr"])
        rates = {float(g["lr"]) for g in first.param_groups}
        if len(rates) == 1:
            return rates.pop()
        raise ValueError(f"follow_learning_rate: the optimizer's parameter groups have learning rates "
                         f"{sorted(rates)}, and the tensor {key!r} is not a named parameter: pass "
                         "named_parameters= to the compressor")
    return lr
