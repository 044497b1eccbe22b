"""Worker for tests/test_torch_compressor.py: the scenarios named on the command line, one after the
other, under horovodrun.

Every rank prints ``OK <scenario>`` when its checks pass, or ``RAISED <type>: <message> (scenario
<scenario>)`` (one line) when the scenario is expected to fail and the compressor raised; the test
reads those lines.

The reference for a compressed tensor is computed independently on every rank: each rank's local
gradient is gathered, re-encoded with the documented payload seed
(``protocol.payload_seed(seed, rank, exchange_name, 0)``) and fingerprint, and decoded with
``codec.decode_sum(payloads, scale)``; the synchronized gradient must equal it exactly.
"""
import argparse
import copy
import itertools
import logging
import math
import sys

import torch
import torch.nn as nn
import horovod.torch as hvd

from horovod.torch.compression import Compressor

import hvd_qsgd
import hvd_qsgd.torch
from hvd_qsgd import codec, cost_model, protocol, reduction
from hvd_qsgd.settings import Settings
from tests.mp.log_capture import logged

SEED = 7


class Net(nn.Module):
    """Parameters big enough to be compressed (>= 10,000 elements) and small ones that are not."""

    def __init__(self, dtype=torch.float32, skip_layer=False):
        super().__init__()
        self.fc1 = nn.Linear(64, 200).to(dtype)     # 12,800 + 200
        self.fc2 = nn.Linear(200, 100).to(dtype)    # 20,000 + 100
        self.extra = nn.Linear(100, 100).to(dtype)  # 10,000 + 100 (skipped on some ranks)
        self.fc3 = nn.Linear(100, 10).to(dtype)     # 1,000 + 10
        self.skip_layer = skip_layer

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = torch.relu(self.fc2(h))
        if not self.skip_layer:
            h = torch.relu(self.extra(h))
        return self.fc3(h)


def batch(rank, step=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 64, generator=g).to(dtype), torch.randint(0, 10, (16,), generator=g)


def local_grads(model, rank, passes=1, dtype=torch.float32):
    """The gradients this rank computes on its own (no Horovod hooks), summed over ``passes``."""
    m = copy.deepcopy(model)
    m.zero_grad()
    for i in range(passes):
        x, y = batch(rank, i, dtype)
        nn.functional.cross_entropy(m(x).float(), y).backward()
    return {n: p.grad.detach().clone() for n, p in m.named_parameters()}


_names = itertools.count()


def gather(t):
    """Every rank's copy of t, in rank order (bf16 travels as float32, which holds it exactly).
    Named: Horovod numbers unnamed ops per process, which diverges once some ranks ran more ops."""
    out = hvd.allgather(t.detach().float().unsqueeze(0), name=f"test.gather.{next(_names)}")
    return [x.to(t.dtype) for x in out.unbind(0)]


def reference(grads_by_rank, exchange, name, shape, dtype, bits, bucket, scale, fingerprint_name=""):
    payloads = [codec.encode(g.float().numpy().reshape(-1), bits, bucket, "max",
                             protocol.payload_seed(SEED, r, exchange, 0), "fixed",
                             codec.tensor_fingerprint(fingerprint_name, shape, str(dtype).replace("torch.", "")), True,
                             source_dtype=str(dtype).replace("torch.", ""))
                for r, g in enumerate(grads_by_rank)]
    return torch.from_numpy(codec.decode_sum(payloads, scale)).view(shape).to(dtype)


def scatter_reference(xs, exchange, shape, dtype, settings, alpha, fp_name=""):
    """The single-process simulation of scatter_allgather (``reduction.simulate``) on every rank's
    tensor, with the documented step seeds: (result, phase-1 payloads [r][j], reduced chunks [j])."""
    dname = str(dtype).replace("torch.", "")
    fp = codec.tensor_fingerprint(fp_name, shape, dname)
    seeds = [protocol.payload_seed(SEED, r, exchange, 0) for r in range(len(xs))]
    out, sent, reduced = reduction.simulate([x.float().numpy().reshape(-1) for x in xs], settings, seeds, alpha,
                                            fp, dname)
    return torch.from_numpy(out).view(shape).to(dtype), sent, reduced


def scatter_bytes(sent, reduced, rank):
    """(bytes sent, bytes received) by ``rank`` in both phases (own chunk and own slot excluded;
    a reduced chunk travels in a frame with an 8-byte length)."""
    n = len(sent)
    out = sum(sent[rank][j].size for j in range(n) if j != rank) + 8 + reduced[rank].size
    into = (sum(sent[r][rank].size for r in range(n) if r != rank)
            + sum(8 + reduced[j].size for j in range(n) if j != rank))
    return out, into


def check_scatter_allreduce(c, t, seq, alpha, op=None, name=None, fp_name=""):
    """hvd.allreduce of t through c (scatter_allgather) equals the simulation, on every rank."""
    kwargs = {} if op is None else {"op": op}
    out = hvd.allreduce(t, compression=c, name=name, **kwargs)
    ref, sent, reduced = scatter_reference(gather(t), f"hvd_qsgd.{c._creation_index}.s{seq}", t.shape, t.dtype,
                                           c.settings, alpha, fp_name)
    assert out.dtype == t.dtype and out.shape == t.shape
    assert torch.equal(out, ref), f"scatter_allgather of {tuple(t.shape)} {t.dtype}: max diff {(out - ref).abs().max()}"
    check_identical(out, "scatter_allgather")
    return sent, reduced


def gather_in(ps, t):
    return list(hvd.allgather(t.detach().unsqueeze(0), process_set=ps, name="test.gather_in").unbind(0))


def check_identical(t, what):
    copies = gather(t)
    for r, c in enumerate(copies):
        assert torch.equal(c, copies[0]), f"{what}: rank {r} differs from rank 0"


def wrap_compress(compressor):
    """Wrap ``compressor.compress`` in a function of the test's own, as a user may."""
    inner = compressor.compress

    def compress(tensor):
        return inner(tensor)
    compressor.compress = compress


