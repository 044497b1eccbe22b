"""Worker for tests/test_dropin.py: Horovod's PyTorch DistributedOptimizer with
``compression=hvd_qsgd.QSGD(...)`` and nothing else told to the compressor.

``process-set-<reduction>``: the optimizer reduces over the process set of the even ranks (or of the
odd ranks); the compressor is given no set and takes Horovod's, also through a user's wrapper
(``Wrapped``, with Adam).
``branches-<reduction>``: rank 0's loss leaves a layer unused, so its gradient reaches the compressor
last on rank 0 (Horovod's ``synchronize`` submits it) and in backward order elsewhere; the
compressor is given no names and takes the optimizer's. ``<reduction>``: ``REDUCTIONS``, fusion
buffers among them, which place that gradient where the optimizer's parameters plan it.

Each runs the step with ``hvd.Compression.none`` first (the reference) and then with QSGD, for SGD
with momentum and for Adam: the same parameters must be updated as in the reference, and the
replicas must be identical within each set. ``disagree-set`` and ``disagree-names``: a compressor
given another set, or other names, than the optimizer's raises on every rank (``RAISED ...``), and so
does ``disagree-shared``: one compressor with error feedback handed to the optimizers of two models
whose parameters have the same names (after a generator and a discriminator of other names shared
it, which works).
``late-fusion``: layers frozen after the first step (fine-tuning), with ``fusion=True`` and with
``fusion_mb``: Horovod's ``synchronize`` hands their gradients over in the order of a Python set,
made here to differ between ranks; they go alone, and the step works as uncompressed.
``differentiable``: ``hvd.allreduce(x, compression=...)`` of a tensor in the autograd graph carries
the gradient back as Horovod's own allreduce does (the same gradient as uncompressed).

Every rank prints ``OK <scenario>`` when its checks pass.
"""
import sys

import torch
import torch.nn.functional as F
import horovod.torch as hvd

import hvd_qsgd
from tests.mp.log_capture import logged

N, D_IN, H, D_OUT = 16, 100, 10, 10
OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
              "adam": lambda ps: torch.optim.Adam(ps, lr=0.01)}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(D_IN, H)
        self.fc2 = torch.nn.Linear(H, D_OUT)
        self.fc3 = torch.nn.Linear(D_OUT, D_OUT)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        y1 = self.fc2(x)
        return y1, self.fc3(F.relu(y1))


def data():
    g = torch.Generator().manual_seed(10 + hvd.rank())
    return torch.randn(N, D_IN, generator=g), torch.randn(N, D_OUT, generator=g)