def optimizer_step(model, compressor, passes=1, **kwargs):
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=compressor,
                                   backward_passes_per_step=passes, **kwargs)
    opt.zero_grad()
    for i in range(passes):
        x, y = batch(hvd.rank(), i, next(model.parameters()).dtype)
        nn.functional.cross_entropy(model(x).float(), y).backward()
    opt.synchronize()
    return opt


def check_resume(rank):
    """A checkpoint holds the counters that seed the next payloads: a compressor that loads it draws
    the streams it drew after the save, so a resumed run is the uninterrupted run, bit for bit. A
    checkpoint without them (earlier releases) leaves the counters where they are."""
    model = Net()
    c = hvd_qsgd.QSGD(2, seed=SEED, error_feedback=True, named_parameters=model.named_parameters())
    opt = optimizer_step(model, c)
    saved = c.state_dict()
    compressed = [n for n, p in model.named_parameters() if p.numel() >= 10000]
    assert saved["torch"]["counters"]["occurrences"] == {n: 1 for n in compressed}, saved["torch"]["counters"]

    def step():
        opt.zero_grad()
        x, y = batch(rank, 1)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        return {n: p.grad.clone() for n, p in model.named_parameters() if n in compressed}

    after_save = step()
    c.load_state_dict(saved)
    resumed = step()
    assert all(torch.equal(resumed[n], after_save[n]) for n in compressed), "resumed run drew other streams"
    c.load_state_dict({"torch": {k: v for k, v in saved["torch"].items() if k != "counters"}})
    moved_on = step()
    assert not any(torch.equal(moved_on[n], after_save[n]) for n in compressed), "counters did not move on"
    # rank 0's checkpoint loaded on every rank (Horovod's examples save on rank 0): its residuals are
    # rank 0's, so the other ranks' start from zero, saying so; the counters load everywhere
    assert (saved["torch"]["rank"], saved["torch"]["size"]) == (rank, hvd.size())
    root = hvd.broadcast_object(saved, root_rank=0, name="check_resume")
    with logged() as messages:
        c.load_state_dict(root)
    now = c.state_dict()["torch"]
    assert now["counters"] == root["torch"]["counters"], (now["counters"], root["torch"]["counters"])
    if rank == 0:
        assert messages == [] and now["residuals"].keys() == root["torch"]["residuals"].keys()
    else:
        assert now["residuals"] == {} and now["residual_lr"] == {}, now
        assert len(messages) == 1 and f"made on rank 0 of {hvd.size()}, this is rank {rank}" in messages[0], messages
    # into a compressor without error feedback the residuals are not loaded (never used, they would
    # be carried into every later checkpoint), saying so
    plain = hvd_qsgd.QSGD(2, seed=SEED, named_parameters=model.named_parameters())
    with logged() as messages:
        plain.load_state_dict(saved)
    assert plain.state_dict()["torch"]["residuals"] == {} and len(messages) == 1, messages
    assert "holds error-feedback residuals, and this compressor keeps none (error_feedback=False)" in messages[0]
    # rank 0's checkpoint without residuals (no error feedback) loads on every rank without a word
    bare = hvd.broadcast_object(plain.state_dict(), root_rank=0, name="check_resume_bare")
    with logged() as messages:
        hvd_qsgd.QSGD(2, seed=SEED, named_parameters=model.named_parameters()).load_state_dict(bare)
    assert messages == [], messages


def check_optimizer(model, compressor, bits, bucket, passes=1, scale=None, **kwargs):
    """After one synchronized step every gradient equals its reference, on every rank. The exchanges
    are named by parameter: the names given to the compressor, or those Horovod's optimizer holds
    (learned through ``wrap_compress``'s wrapper as without it, also on the grouped path)."""
    n, rank = hvd.size(), hvd.rank()
    mine = local_grads(model, rank, passes)
    all_grads = {k: gather(v) for k, v in mine.items()}
    wrap_compress(compressor)
    optimizer_step(model, compressor, passes, **kwargs)
    params = dict(model.named_parameters())
    scale = 1.0 / n if scale is None else scale
    for name, p in params.items():
        if p.numel() >= 10000:
            exchange, fp_name = f"hvd_qsgd.{compressor._creation_index}.p.{name}", name
            ref = reference(all_grads[name], exchange, name, p.shape, p.dtype, bits, bucket, scale, fp_name)
            assert torch.equal(p.grad, ref), f"{name}: max diff {(p.grad - ref).abs().max()}"
        else:
            ref = torch.stack(all_grads[name]).sum(0) * scale
            assert torch.allclose(p.grad, ref, rtol=1e-5, atol=1e-7), f"{name} (uncompressed)"
        check_identical(p.grad, name)
    return compressor