def run(compression, optimizer, process_set, branches, steps=2, model=None):
    """{name: (value before, value after)} of a model (a new one by default) trained ``steps`` steps."""
    if model is None:
        torch.manual_seed(0)
        model = Net()
    opt = hvd.DistributedOptimizer(OPTIMIZERS[optimizer](model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   compression=compression, process_set=process_set)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    x, y = data()
    for _ in range(steps):
        y1, y2 = model(x)
        loss = F.mse_loss(y1 if branches and hvd.rank() == 0 else y2, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: (before[k], v.detach().clone()) for k, v in model.named_parameters()}


class Wrapped:
    """A user's wrapper of a compressor (counting its calls, say): its own compress and decompress."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def compress(self, tensor):
        self.calls += 1
        return self.inner.compress(tensor)

    def decompress(self, tensor, ctx):
        return self.inner.decompress(tensor, ctx)


def updated(result):
    return sorted(k for k, (a, b) in result.items() if not torch.equal(a, b))


def check_replicas(result, process_set, label):
    for k, (_, v) in result.items():
        every = hvd.allgather(v[None], name=f"check.{label}.{k}", process_set=process_set)
        assert all(torch.equal(o, v) for o in every), f"{label}: replicas differ in {k}"


def sets():
    size = hvd.size()
    even = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    odd = hvd.add_process_set([r for r in range(size) if r % 2 == 1])
    return even, odd, (even if hvd.rank() % 2 == 0 else odd)


REDUCTIONS = {"allgather": dict(reduction="allgather"), "scatter": dict(reduction="scatter_allgather"),
              # fusion buffers planned from the optimizer's parameters (hvd_qsgd.exchange.buffer_plan)
              "buffers": dict(reduction="allgather", fusion_mb=1),
              "buffers_overlap": dict(reduction="scatter_allgather", fusion_mb=1, overlap=True)}


def scenario(name, kind, reduction):
    even, odd, mine = sets() if kind == "process-set" else (None, None, hvd.global_process_set)
    try:
        for optimizer in OPTIMIZERS:
            label = f"{kind}-{reduction}-{optimizer}"
            ref = run(hvd.Compression.none, optimizer, mine, kind == "branches")
            c = hvd_qsgd.QSGD(4, min_numel=1, **REDUCTIONS[reduction])
            # with Adam the optimizer holds a user's wrapper of the compressor, through whose compress
            # the compressor still learns Horovod's set and names
            got = run(c if optimizer == "sgd" else Wrapped(c), optimizer, mine, kind == "branches")
            assert updated(got) == updated(ref) == sorted(got), (label, updated(got), updated(ref))
            check_replicas(got, mine, label)
            assert c.stats["tensors"] == 2 * len(got), (label, c.stats)
    finally:
        if even is not None:
            hvd.remove_process_set(odd)
            hvd.remove_process_set(even)
    print(f"OK {name}", flush=True)


def shared_state():
    """One compressor with error feedback for two models: of other names, each keeps its residuals;
    of the same names, their residuals would mix, and the first step raises."""
    shared = hvd_qsgd.QSGD(4, min_numel=1, error_feedback=True)
    models = {}
    for label in ("generator", "discriminator"):
        torch.manual_seed(0)
        models[label] = torch.nn.Sequential()
        models[label].add_module(label, Net())
    results = [run(shared, "sgd", hvd.global_process_set, False, steps=2, model=m) for m in models.values()]
    for label, got in zip(models, results):
        check_replicas(got, hvd.global_process_set, f"shared-{label}")
    assert len(shared.state_dict()["torch"]["residuals"]) == 2 * len(results[0]), shared.state_dict()["torch"]
    torch.manual_seed(0)
    twin = torch.nn.Sequential()
    twin.add_module("generator", Net())
    run(shared, "sgd", hvd.global_process_set, False, steps=1, model=twin)


def disagreement(kind):
    if kind == "shared":
        shared_state()
        return
    even, odd, mine = sets()
    try:
        torch.manual_seed(0)
        model = Net()
        if kind == "set":
            c = hvd_qsgd.QSGD(4, min_numel=1, process_set=hvd.global_process_set)
            run(c, "sgd", mine, False, steps=1)
        elif kind == "unused-fusion":   # fc3 unused on rank 0: its gradient comes late there alone
            run(hvd_qsgd.QSGD(4, min_numel=1, fusion=True), "sgd", hvd.global_process_set, True, steps=1)
        else:
            c = hvd_qsgd.QSGD(4, min_numel=1, named_parameters=[(f"other.{k}", v) for k, v in model.named_parameters()])
            run(c, "sgd", hvd.global_process_set, False, steps=1, model=model)
    finally:
        hvd.remove_process_set(odd)
        hvd.remove_process_set(even)


class Heads(torch.nn.Module):
    """A trunk and three heads of one shape in a row: ``freeze`` stops the heads' gradients."""

    def __init__(self, spread):
        super().__init__()
        self.trunk = torch.nn.Linear(D_IN, H)
        # (allocations between the heads, which differ between ranks, move their ids and so their
        # order in a Python set)
        self.spread = [torch.empty(1 + 37 * spread) for _ in range(spread)]
        self.heads = torch.nn.ModuleList([torch.nn.Linear(H, H) for _ in range(3)])
        self.out = torch.nn.Linear(H, D_OUT)

    def forward(self, x):
        x = F.relu(self.trunk(x))
        for head in self.heads:
            x = F.relu(head(x))
        return self.out(x)


def late_order(opt, model):
    """The order in which Horovod's ``synchronize`` hands over the frozen heads' gradients: its own
    set difference, ``_requires_update - completed``, made the same way."""
    frozen = {p for p in model.heads.parameters()}
    completed = {p for p in model.parameters() if p not in frozen}
    return [opt._parameter_names[p] for p in opt._requires_update - completed]


def late_model(compression, label):
    """A model and its optimizer whose frozen heads' gradients the ranks' sets order differently."""
    for attempt in range(64):
        torch.manual_seed(0)
        model = Heads(spread=(hvd.rank() * 7 + attempt) % 13)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=compression)
        orders = hvd.allgather_object(late_order(opt, model), name=f"late.{label}.{attempt}")
        if any(o != orders[0] for o in orders):
            return model, opt
    raise AssertionError(f"no model in 64 whose late gradients come in different orders: {orders}")


def late_fusion():
    """Heads frozen after the first step; their gradients come late, in an order that differs
    between ranks (checked), and fusion and fusion buffers still give the uncompressed updates."""
    x, y = data()
    for label, compression in (("none", hvd.Compression.none),
                               ("fusion", hvd_qsgd.QSGD(4, min_numel=1, fusion=True)),
                               ("fusion_mb", hvd_qsgd.QSGD(4, min_numel=1, fusion_mb=1))):
        model, opt = late_model(compression, label)
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        for step in range(3):
            if step == 1:
                model.heads.requires_grad_(False)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        got = {k: (before[k], v.detach().clone()) for k, v in model.named_parameters()}
        check_replicas(got, hvd.global_process_set, f"late-{label}")
        if label == "none":
            ref = updated(got)
        assert updated(got) == ref, (label, updated(got), ref)
        if label != "none":   # every gradient of every step went through the compressor
            assert compression.stats["tensors"] == 3 * len(got), (label, compression.stats)
    print("OK late-fusion", flush=True)


def differentiable():
    """The gradient through a compressed ``hvd.allreduce`` is Horovod's: its allreduce of the result's
    gradient, with the same op, scale factors and process set."""
    calls = [dict(), dict(op=hvd.Sum), dict(op=hvd.Average, prescale_factor=0.5, postscale_factor=3.0)]
    for reduction in ("allgather", "scatter_allgather"):
        for i, kwargs in enumerate(calls):
            grads, values = [], []
            for compression in (hvd.Compression.none, hvd_qsgd.QSGD(8, min_numel=1, reduction=reduction)):
                g = torch.Generator().manual_seed(100 + hvd.rank())
                w = torch.randn(3000, generator=g).requires_grad_()
                upstream = torch.randn(3000, generator=g)
                y = hvd.allreduce(w * 2, compression=compression, name=f"differentiable.{reduction}.{i}", **kwargs)
                assert y.requires_grad, (reduction, kwargs)
                (y * upstream).sum().backward()
                grads.append(w.grad)
                values.append(y.detach())
            assert torch.allclose(grads[1], grads[0], rtol=1e-6, atol=1e-6), (reduction, kwargs)
            # (the values are QSGD's: within 8-bit quantization of the exact ones)
            assert (values[1] - values[0]).norm() < 0.05 * values[0].norm(), (reduction, kwargs)
    print("OK differentiable", flush=True)


def reinit():
    """Horovod shut down and initialised again with a step's exchanges unfinished, as an elastic reset
    under Horovod's own TorchState does (it restores the optimizer by load_state_dict and knows
    nothing of the compressor): the compressor forgets them and drops its residuals, saying so once;
    the steps after route every gradient by its name again (residuals kept by name, none by
    position, where they piled up step after step), and the replicas stay identical."""
    torch.manual_seed(0)
    model = Net()
    c = hvd_qsgd.QSGD(4, min_numel=1, error_feedback=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), compression=c)
    x, y = data()

    def backward():
        opt.zero_grad()
        F.mse_loss(model(x)[1], y).backward()

    backward()
    opt.step()
    backward()                    # the step that fails: its exchanges are left unfinished
    hvd.barrier()                 # (every rank's collectives started: a rank that shut down while another
    hvd.shutdown()                # was still starting them failed that one's backward, on a loaded machine)
    hvd.init()
    opt.load_state_dict(opt.state_dict())
    with logged() as seen:
        for _ in range(3):
            backward()
            opt.step()
    keys = c.state_dict()["torch"]["residuals"]
    assert set(keys) == {n for n, _ in model.named_parameters()}, sorted(map(str, keys))
    said = [m for m in seen if "Horovod was initialised again (an elastic reset?) with" in m]
    assert len(said) == 1 and "exchange(s) of this compressor unfinished" in said[0], seen
    for name, p in model.named_parameters():
        copies = hvd.allgather(p.detach().reshape(1, -1), name=f"reinit.{name}")
        assert all(torch.equal(copies[0], row) for row in copies), name
    print("OK reinit", flush=True)


def positional_checkpoint():
    """Residuals checkpointed by position (as earlier releases numbered hvd.allreduce's tensors; they
    are kept by the call's name now) and loaded into a compressor that Horovod's optimizer hands named
    gradients: it says once that their residuals restart."""
    old = hvd_qsgd.QSGD(4, min_numel=1, error_feedback=True)
    for i in range(2):
        hvd.allreduce(torch.randn(300), compression=old, name=f"positional.{i}")
    state = old.state_dict()
    kept = state["torch"]["residuals"]
    assert sorted(kept) == ["positional.0", "positional.1"], sorted(kept)
    state["torch"]["residuals"] = {i: kept[f"positional.{i}"] for i in range(2)}   # (an earlier release's)
    new = hvd_qsgd.QSGD(4, min_numel=1, error_feedback=True)
    new.load_state_dict(state)
    with logged() as seen:
        run(new, "sgd", hvd.global_process_set, False, steps=2)
    said = [m for m in seen if "keys its error-feedback residuals by position" in m]
    assert len(said) == 1, seen
    print("OK positional-checkpoint", flush=True)


def main():
    hvd.init()
    for s in sys.argv[1:]:
        if s.startswith("disagree-"):
            try:
                disagreement(s[len("disagree-"):])
            except Exception as e:
                print(f"RAISED {type(e).__name__}: {' '.join(str(e).split())[:1500]} (scenario {s})", flush=True)
                continue
            print(f"NOT RAISED (scenario {s})", flush=True)
            sys.exit(1)
        if s == "positional-checkpoint":
            positional_checkpoint()
            continue
        if s == "late-fusion":
            late_fusion()
            continue
        if s == "differentiable":
            differentiable()
            continue
        if s == "reinit":   # (last: Horovod is initialised again)
            reinit()
            continue
        kind, reduction = s.rsplit("-", 1)
        scenario(s, kind, reduction)


if __name__ == "__main__":
    main()