def scenario(s):
    n, rank = hvd.size(), hvd.rank()
    torch.manual_seed(0)
    if s == "optimizer-named":
        model = Net()
        c = hvd_qsgd.QSGD(4, seed=SEED, named_parameters=model.named_parameters())
        check_optimizer(model, c, 4, 512)
        st = c.stats
        assert st["tensors"] == 3 and st["elements"] == 12800 + 20000 + 10000, st
        sent = sum(codec.payload_nbytes(k, 4, 512) for k in (12800, 20000, 10000))
        assert st["bytes_sent"] == sent and st["bytes_received"] == (n - 1) * sent, st
        assert abs(st["ratio"] - 4 * st["elements"] / sent) < 1e-12
    elif s == "optimizer-plain":
        check_optimizer(Net(), hvd_qsgd.QSGD(8, seed=SEED), 8, 512)
    elif s == "optimizer-torch-class":
        model = Net()
        c = hvd_qsgd.torch.QSGD(2, seed=SEED)
        assert isinstance(c, Compressor)
        check_optimizer(model, c, 2, 128)
    elif s == "predivide":
        check_optimizer(Net(), hvd_qsgd.QSGD(4, seed=SEED), 4, 512, gradient_predivide_factor=2.0)
    elif s == "sum":
        check_optimizer(Net(), hvd_qsgd.QSGD(4, seed=SEED), 4, 512, scale=1.0, op=hvd.Sum)
    elif s == "passes":
        model = Net()
        check_optimizer(model, hvd_qsgd.QSGD(4, seed=SEED, named_parameters=model.named_parameters()),
                        4, 512, passes=2)
    elif s == "groups":
        check_optimizer(Net(), hvd_qsgd.QSGD(4, seed=SEED), 4, 512, groups=2)
    elif s == "dynamic-named":
        # rank 1 skips a layer: its gradient is submitted late, in synchronize(); names match anyway
        model = Net(skip_layer=(rank == 1))
        c = hvd_qsgd.QSGD(4, seed=SEED, named_parameters=model.named_parameters())
        optimizer_step(model, c)
        for name, p in model.named_parameters():
            check_identical(p.grad, name)
    elif s == "scatter-dynamic-named":
        # rank 1 skips a layer and hands gradients over in another order: second phases start in
        # different orders on different ranks, and nobody waits on a phase another has not started
        model = Net(skip_layer=(rank == 1))
        c = hvd_qsgd.QSGD(4, seed=SEED, reduction="scatter_allgather", named_parameters=model.named_parameters())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=c)
        for step in range(2):
            opt.zero_grad()
            x, y = batch(rank, step)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            for name, p in model.named_parameters():
                check_identical(p.grad, name)
                check_identical(p.data, name)
    elif s == "allreduce":
        t = torch.randn(3, 10000, generator=torch.Generator().manual_seed(rank))
        c = hvd_qsgd.QSGD(4, seed=SEED)
        for i, (op, scale) in enumerate(((hvd.Average, 1.0 / n), (hvd.Sum, 1.0))):
            out = hvd.allreduce(t, compression=c, op=op, name=f"t{i}")
            ref = reference(gather(t), f"hvd_qsgd.{c._creation_index}.s{i}", "t", t.shape, t.dtype, 4, 512, scale)
            assert torch.equal(out, ref), f"allreduce op={op}"
            check_identical(out, "allreduce")
        outs = hvd.grouped_allreduce([t, t[0, :50], 2 * t], compression=c)
        for j, (x, seq) in enumerate(((t, 2), (2 * t, 3))):
            ref = reference(gather(x), f"hvd_qsgd.{c._creation_index}.s{seq}", "", x.shape, x.dtype, 4, 512, 1.0 / n)
            assert torch.equal(outs[2 * j], ref), "grouped_allreduce"
        assert torch.allclose(outs[1], hvd.allreduce(t[0, :50])), "small tensor in a group"
    elif s == "dtypes":
        c = hvd_qsgd.QSGD(4, seed=SEED)
        for i, dtype in enumerate((torch.float16, torch.bfloat16, torch.float32)):
            t = torch.randn(20000, generator=torch.Generator().manual_seed(rank)).to(dtype)
            out = hvd.allreduce(t, compression=c)
            assert out.dtype == dtype and out.shape == t.shape
            ref = reference(gather(t), f"hvd_qsgd.{c._creation_index}.s{i}", "", t.shape, dtype, 4, 512, 1.0 / n)
            assert torch.equal(out, ref), dtype
        ints = torch.arange(20000, dtype=torch.int64) * (rank + 1)
        assert torch.equal(hvd.allreduce(ints, compression=c, op=hvd.Sum), ints // (rank + 1) * (n * (n + 1) // 2))
        d = torch.randn(20000, dtype=torch.float64)
        assert torch.equal(hvd.allreduce(d, compression=c, op=hvd.Sum), hvd.allreduce(d, op=hvd.Sum))
        assert c.stats["tensors"] == 3 and c.stats["raw_tensors"] == 2
    elif s == "sparse-as-dense":
        emb = nn.Embedding(1000, 20, sparse=True)
        c = hvd_qsgd.QSGD(4, seed=SEED)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                       named_parameters=emb.named_parameters(), compression=c,
                                       sparse_as_dense=True)
        idx = torch.arange(10) + 10 * rank
        mine = torch.zeros(1000, 20)
        mine[idx] = 1.0
        emb(idx).sum().backward()
        opt.synchronize()
        ref = reference(gather(mine), f"hvd_qsgd.{c._creation_index}.s0", "", mine.shape, mine.dtype, 4, 512, 1.0 / n)
        assert torch.equal(emb.weight.grad.to_dense(), ref)
    elif s == "error-feedback":
        model = Net()
        c = hvd_qsgd.QSGD(2, seed=SEED, error_feedback=True, named_parameters=model.named_parameters())
        mine = local_grads(model, rank)
        optimizer_step(model, c)
        state = c.state_dict()
        residuals = state["torch"]["residuals"]
        assert set(residuals) == {"fc1.weight", "fc2.weight", "extra.weight"}, set(residuals)
        for name, e in residuals.items():
            g = mine[name].reshape(-1)
            payload = codec.encode(g.numpy(), 2, 128, "max",
                                   protocol.payload_seed(SEED, rank, f"hvd_qsgd.{c._creation_index}.p.{name}", 0),
                                   "fixed", codec.tensor_fingerprint(name, mine[name].shape, "float32"))
            assert torch.equal(e, g - torch.from_numpy(codec.decode(payload))), name
        # the next encoding adds the residual: the second step encodes g + e
        c2 = hvd_qsgd.QSGD(2, seed=SEED, error_feedback=True, named_parameters=model.named_parameters())
        c2.load_state_dict(state)
        restored = c2.state_dict()["torch"]
        assert all(torch.equal(restored["residuals"][k], v) for k, v in residuals.items())
        assert restored["stats"] == state["torch"]["stats"] and c2.stats == c.stats
        check_resume(rank)
    elif s == "process-set":
        ps = hvd.ProcessSet([1, n - 1])
        hvd.add_process_set(ps)  # needs HOROVOD_DYNAMIC_PROCESS_SETS=1
        t = torch.randn(20000, generator=torch.Generator().manual_seed(rank))
        c = hvd_qsgd.QSGD(4, seed=SEED, process_set=ps)
        if ps.included():
            out = hvd.allreduce(t, compression=c, process_set=ps, name="t")
            mine = [x for r, x in enumerate(gather_in(ps, t))]
            ref = reference(mine, f"hvd_qsgd.{c._creation_index}.s0", "", t.shape, t.dtype, 4, 512, 0.5)
            assert torch.equal(out, ref)
        hvd.allreduce(torch.zeros(1), name="done")
    elif s == "scatter-optimizer":
        model = Net()
        c = hvd_qsgd.QSGD(4, seed=SEED, reduction="scatter_allgather", named_parameters=model.named_parameters())
        mine = local_grads(model, rank)
        all_grads = {k: gather(v) for k, v in mine.items()}
        optimizer_step(model, c)
        sent = received = 0
        for name, p in model.named_parameters():
            if p.numel() >= 10000:
                ref, ph1, red = scatter_reference(all_grads[name], f"hvd_qsgd.{c._creation_index}.p.{name}", p.shape,
                                                  p.dtype, c.settings, 1.0 / n, name)
                assert torch.equal(p.grad, ref), f"{name}: max diff {(p.grad - ref).abs().max()}"
                a, b = scatter_bytes(ph1, red, rank)
                sent, received = sent + a, received + b
            check_identical(p.grad, name)
        st = c.stats
        assert st["tensors"] == 3 and st["bytes_sent"] == sent and st["bytes_received"] == received, (st, sent, received)
    elif s == "join-buffered":
        from torch_buffers import check_join_buffered
        check_join_buffered(n, rank)
    elif s.startswith("join-"):
        check_join(s[len("join-"):], n, rank)
    elif s == "report":
        check_report(n)
    elif s == "fusion":
        check_fusion(n, rank)
    elif s == "buffers":
        from torch_buffers import check_buffer_fault, check_buffer_ops, check_buffers
        check_buffers(n, rank)
        check_buffer_fault(n, rank)
        check_buffer_ops(n, rank)
    elif s == "overlap":
        check_overlap(rank)
    elif s == "default-large":
        # hvd_qsgd.QSGD(4) as the README has it: a 1,000,000-element gradient resolves to
        # scatter_allgather from 3 ranks on; each rank receives <= 1.2 x 2(n-1)/n x d x b/8 bytes of it
        model = nn.Sequential(nn.Linear(64, 1000), nn.ReLU(), nn.Linear(1000, 1000), nn.ReLU(), nn.Linear(1000, 10))
        c = hvd_qsgd.QSGD(4, seed=SEED, named_parameters=model.named_parameters())
        assert c.settings.reduction == "auto"
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
        m = copy.deepcopy(model)
        nn.functional.cross_entropy(m(x), y).backward()
        all_grads = {k: gather(p.grad) for k, p in m.named_parameters()}
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=c)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        received = 0
        for name, p in model.named_parameters():
            if p.numel() < 10000:
                continue
            exchange = f"hvd_qsgd.{c._creation_index}.p.{name}"
            chosen = c.settings.exchange_reduction(n, p.numel())
            if chosen == "scatter_allgather":
                ref, ph1, red = scatter_reference(all_grads[name], exchange, p.shape, p.dtype, c.settings, 1.0 / n, name)
                into = scatter_bytes(ph1, red, rank)[1]
            else:
                ref = reference(all_grads[name], exchange, name, p.shape, p.dtype, 4, 512, 1.0 / n, name)
                into = (n - 1) * codec.payload_nbytes(p.numel(), 4, 512)
            if p.numel() == 10**6:
                bound = 1.2 * 2 * (n - 1) / n * p.numel() * 4 / 8
                assert chosen == "scatter_allgather" and into <= bound, (name, chosen, into, bound)
            assert torch.equal(p.grad, ref), f"{name} ({chosen}): max diff {(p.grad - ref).abs().max()}"
            check_identical(p.grad, name)
            received += into
        assert c.stats["bytes_received"] == received, (c.stats, received)
    elif s == "scatter-allreduce":
        c = hvd_qsgd.QSGD(4, seed=SEED, reduction="scatter_allgather", min_numel=1)
        g = torch.Generator().manual_seed(rank)
        check_scatter_allreduce(c, torch.randn(3, 10000, generator=g), 0, 1.0 / n, name="avg")
        check_scatter_allreduce(c, torch.randn(20000, generator=g), 1, 1.0, op=hvd.Sum, name="sum")
        check_scatter_allreduce(c, torch.randn(20000, generator=g).half(), 2, 1.0 / n, name="fp16")
        # fewer buckets than ranks: some chunks are empty
        check_scatter_allreduce(c, torch.randn(1000, generator=g), 3, 1.0 / n, name="small")
        assert any(b == e for b, e in reduction.chunk_ranges(1000, 512, n)) == (n > 2)
        # predivide, as the optimizer applies it: prescale 1/f, postscale f/n -> alpha 1/n
        out = hvd.grouped_allreduce([torch.randn(20000, generator=g), torch.randn(30000, generator=g)], compression=c)
        assert [o.numel() for o in out] == [20000, 30000]
    elif s == "scatter-collective-failure":
        # a collective of the second phase fails (as when a rank dies in elastic training): the
        # optimizer sees Horovod's own HorovodInternalError, which hvd.elastic.run recovers from, and
        # the compressor keeps working afterwards
        from horovod.common.exceptions import HorovodInternalError
        import hvd_qsgd.adapters.torch as adapter
        c = hvd_qsgd.QSGD(4, seed=SEED, reduction="scatter_allgather")
        t = torch.randn(20000, generator=torch.Generator().manual_seed(rank))
        real = adapter.hvd.allgather_async

        def failing(*args, **kwargs):
            raise HorovodInternalError("simulated: a rank left during the second phase")
        adapter.hvd.allgather_async = failing
        try:
            hvd.allreduce(t, compression=c, name="fails")
            raise AssertionError("a failed second phase did not raise")
        except HorovodInternalError as e:
            assert type(e) is HorovodInternalError and "simulated" in str(e), repr(e)
        finally:
            adapter.hvd.allgather_async = real
        check_scatter_allreduce(c, t, 1, 1.0 / n, name="after")
    elif s == "scatter-elias":
        # ranks scale their gradients differently: Elias payloads differ in length per rank
        t = torch.randn(40000, generator=torch.Generator().manual_seed(rank)) * torch.linspace(0, 1, 40000) ** (rank + 1)
        for i, red in enumerate(("scatter_allgather", "allgather")):
            c = hvd_qsgd.QSGD(4, seed=SEED, coding="elias", reduction=red)
            if red == "scatter_allgather":
                sent, reduced = check_scatter_allreduce(c, t, 0, 1.0 / n, name=f"elias{i}")
                lengths = [sum(p.size for p in row) for row in sent]
                assert len(set(lengths)) == n, f"phase-1 lengths per rank: {lengths}"
                assert c.stats["bytes_sent"] == scatter_bytes(sent, reduced, rank)[0]
            else:
                out = hvd.allreduce(t, compression=c, name=f"elias{i}")
                xs = gather(t)
                payloads = [codec.encode(x.numpy(), 4, 512, "max",
                                         protocol.payload_seed(SEED, r, f"hvd_qsgd.{c._creation_index}.s0", 0),
                                         "elias", codec.tensor_fingerprint("", t.shape, "float32"))
                            for r, x in enumerate(xs)]
                assert len({p.size for p in payloads}) == n, [p.size for p in payloads]
                assert torch.equal(out, torch.from_numpy(codec.decode_sum(payloads, 1.0 / n)))
                assert c.stats["bytes_received"] == sum(p.size for p in payloads) - payloads[rank].size
                check_identical(out, "elias allgather")
    elif s == "auto":
        c = hvd_qsgd.QSGD(4, seed=SEED, reduction="auto")
        g = torch.Generator().manual_seed(rank)
        for seq, numel in enumerate((20000, 400000)):
            t = torch.randn(numel, generator=g)
            chosen = cost_model.choose(n, numel, 4, 512)
            assert chosen == ("scatter_allgather" if n >= 3 and numel == 400000 else "allgather"), (n, numel, chosen)
            if chosen == "scatter_allgather":
                check_scatter_allreduce(c, t, seq, 1.0 / n, name=f"auto{seq}")
            else:
                out = hvd.allreduce(t, compression=c, name=f"auto{seq}")
                ref = reference(gather(t), f"hvd_qsgd.{c._creation_index}.s{seq}", "", t.shape, t.dtype, 4, 512, 1.0 / n)
                assert torch.equal(out, ref), "auto -> allgather"
    elif s == "scatter-error-feedback":
        model = Net()
        c = hvd_qsgd.QSGD(2, seed=SEED, error_feedback=True, reduction="scatter_allgather",
                          named_parameters=model.named_parameters())
        mine = local_grads(model, rank)
        optimizer_step(model, c)
        residuals = c.state_dict()["torch"]["residuals"]
        assert set(residuals) == {"fc1.weight", "fc2.weight", "extra.weight"}, set(residuals)
        for name, e in residuals.items():
            g = mine[name].reshape(-1)
            seed = protocol.payload_seed(SEED, rank, f"hvd_qsgd.{c._creation_index}.p.{name}", 0)
            fp = codec.tensor_fingerprint(name, mine[name].shape, "float32")
            buf, lens = reduction.encode_chunks(g.numpy(), c.settings, seed, n, fp)
            own = reduction.decode_chunks(reduction.split_by(buf, lens), 1.0, g.numel(), 128)
            assert torch.equal(e, g - torch.from_numpy(own)), name
    elif s.startswith("mismatch-"):
        try:
            mismatch(s[len("mismatch-"):], n, rank)
        except Exception as e:  # the expected outcome: print it, exit nonzero
            print(f"RAISED {type(e).__name__}: {' '.join(str(e).split())[:400]} (scenario {s})", flush=True)
            return  # exit normally: Horovod must shut down cleanly after the error
        print("NOT RAISED", flush=True)
        sys.exit(1)
    else:
        raise SystemExit(f"unknown scenario {s}")
    print(f"OK {s}", flush=True)


def mismatch(kind, n, rank):
    t = torch.randn(20000)
    if kind == "bits":
        hvd.allreduce(t, compression=hvd_qsgd.QSGD(8 if rank == 1 else 4))
    elif kind == "bucket":
        hvd.allreduce(t, compression=hvd_qsgd.QSGD(4, bucket_size=256 if rank == 1 else 512))
    elif kind == "bits-same-settings-tag":  # different coding, also a settings difference
        hvd.allreduce(t, compression=hvd_qsgd.QSGD(4, coding="elias" if rank == 1 else "fixed"))
    elif kind == "order":
        # code that is not Horovod's optimizer (no parameter names to take from it) hands two tensors
        # over in different orders on the two ranks. (Through Horovod's optimizer the compressor
        # matches them by the optimizer's names: tests/mp/dropin_torch.py, "branches")
        # Its collectives are named by tensor, as Horovod names them.
        c = hvd_qsgd.QSGD(4)
        tensors = {"a": torch.randn(20000), "b": torch.randn(30000)}
        order = ("a", "b") if rank == 0 else ("b", "a")
        ctxs = {k: c.compress(tensors[k]) for k in order}
        handles = {k: hvd.allreduce_async(ctxs[k][0], name=f"order.{k}") for k in order}
        decompress_after_all(c, order, handles, ctxs)
    elif kind == "shapes":
        hvd.allreduce(torch.randn(20000 + 100 * rank), compression=hvd_qsgd.QSGD(4))
    elif kind in ("join-overlap", "join-off"):
        # overlap=True, and join=False, give up hvd.join(): rank 1 joins at once while rank 0 steps
        model = Net()
        given_up = dict(overlap=True) if kind == "join-overlap" else dict(join=False)
        c = hvd_qsgd.QSGD(4, named_parameters=model.named_parameters(), **given_up)
        if rank == 0:
            optimizer_step(model, c)
        hvd.join()
    elif kind == "overlap-setting":
        hvd.allreduce(t, compression=hvd_qsgd.QSGD(4, overlap=rank == 0))
    elif kind == "encoder-setting":   # encoder version 1 on rank 0 only: payloads of one length, the tag differs
        hvd.allreduce(t, compression=hvd_qsgd.QSGD(4, encoder=1 if rank == 0 else 2))
    elif kind == "buffered-order":
        # fusion buffers place tensors in the order they come: two named tensors in different orders
        # on the two ranks sit at different offsets, which their control vectors tell apart (without
        # fusion buffers the order of named tensors does not matter)
        params = {k: nn.Parameter(torch.randn(size)) for k, size in (("a", 20000), ("b", 30000))}
        for p in params.values():
            p.grad = torch.randn(p.shape)
        c = hvd_qsgd.QSGD(4, fusion_mb=1, named_parameters=list(params.items()))
        order = ("a", "b") if rank == 0 else ("b", "a")
        ctxs = {k: c.compress(params[k].grad) for k in order}
        handles = {k: hvd.allreduce_async(ctxs[k][0], name=f"buffered.{k}") for k in order}
        decompress_after_all(c, order, handles, ctxs)
    elif kind in ("fused-shapes", "fusion-setting"):
        # two tensors in one fused exchange, the first of another shape on rank 1; or fusion on rank 0 only
        c = hvd_qsgd.QSGD(4, fusion=kind == "fused-shapes" or rank == 0)
        tensors = [torch.randn(20000 + (100 * rank if kind == "fused-shapes" else 0)), torch.randn(30000)]
        ctxs = [c.compress(x) for x in tensors]
        handles = [hvd.allreduce_async(ctx[0], name=f"{kind}.{i}") for i, ctx in enumerate(ctxs)]
        for h, ctx in zip(handles, ctxs):
            c.decompress(hvd.synchronize(h), ctx[1])
    elif kind == "no-compression":
        optimizer_step(Net(), hvd_qsgd.QSGD(4) if rank == 0 else hvd.Compression.none)
    elif kind == "creation-order":
        a, b = hvd_qsgd.QSGD(4), hvd_qsgd.QSGD(4)
        hvd.allreduce(t, compression=a if rank == 0 else b)
    elif kind == "process-set":
        # code that is not Horovod's (nothing to learn the set from) reduces the compressor's result
        # over ranks {0, 1}; the compressor was left on all ranks. (Horovod's own allreduce and
        # optimizer tell it their set: tests/mp/dropin_torch.py)
        ps = hvd.ProcessSet([0, 1])
        hvd.add_process_set(ps)  # needs HOROVOD_DYNAMIC_PROCESS_SETS=1
        try:
            if ps.included():
                c = hvd_qsgd.QSGD(4)
                control, ctx = c.compress(t)
                c.decompress(hvd.allreduce(control, process_set=ps, name="t"), ctx)
            else:
                raise RuntimeError("outside the process set")
        finally:  # ranks 2 and 3 wait until 0 and 1 have seen the error
            hvd.allreduce(torch.zeros(1), name="done")
    elif kind == "reduction":
        hvd.allreduce(t, compression=hvd_qsgd.QSGD(4, reduction="scatter_allgather" if rank == 1 else "allgather"))
    elif kind == "op-min":
        hvd.allreduce(t, compression=hvd_qsgd.QSGD(4), op=hvd.Min)
    elif kind == "reducescatter":
        hvd.reducescatter(t, compression=hvd_qsgd.QSGD(4))
    else:
        raise SystemExit(f"unknown mismatch {kind}")


def decompress_after_all(c, order, handles, ctxs):
    """Every handle synchronized before the first decompress, then decompressed in this rank's order.
    The ranks' first handles differ here: had rank 0 decompressed (raised, and exited) as soon as its
    own first handle was done, rank 1's first one could still be in Horovod's negotiation, and
    Horovod's shutdown would fail it before its control check ran (seen once in CI: rank 1 got
    "Horovod has been shut down" instead of the MismatchError)."""
    outputs = {k: hvd.synchronize(handles[k]) for k in order}
    for k in order:
        c.decompress(outputs[k], ctxs[k][1])


def check_join(red, n, rank):
    """Uneven data: rank r takes 3 - r steps (rank 0 the most), then calls hvd.join(). The ranks
    still stepping get what Horovod's allreduce gives with joined ranks: the joined add zeros and
    Average still divides by n. With at most two ranks stepping, the float32 sum of their
    dequantized payloads is exact in any order, so the reference is computed here, after the join,
    from every rank's own payloads (re-encoded with the documented seeds), and must match bitwise.
    hvd.Compression.none, on a copy of the model, shows Horovod's own semantics are the same."""
    steps = 3 - rank
    model, plain = Net(), Net()
    plain.load_state_dict(model.state_dict())
    fusion = red.endswith("-fused")   # "<reduction>-fused": with fusion=True
    red = red[:-len("-fused")] if fusion else red
    c = hvd_qsgd.QSGD(4, seed=SEED, reduction=red, fusion=fusion, named_parameters=model.named_parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=c)
    opt_plain = hvd.DistributedOptimizer(torch.optim.SGD(plain.parameters(), lr=0.1),
                                         named_parameters=[("plain." + k, v) for k, v in plain.named_parameters()])
    big = [k for k, p in model.named_parameters() if p.numel() >= 10000]
    own = {k: torch.zeros(3, p.numel()) for k, p in model.named_parameters()}   # [step] this rank's contribution
    raw = {k: torch.zeros(3, p.numel()) for k, p in model.named_parameters()}
    got = {k: torch.zeros(3, p.numel()) for k, p in model.named_parameters()}
    got_plain = {k: torch.zeros(3, p.numel()) for k, p in model.named_parameters()}
    for step in range(steps):
        x, y = batch(rank, step)
        mine = {k: v.reshape(-1) for k, v in local_grads_at(model, x, y).items()}
        for k, g in local_grads_at(plain, x, y).items():
            raw[k][step] = g.reshape(-1)
        for k, g in mine.items():
            if k not in big:
                own[k][step] = g
                continue
            seed = protocol.payload_seed(SEED, rank, f"hvd_qsgd.{c._creation_index}.p.{k}", step)
            fp = codec.tensor_fingerprint(k, dict(model.named_parameters())[k].shape, "float32")
            if red == "hierarchical":  # while ranks have joined: the float32 tensor itself
                own[k][step] = g.clone()
            elif c.settings.exchange_reduction(n, g.numel()) == "scatter_allgather":
                buf, lens = reduction.encode_chunks(g.numpy(), c.settings, seed, n, fp)
                own[k][step] = torch.from_numpy(reduction.decode_chunks(reduction.split_by(buf, lens), 1.0, g.numel(), 512))
            else:
                own[k][step] = torch.from_numpy(codec.decode(codec.encode(g.numpy(), 4, 512, "max", seed, "fixed", fp)))
        for m, o, result in ((model, opt, got), (plain, opt_plain, got_plain)):
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.synchronize()
            for k, p in m.named_parameters():
                result[k][step] = p.grad.reshape(-1)
            with o.skip_synchronize():
                o.step()
    last = hvd.join()
    # everyone has joined: collectives work again; every rank's contributions, in rank order
    last_all = gather(torch.tensor(float(last)))
    assert all(v.item() == 0 for v in last_all), f"hvd.join() returned {[v.item() for v in last_all]}"
    for k in own:
        contributions, raws = gather(own[k]), gather(raw[k])
        for step in range(steps):
            stepping = [r for r in range(n) if step < 3 - r]
            if len(stepping) == n:
                continue  # nobody joined yet: the usual exchange, checked by the other scenarios
            ref = sum(contributions[r][step] for r in stepping) * (1.0 / n)
            assert torch.equal(got[k][step], ref), f"{k} step {step}: max diff {(got[k][step] - ref).abs().max()}"
            plain_ref = sum(raws[r][step] for r in stepping) * (1.0 / n)
            # Horovod scales by 1/n itself (not bit for bit as torch does): equal to rounding
            assert torch.allclose(got_plain[k][step], plain_ref, rtol=1e-6, atol=0), f"Compression.none {k} step {step}"
            assert not torch.allclose(plain_ref, plain_ref * n / len(stepping)) or not plain_ref.any()
    joined_steps = sum(1 for step in range(steps) if any(step >= 3 - r for r in range(n)))
    assert c.stats["joined_exchanges"] == joined_steps * len(big), (c.stats, joined_steps)


def check_fusion(n, rank):
    """fusion=True gives fusion=False's gradients bit for bit, with the same payload bytes counted, on
    every rank alike: through the optimizer (the fixed and Elias codings, error feedback, 8 bits,
    float16, "auto" with a tensor it sends by scatter_allgather at 3 ranks, which is not fused) and
    through hvd.allreduce with op=Sum; each optimizer step's allgather tensors travel in one fused
    exchange."""
    from hvd_qsgd.adapters.torch import TorchCompressor

    def big_net():
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(64, 1000), nn.ReLU(), nn.Linear(1000, 1000), nn.ReLU(), nn.Linear(1000, 10))

    configs = [(dict(reduction="allgather"), Net), (dict(reduction="allgather", coding="elias"), Net),
               (dict(reduction="allgather", error_feedback=True), Net), (dict(bits=8), Net),
               (dict(reduction="allgather"), lambda: Net(torch.float16)), (dict(error_feedback=True), big_net)]
    for i, (settings, make) in enumerate(configs):
        model = make()
        grads, stats, closed = {}, {}, {}
        for fusion in (False, True):
            m = copy.deepcopy(model)
            c = TorchCompressor(seed=SEED, fusion=fusion, creation_index=1000 + i, **settings)
            # lr 0: the parameters stay as they are, while the residuals and the batches change step to step
            # (the uncompressed biases' sums are Horovod's, in an order its fusion buffer decides)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), named_parameters=m.named_parameters(),
                                           compression=c)
            got = []
            for step in range(3):
                x, y = batch(rank, step, next(m.parameters()).dtype)
                opt.zero_grad()
                nn.functional.cross_entropy(m(x).float(), y).backward()
                opt.step()
                got.append([p.grad.clone() for p in m.parameters()])
            grads[fusion], stats[fusion], closed[fusion] = got, c.stats, c.runner.fusion.closed
        for step, (a, b) in enumerate(zip(grads[False], grads[True])):
            for k, (ga, gb) in enumerate(zip(a, b)):
                if ga.numel() >= 10000:
                    assert torch.equal(ga, gb), f"config {i} step {step} parameter {k}: fused differs"
                else:  # Horovod's own allreduce: its fusion buffer holds other tensors, its sums another order
                    scale = float(ga.abs().max())   # (float16 sums round at 2^-11 of their size)
                    assert torch.allclose(ga, gb, rtol=0, atol=4e-3 * scale), f"config {i} step {step} parameter {k}"
                check_identical(gb, f"config {i} step {step} parameter {k}")
        for key in ("elements", "tensors", "bytes_sent", "bytes_received", "raw_elements"):
            assert stats[False][key] == stats[True][key], (i, key, stats)
        fusible = [p.numel() for p in model.parameters() if p.numel() >= 10000
                   and Settings.make(**settings).exchange_reduction(n, p.numel()) == "allgather"]
        assert fusible and closed[True] == 3 and closed[False] == 0, (i, closed, fusible)
        assert any(Settings.make(**settings).exchange_reduction(n, p.numel()) != "allgather"
                   for p in model.parameters() if p.numel() >= 10000) == (i == len(configs) - 1 and n > 2)
    t = torch.randn(30000, generator=torch.Generator().manual_seed(rank))
    out = {f: hvd.allreduce(t, op=hvd.Sum, name="fused.direct",
                            compression=TorchCompressor(seed=SEED, fusion=f, creation_index=1100)) for f in (False, True)}
    assert torch.equal(out[False], out[True])


def check_overlap(rank):
    """overlap=True: a gradient's payload collective starts in its hook, while backward() is still
    running (seen from a hook on the input, whose gradient backward computes last), and the results
    are overlap=False's bit for bit (allgather, scatter_allgather, auto; error feedback); unnamed
    Horovod collectives between steps, which Horovod names by its per-process handle count, still
    meet their partners (the payload collectives start at the same call on every rank). Neither
    makes a presence allreduce (no rank joins)."""
    from hvd_qsgd.adapters.torch import TorchCompressor
    from torch_buffers import log_collectives
    for red in ("allgather", "scatter_allgather", "auto"):
        grads, started = {}, {}
        for overlap in (False, True):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(64, 300), nn.ReLU(), nn.Linear(300, 300), nn.ReLU(), nn.Linear(300, 100))
            c = TorchCompressor(4, seed=SEED, reduction=red, overlap=overlap, error_feedback=True, creation_index=1200)
            log = log_collectives(c)
            reduced = log_collectives(c, ("allreduce",))
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                           named_parameters=model.named_parameters(), compression=c)
            g = torch.Generator().manual_seed(rank)
            grads[overlap], started[overlap] = [], []
            for step in range(3):
                x = torch.randn(16, 64, generator=g).requires_grad_(True)
                x.register_hook(lambda grad, mark=len(log): started[overlap].append(len(log) - mark))
                opt.zero_grad()
                model(x).pow(2).sum().backward()
                opt.step()
                grads[overlap].append([p.grad.clone() for p in model.parameters() if p.numel() >= 10000])
                hvd.allreduce(torch.ones(1))
                hvd.grouped_allreduce([torch.ones(3), torch.ones(2)])
            # no presence allreduce: overlap makes none, and without it the step's first reduced
            # control vector shows every rank stepping (the optimizer's gradients defer)
            assert reduced == [], (red, overlap, reduced)
        # the two later layers' gradients (computed first) are in flight before backward() ends
        assert started[False] == [0, 0, 0] and all(k >= 2 for k in started[True]), (red, started)
        for a, b in zip(grads[False], grads[True]):
            for ga, gb in zip(a, b):
                assert torch.equal(ga, gb), red
                check_identical(gb, red)


def check_report(n):
    """Time in stats grows with work, summary() agrees with the counters, and the two warnings fire
    once where they should and nowhere else."""
    from hvd_qsgd import report
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    logging.getLogger("hvd_qsgd").addHandler(Keep())
    report.MIN_EXCHANGES = 6
    idle = hvd_qsgd.QSGD(4, seed=SEED)  # created, never passed to the optimizer
    model = Net()
    used = hvd_qsgd.QSGD(4, seed=SEED, named_parameters=model.named_parameters(), link_gbps=1e6)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=used)
    big = [p.numel() for p in model.parameters() if p.numel() >= 10000]
    before = used.stats
    for step in range(3):
        x, y = batch(hvd.rank(), step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        now = used.stats
        for k in ("encode_s", "decode_s", "wait_s"):
            assert now[k] >= before[k] >= 0.0, (k, before, now)
        assert now["encode_s"] > before["encode_s"] and now["decode_s"] > before["decode_s"], (before, now)
        before = now
    fp32 = 3 * sum(int(cost_model.received_bytes("allreduce", n, 4 * d)) for d in big)
    assert now["allreduce_bytes"] == fp32, (now, fp32)
    s = used.summary((1.0,))
    assert s["bytes_saved"] == now["allreduce_bytes"] - now["bytes_received"] > 0
    assert math.isclose(s["projected_change_s"][1.0], s["codec_s"] - s["bytes_saved"] / 1.25e8, rel_tol=1e-9)
    never = [m for m in records if "has not been called" in m]
    assert len(never) == 1 and "hvd_qsgd.QSGD(bits=4" in never[0] and "link_gbps" not in never[0], records
    slow = [m for m in records if "slows the job down" in m]
    assert len(slow) == 1 and "at 1e+06 Gbit/s" in slow[0], records
    # on a slow link the same work pays: no slowdown warning; a compressor in use: no no-op warning
    records.clear()
    plain = Net()
    thrifty = hvd_qsgd.QSGD(4, seed=SEED, named_parameters=plain.named_parameters(), link_gbps=0.001)
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD(plain.parameters(), lr=0.1),
                                    named_parameters=plain.named_parameters(), compression=thrifty)
    for step in range(4):
        x, y = batch(hvd.rank(), step)
        opt2.zero_grad()
        nn.functional.cross_entropy(plain(x), y).backward()
        opt2.step()
    assert thrifty.stats["tensors"] == 4 * len(big) and not records, records
    del idle


def local_grads_at(model, x, y):
    m = copy.deepcopy(model)
    m.zero_grad()
    nn.functional.cross_entropy(m(x), y).backward()
    return {k: p.grad.detach().clone() for k, p in m.named_parameters()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("scenario", nargs="+")
    args = p.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    for s in args.scenario:
        scenario(s)


if __name__ == "__main__":
    main()
