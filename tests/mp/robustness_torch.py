"""Worker for tests/test_robustness_mp.py: bad inputs through Horovod's PyTorch API, under horovodrun.

Every rank runs every case in order and prints ``OK <case>`` when its checks pass (an exception ends
the job). References are computed independently on every rank: every rank's input is regenerated
or gathered, re-encoded with the documented seeds (``protocol.payload_seed``) and decoded with
``codec.decode_sum`` (allgather) or ``reduction.simulate`` (scatter_allgather). Results with NaN
compare NaN-equal; the documented non-finite rule is checked by ``check_nonfinite``
(tests/test_robustness.py).
"""
import argparse
import os
import itertools
import threading

import numpy as np
import torch
import torch.nn as nn
import horovod.torch as hvd
from horovod.common.exceptions import HorovodInternalError

import hvd_qsgd
from hvd_qsgd import codec, protocol, reduction
from tests.mp.nonfinite import bad_input
from tests.references import check_nonfinite, cleaned

SEED = 13
REDUCTIONS = ("allgather", "scatter_allgather")
_names = itertools.count()


def dname(dtype):
    return str(dtype).replace("torch.", "")


def gather(t):
    """Every rank's copy of t in rank order (float16/bfloat16 travel as float32, which holds them)."""
    out = hvd.allgather(t.detach().float().unsqueeze(0), name=f"rb.gather.{next(_names)}")
    return [x.to(t.dtype) for x in out.unbind(0)]


def as_np(t):
    return t.detach().float().numpy()


def same(a, b):
    """Bit for bit, NaN equal to NaN (float16/bfloat16 compared through float32, exactly)."""
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(as_np(a), as_np(b), equal_nan=True)


def check_identical(t, what):
    copies = gather(t)
    for r, c in enumerate(copies):
        assert same(c, copies[0]), f"{what}: rank {r} differs from rank 0"


def reference(c, xs, exchange, shape, dtype, alpha, occurrence=0, fp_name=""):
    """What every rank must get for these per-rank inputs (float32 NumPy arrays), as a tensor."""
    s = c.settings
    fp = codec.tensor_fingerprint(fp_name, shape, dname(dtype))
    seeds = [protocol.payload_seed(SEED, r, exchange, occurrence) for r in range(len(xs))]
    xs = [np.ascontiguousarray(x, np.float32).reshape(-1) for x in xs]
    if s.reduction == "scatter_allgather":
        out = reduction.simulate(xs, s, seeds, alpha, fp, dname(dtype))[0]
    else:
        out = codec.decode_sum([codec.encode(x, s.bits, s.bucket_size, s.norm, seeds[r], s.coding, fp, s.checksum,
                                             source_dtype=dname(dtype)) for r, x in enumerate(xs)], alpha)
    return torch.from_numpy(out).view(shape).to(dtype)


def check_exchange(c, xs, out, exchange, dtype, alpha, what, occurrence=0, fp_name=""):
    """out equals the reference of xs, bit for bit; with non-finite inputs, the non-finite rule."""
    shape = out.shape
    want = reference(c, xs, exchange, shape, dtype, alpha, occurrence, fp_name)
    assert same(out, want), f"{what}: differs from the reference"
    xs32 = [np.asarray(x, np.float32).reshape(-1) for x in xs]
    if not all(np.isfinite(x).all() for x in xs32):
        clean = reference(c, [cleaned(x) for x in xs32], exchange, shape, dtype, alpha, occurrence, fp_name)
        check_nonfinite(as_np(out).reshape(-1), xs32, c.settings.bucket_size, c.settings.bits,
                        as_np(clean).reshape(-1))
    check_identical(out, what)


def case_nonfinite_allreduce(n, rank):
    for red, bits in itertools.product(REDUCTIONS, (4, 1)):
        c = hvd_qsgd.QSGD(bits, seed=SEED, reduction=red)
        k, bucket = c._creation_index, c.settings.bucket_size
        seq = 0
        for dtype, np_dtype in ((torch.float32, np.float32), (torch.float16, np.float16)):
            for op, alpha in ((hvd.Average, 1.0 / n), (hvd.Sum, 1.0)):
                xs = [bad_input(r, 100 * bucket, bucket, np_dtype) for r in range(n)]
                out = hvd.allreduce(torch.from_numpy(xs[rank]), compression=c, op=op, name=f"nf.{k}.{seq}")
                assert out.dtype == dtype
                check_exchange(c, xs, out, f"hvd_qsgd.{k}.s{seq}", dtype, alpha, f"{red} bits={bits} {dtype} {op}")
                assert not torch.isfinite(out.view(-1)[:bucket]).any()
                assert torch.isfinite(out.view(-1)[bucket:3 * bucket]).all()
                seq += 1


def case_nonfinite_optimizer(n, rank):
    """A parameter whose gradient holds NaN/Inf, through hvd.DistributedOptimizer (named)."""
    for red in REDUCTIONS:
        w = nn.Parameter(torch.zeros(40, 512))
        c = hvd_qsgd.QSGD(4, seed=SEED, reduction=red, named_parameters=[("w", w)])
        opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=0.1), named_parameters=[("w", w)], compression=c)
        xs = [bad_input(r, w.numel(), 512).reshape(w.shape) for r in range(n)]
        opt.zero_grad()
        (w * torch.from_numpy(xs[rank])).sum().backward()   # the gradient is this rank's xs
        opt.synchronize()
        check_exchange(c, xs, w.grad, f"hvd_qsgd.{c._creation_index}.p.w", torch.float32, 1.0 / n, f"optimizer {red}",
                       fp_name="w")


def own_decode(c, x, exchange, fp):
    """This rank's own decode of its payload(s) for x (what error feedback subtracts)."""
    s = c.settings
    seed = protocol.payload_seed(SEED, hvd.rank(), exchange, 0)
    if s.reduction == "scatter_allgather":
        buf, lens = reduction.encode_chunks(x, s, seed, hvd.size(), fp)
        return reduction.decode_chunks(reduction.split_by(buf, lens), 1.0, x.size, s.bucket_size)
    return codec.decode(codec.encode(x, s.bits, s.bucket_size, s.norm, seed, s.coding, fp))


def case_nonfinite_error_feedback(n, rank):
    """Step 1 holds NaN/Inf: its output has them; the residual stays finite (0 where this rank's
    bucket was non-finite, its usual value elsewhere). Step 2 is finite: its output is finite and
    equals the reference of every rank's g2 + residual."""
    for red in REDUCTIONS:
        c = hvd_qsgd.QSGD(4, seed=SEED, reduction=red, error_feedback=True)
        k = c._creation_index
        fp = codec.tensor_fingerprint("", (30 * 512,), "float32")
        xs = [bad_input(r, 30 * 512, 512) for r in range(n)]
        out = hvd.allreduce(torch.from_numpy(xs[rank]), compression=c, name=f"ef.{k}")
        check_exchange(c, xs, out, f"hvd_qsgd.{k}.s0", torch.float32, 1.0 / n, f"error feedback step 1 {red}")
        e1 = c.state_dict()["torch"]["residuals"][f"ef.{k}"]   # (kept by the call's name)
        new = xs[rank] - own_decode(c, xs[rank], f"hvd_qsgd.{k}.s0", fp)
        assert np.array_equal(e1.numpy(), np.where(np.isfinite(new), new, 0)), red
        assert torch.isfinite(e1).all() and not np.isfinite(new).all()
        g2 = torch.randn(30 * 512, generator=torch.Generator().manual_seed(rank))
        out = hvd.allreduce(g2, compression=c, name=f"ef.{k}")
        assert torch.isfinite(out).all(), red
        check_exchange(c, [as_np(x) for x in gather(g2 + e1)], out, f"hvd_qsgd.{k}.s1", torch.float32, 1.0 / n,
                       f"error feedback step 2 {red}")
        assert torch.isfinite(c.state_dict()["torch"]["residuals"][f"ef.{k}"]).all()


def case_zeros(n, rank):
    for red, bits in itertools.product(REDUCTIONS, (1, 4)):
        c = hvd_qsgd.QSGD(bits, seed=SEED, reduction=red)
        t = torch.zeros(100, 200)
        out = hvd.allreduce(t, compression=c, name=f"zeros.{c._creation_index}")
        assert torch.equal(out, t) and not torch.signbit(out).any() and c.stats["tensors"] == 1, red


def case_empty(n, rank):
    for red in REDUCTIONS:
        c = hvd_qsgd.QSGD(4, seed=SEED, reduction=red, min_numel=1)
        for i, t in enumerate((torch.zeros(0), torch.zeros(0, 5), torch.zeros(3, 0, dtype=torch.float16))):
            out = hvd.allreduce(t, compression=c, name=f"empty.{c._creation_index}.{i}")
            assert out.shape == t.shape and out.dtype == t.dtype
        assert c.stats["tensors"] == 0 and c.stats["raw_tensors"] == 3, c.stats


def case_scalar(n, rank):
    """A 0-d tensor is one element: compressed with min_numel=1 (shape () kept), else uncompressed."""
    t = torch.tensor(0.5 + rank, dtype=torch.float32)
    for red in REDUCTIONS:
        c = hvd_qsgd.QSGD(4, seed=SEED, reduction=red, min_numel=1)
        out = hvd.allreduce(t, compression=c, name=f"scalar.{c._creation_index}")
        assert out.shape == () and c.stats["tensors"] == 1
        check_exchange(c, [as_np(x) for x in gather(t)], out, f"hvd_qsgd.{c._creation_index}.s0", torch.float32,
                       1.0 / n, f"scalar {red}")
    c = hvd_qsgd.QSGD(4, seed=SEED)
    out = hvd.allreduce(t, compression=c, name="scalar.raw")
    assert torch.equal(out, hvd.allreduce(t, name="scalar.plain")) and c.stats["raw_tensors"] == 1


def case_noncontiguous(n, rank):
    """Transposed, strided and permuted views: the result of their contiguous copy, in their shape."""
    g = torch.Generator().manual_seed(rank)
    base, cube = torch.randn(300, 200, generator=g), torch.randn(20, 30, 40, generator=g)
    views = {"transposed": lambda: base.t(), "strided": lambda: base.view(-1)[::3],
             "column-slice": lambda: base[:, ::2].t(), "permuted": lambda: cube.permute(2, 0, 1)}
    before = base.clone(), cube.clone()
    for red in REDUCTIONS:
        c = hvd_qsgd.QSGD(4, seed=SEED, reduction=red)
        for seq, (what, view) in enumerate(views.items()):
            t = view()
            assert not t.is_contiguous() and t.numel() >= 10000
            out = hvd.allreduce(t, compression=c, name=f"nc.{c._creation_index}.{seq}")
            assert out.shape == t.shape
            check_exchange(c, [as_np(x) for x in gather(t.contiguous())], out,
                           f"hvd_qsgd.{c._creation_index}.s{seq}", torch.float32, 1.0 / n, f"{what} {red}")
    assert torch.equal(base, before[0]) and torch.equal(cube, before[1])


def case_integers(n, rank):
    """int32/int64 go through Horovod's own allreduce, exactly as without compression; the dtypes
    Horovod's allreduce refuses (bool, uint8, int8, complex) raise Horovod's own error, as without
    compression."""
    c = hvd_qsgd.QSGD(4, seed=SEED, min_numel=1)
    for i, dtype in enumerate((torch.int32, torch.int64)):
        t = (torch.arange(20000) * (rank + 1)).to(dtype)
        for op in (hvd.Sum, hvd.Average):
            out = hvd.allreduce(t, compression=c, op=op, name=f"int.{i}.{op}")
            assert out.dtype == dtype and torch.equal(out, hvd.allreduce(t, op=op, name=f"int.plain.{i}.{op}"))
        assert torch.equal(hvd.allreduce(t, compression=c, op=hvd.Sum, name=f"int.sum.{i}"),
                           (torch.arange(20000) * (n * (n + 1) // 2)).to(dtype))
    assert c.stats["tensors"] == 0 and c.stats["raw_tensors"] == 6, c.stats
    for dtype in (torch.bool, torch.uint8, torch.int8, torch.complex64):
        t = torch.ones(20000, dtype=dtype)
        errors = []
        for comp in (c, hvd.Compression.none):
            try:
                hvd.allreduce(t, compression=comp, op=hvd.Sum, name=f"refused.{dtype}")
                errors.append(None)
            except Exception as e:
                errors.append((type(e), str(e)))
        assert errors[0] is not None and errors[0] == errors[1], (dtype, errors)
        assert "is not supported" in errors[0][1], errors


def case_unnamed_mismatch(n, rank):
    """An unnamed hvd.allreduce that rank 0 does not compress and the others do (another dtype,
    another compressor, a min_numel above the tensor; the others with overlap, fusion or the
    hierarchical reduction too): Horovod's own mismatch error on every rank, as without compression,
    and the job goes on, with the same compressors: the next unnamed calls (single and grouped) give
    the exact average of constants on every rank. (The compressing ranks start nothing in compress:
    Horovod names an unnamed collective by its handle count, and a collective started there on some
    ranks only left the control vectors' allreduces under different names, waiting forever; the
    exchange the error left is forgotten at the next call, where it held a slot the other ranks did
    not: "ranks disagree on the exchange key" at every later call.)"""
    os.environ["HVD_QSGD_RANKS_PER_NODE"] = "1"   # (two nodes of one rank: read at a compressor's first use)
    cases = [(torch.int32 if rank == 0 else torch.float32, {}, None),
             (torch.float32, {"fusion": True}, hvd.Compression.none),
             (torch.float32, {"overlap": True}, hvd_qsgd.QSGD(4, min_numel=10 ** 6)),
             (torch.int32 if rank == 0 else torch.float32, {"reduction": "hierarchical"}, None)]
    try:
        for i, (dtype, settings, rank0) in enumerate(cases):
            comp = hvd_qsgd.QSGD(4, **settings)
            try:
                hvd.allreduce(torch.ones(20000, dtype=dtype), compression=rank0 if rank == 0 and rank0 else comp)
            except HorovodInternalError as e:
                assert "Mismatched" in str(e), (i, str(e))
            else:
                raise AssertionError(f"case {i}: no error")
            assert torch.equal(hvd.allreduce(torch.ones(3), name=f"after.{i}"), torch.ones(3))
            for step in range(2):   # (a constant quantizes exactly)
                out = hvd.allreduce(torch.full((20000,), float(rank + 1)), compression=comp)
                assert torch.all(out == (n + 1) / 2), (i, step, out[:4])
                outs = hvd.grouped_allreduce([torch.ones(20000), torch.full((30000,), 2.0)], compression=comp)
                assert torch.all(outs[0] == 1) and torch.all(outs[1] == 2), (i, step)
            assert comp.stats["tensors"] == 6, (i, comp.stats)
    finally:
        del os.environ["HVD_QSGD_RANKS_PER_NODE"]
    # the same compressor as an optimizer's, its gradients' exchanges in flight (after backward, before
    # step) when the unnamed call fails: the step does not start the failed call's exchange on the
    # compressing ranks alone (whose next unnamed collective then hung), and the replicas stay identical
    comp = hvd_qsgd.QSGD(4)
    torch.manual_seed(0)
    model = nn.Linear(1000, 100, bias=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
                                   compression=comp)
    for step in range(2):
        opt.zero_grad()
        model(torch.randn(16, 1000, generator=torch.Generator().manual_seed(10 * step + rank))).pow(2).mean().backward()
        try:
            hvd.allreduce(torch.ones(20000, dtype=torch.int32 if rank == 0 else torch.float32), compression=comp)
        except HorovodInternalError as e:
            assert "Mismatched" in str(e), str(e)
        else:
            raise AssertionError("in flight: no error")
        opt.step()
        weights = hvd.allgather(model.weight.detach().reshape(1, -1))
        assert all(torch.equal(weights[0], w) for w in weights), step
        out = hvd.allreduce(torch.full((20000,), float(rank + 1)), compression=comp)
        assert torch.all(out == (n + 1) / 2), (step, out[:4])


def case_sparse(n, rank):
    """Sparse gradients: Horovod's sparse path (the compressor is not called), or with
    sparse_as_dense=True the dense gradient, compressed like any other; hvd.allreduce of a sparse
    tensor raises Horovod's own error, as without compression."""
    idx = torch.arange(10) + 10 * rank
    dense = torch.zeros(1000, 20)
    dense[idx] = 1.0
    emb = nn.Embedding(1000, 20, sparse=True)
    c = hvd_qsgd.QSGD(4, seed=SEED)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), named_parameters=emb.named_parameters(),
                                   compression=c)
    emb(idx).sum().backward()
    opt.synchronize()
    assert emb.weight.grad.is_sparse
    assert torch.equal(emb.weight.grad.to_dense(), torch.stack(gather(dense)).sum(0) / n)
    assert c.stats["tensors"] == 0 and c.stats["raw_tensors"] == 0, c.stats
    for red in REDUCTIONS:
        emb = nn.Embedding(1000, 20, sparse=True)
        c = hvd_qsgd.QSGD(4, seed=SEED, reduction=red)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                       named_parameters=emb.named_parameters(), compression=c, sparse_as_dense=True)
        emb(idx).sum().backward()
        opt.synchronize()
        check_exchange(c, [as_np(x) for x in gather(dense)], emb.weight.grad.to_dense(),
                       f"hvd_qsgd.{c._creation_index}.s0", torch.float32, 1.0 / n, f"sparse_as_dense {red}")
    errors = []
    for comp in (c, hvd.Compression.none):
        try:
            hvd.allreduce(dense.to_sparse(), compression=comp, name="sparse.direct")
            errors.append(None)
        except Exception as e:
            errors.append((type(e), str(e)))
    assert errors[0] is not None and errors[0] == errors[1] and "not supported" in errors[0][1], errors


def case_low_precision(n, rank):
    for red in REDUCTIONS:
        c = hvd_qsgd.QSGD(4, seed=SEED, reduction=red)
        for seq, dtype in enumerate((torch.float16, torch.bfloat16)):
            t = torch.randn(150, 100, generator=torch.Generator().manual_seed(rank)).to(dtype)
            out = hvd.allreduce(t, compression=c, name=f"lp.{c._creation_index}.{seq}")
            assert out.dtype == dtype and out.shape == t.shape
            check_exchange(c, [as_np(x) for x in gather(t)], out, f"hvd_qsgd.{c._creation_index}.s{seq}", dtype,
                           1.0 / n, f"{dtype} {red}")


def case_meta_device(n, rank):
    """A tensor on a device hvd_qsgd cannot read (meta: without CUDA, the only other device here):
    every rank raises, naming the tensor and the device; the compressor works afterwards."""
    c = hvd_qsgd.QSGD(4, seed=SEED)
    for who in ("all", "rank 0"):
        on_meta = who == "all" or rank == 0
        t = torch.empty(20000, device="meta") if on_meta else torch.ones(20000)
        try:
            hvd.allreduce(t, compression=c, name=f"meta.{who}")
        except hvd_qsgd.MismatchError as e:
            msg = str(e)
        else:
            raise AssertionError("a meta tensor was not refused")
        assert "compressed tensor s" in msg and "(shape (20000,))" in msg, msg
        if on_meta:
            assert "is on device 'meta'" in msg and "CPU or a CUDA device" in msg, msg
        else:
            assert "1 rank(s) could not encode this tensor" in msg, msg
    out = hvd.allreduce(torch.ones(20000), compression=c, name="meta.after")
    assert torch.equal(out, torch.ones(20000))


def case_unnamed_state(n, rank):
    """hvd.allreduce / hvd.grouped_allreduce calls with a compressor keeping state per tensor (error
    feedback): each tensor's residual is kept by the name the call gives it (name=; name=[i] in a
    group), so tensors of one size in separate calls keep their own (they shared the first
    position's: a tensor 10^4 times larger fed its residual into the other's result, silently).
    Without a name such a call is refused on every rank, naming what to pass, and the compressor
    works on after it."""
    c = hvd_qsgd.QSGD(4, seed=SEED, error_feedback=True)
    g = torch.Generator().manual_seed(rank)
    for step in range(2):
        big, small = torch.randn(20000, generator=g) * 100, torch.randn(20000, generator=g) * 0.01
        hvd.allreduce(big, compression=c, name="state.big")
        hvd.allreduce(small, compression=c, name="state.small")
        hvd.grouped_allreduce([big, small], compression=c, name="state.group")
    residuals = c.state_dict()["torch"]["residuals"]
    assert set(residuals) == {"state.big", "state.small", "state.group[0]", "state.group[1]"}, sorted(residuals)
    # a residual is at most a bucket's quantization step of its own tensor (|g + e| / s per element):
    # the small tensors' stay on their scale, four orders of magnitude below the big ones'
    for a, b in (("state.small", "state.big"), ("state.group[1]", "state.group[0]")):
        assert residuals[a].abs().max() < 1e-2 * residuals[b].abs().max(), (a, b)
    for call in (lambda: hvd.allreduce(torch.ones(20000), compression=c),
                 lambda: hvd.grouped_allreduce([torch.ones(20000)], compression=c, name=None)):
        try:
            call()
        except protocol.MismatchError as e:
            assert "gives the tensor no name to keep it by: pass name=" in str(e), str(e)
        else:
            raise AssertionError("an unnamed call with error feedback was taken")
    out = hvd.allreduce(torch.full((20000,), float(rank + 1)), compression=c, name="state.after")
    assert torch.all(out == (n + 1) / 2), out[:4]   # (a constant quantizes exactly, its residual 0)


def within_quantization(out, xs, c, what):
    """out is the average of the per-rank inputs xs to within QSGD's deterministic bound: each rank's
    element moves by less than one level step of its bucket (max norm: bucket max / s), so the
    average by less than the ranks' steps averaged (a relative 1e-5 for float32 rounding).
    scatter_allgather quantizes the average again, in buckets of each rank's chunk: by less than one
    step of the largest magnitude that average can have (the exact one's, plus the bound so far)."""
    s, bucket = codec.levels(c.settings.bits), c.settings.bucket_size
    steps = []
    for x in xs:
        x = np.asarray(x, np.float32).reshape(-1)
        pad = np.pad(np.abs(x), (0, -len(x) % bucket)).reshape(-1, bucket).max(axis=1)
        steps.append(np.repeat(pad, bucket)[:len(x)] / s)
    mean = np.mean([np.asarray(x, np.float32).reshape(-1) for x in xs], axis=0)
    bound = np.mean(steps, axis=0)
    if c.settings.reduction == "scatter_allgather":
        bound = bound + (np.abs(mean).max() + bound.max()) / s
    bound = bound * (1 + 1e-5) + 1e-30
    err = np.abs(as_np(out).reshape(-1) - mean)
    assert (err <= bound).all(), f"{what}: off by {float((err / bound).max()):.3f} of the bound"


def case_direct_decompress(n, rank):
    """decompress given what compress returned, without Horovod's allreduce between (a misuse of the
    Compressor API that Horovod's own lossless compressors let pass): every rank raises, saying so
    (it said the vector was reduced over one rank while all step, as of a join); the compressor
    works on after it."""
    c = hvd_qsgd.QSGD(4, seed=SEED)
    t = torch.randn(20000, generator=torch.Generator().manual_seed(rank))
    try:
        c.decompress(*c.compress(t))
    except protocol.MismatchError as e:
        assert "decompress was given what compress returned, not reduced" in str(e), str(e)
    else:
        raise AssertionError("an unreduced control vector was taken")
    out = hvd.allreduce(torch.full((20000,), float(rank + 1)), compression=c, name="direct.after")
    assert torch.all(out == (n + 1) / 2), out[:4]


THREAD_SETTINGS = ({}, {"fusion": True}, {"fusion_mb": 1}, {"reduction": "scatter_allgather"},
                   {"error_feedback": True})


def case_threads_shared(n, rank):
    """Threads sharing one compressor for hvd.allreduce / hvd.grouped_allreduce calls with name=
    (docs/compressor.md, "Threads"): each call's exchanges go by the name it gives, so the order in
    which threads reach the compressor, which differs between ranks, does not matter. Every call
    completes on every rank (none raised "ranks disagree on the exchange key" or hung before),
    with every setting that fuses or buffers tensors, and its result is identical on every rank and
    within QSGD's bound of the exact average."""
    for kw in THREAD_SETTINGS:
        c = hvd_qsgd.QSGD(4, seed=SEED, min_numel=1000, **kw)
        results, errors = {}, []

        def work(t):
            g = torch.Generator().manual_seed(100 * t + rank)
            try:
                for i in range(6):
                    x = torch.randn(3000 + 700 * t, generator=g) * (rank + 1)
                    if t == 3:   # a grouped call: its tensors named name[0], name[1]
                        y = torch.randn(1200, generator=g)
                        results[(t, i)] = ([x, y], hvd.grouped_allreduce([x, y], name="thr.group", compression=c))
                    else:
                        results[(t, i)] = ([x], [hvd.allreduce(x, name=f"thr.{t}", compression=c)])
            except Exception as e:   # (reported below, on the main thread)
                errors.append(f"thread {t}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert not errors, f"{kw}: {errors[:2]}"
        assert not any(th.is_alive() for th in threads), f"{kw}: a call never returned"
        assert c.stats["tensors"] == 30, (kw, c.stats["tensors"])   # (each call's tensors compressed)
        for key in sorted(results):
            ins, outs = results[key]
            for x, out in zip(ins, outs):
                if not c.settings.error_feedback:
                    within_quantization(out, [as_np(v) for v in gather(x)], c, f"{kw} {key}")
                check_identical(out, f"{kw} {key}")
        if c.settings.error_feedback:
            delivered_with_residuals(c, results)


def delivered_with_residuals(c, results):
    """Error feedback, per call name: what a tensor's calls delivered plus the ranks' last residuals
    (averaged) is the average of what they were handed, to float32 rounding (each rank's encoded
    v_i = x_i + e_(i-1) leaves e_i = v_i - q_i, so q_1 + ... + q_k = x_1 + ... + x_k - e_k): each
    call's residual is kept by its own name, whichever thread reached the compressor first."""
    residuals = c.state_dict()["torch"]["residuals"]
    names = {(t, j): f"thr.group[{j}]" if t == 3 else f"thr.{t}" for t in range(4) for j in range(2 if t == 3 else 1)}
    assert set(residuals) == set(names.values()), sorted(residuals)
    for (t, j), name in sorted(names.items()):
        calls = [results[(t, i)] for i in range(6)]
        handed = sum(ins[j] for ins, _ in calls)
        delivered = sum(outs[j] for _, outs in calls)
        want = np.mean([as_np(v) for v in gather(handed)], axis=0)
        left = np.mean([as_np(v) for v in gather(residuals[name].reshape(handed.shape))], axis=0)
        scale = 6 * max(float(ins[j].abs().max()) for ins, _ in calls)
        err = np.abs(as_np(delivered) + left - want).max()
        assert err <= 1e-5 * scale, (name, err, scale)


def case_shape_collision(n, rank):
    """A float64 vector of a control vector's length (uncompressed) on rank 0 where the others hand
    the same call a compressed tensor, and the other way round: Horovod's own mismatch error on
    every rank, as without compression (the two were summed, silently: rank 0 got the others' control
    vectors in its data); a float64 vector on every rank keeps its shape and Horovod's exact result,
    and is not counted as compressed."""
    length = protocol.control_length(n)
    comp = hvd_qsgd.QSGD(4)
    for i, odd in enumerate((0, n - 1)):
        x = torch.full((length,), 2.0, dtype=torch.float64) if rank == odd else torch.ones(20000)
        try:
            hvd.allreduce(x, name=f"collision.{i}", compression=comp)
        except HorovodInternalError as e:
            assert "Mismatched" in str(e), (i, str(e))
        else:
            raise AssertionError(f"rank {odd} alone with a float64 vector: no error")
    v = torch.arange(length, dtype=torch.float64) * (rank + 1)
    out = hvd.allreduce(v, name="collision.alike", compression=comp)
    assert out.shape == v.shape and torch.equal(out, torch.arange(length, dtype=torch.float64) * (n + 1) / 2), out
    # (the compressed tensors of the first two calls only)
    assert comp._compressed == sum(rank != odd for odd in (0, n - 1)), comp._compressed


def case_hierarchical_shapes(n, rank):
    """reduction="hierarchical" on one node (every rank's tensor summed uncompressed, no payload
    crossing a node to carry a header): a tensor of another shape, or another dtype, on the last rank
    raises on every rank, as Horovod's own allreduce and the other reductions do (it was summed as the
    same tensor, silently); the same tensor alike on every rank then gives the exact average."""
    comp = hvd_qsgd.QSGD(4, reduction="hierarchical")
    odd = rank == n - 1
    for i, x in enumerate((torch.ones(2, 10000) if odd else torch.ones(20000),
                           torch.ones(20000, dtype=torch.float16 if odd else torch.float32))):
        try:
            hvd.allreduce(x, name=f"hierarchical.shapes.{i}", compression=comp)
        except hvd_qsgd.MismatchError as e:
            assert "exchange key" in str(e) and "shape and dtype" in str(e), (i, str(e))
        else:
            raise AssertionError(f"case {i}: no error")
    out = hvd.allreduce(torch.full((20000,), float(rank + 1)), name="hierarchical.shapes.alike", compression=comp)
    assert torch.all(out == (n + 1) / 2), out[:4]


CASES = {"nonfinite-allreduce": case_nonfinite_allreduce, "nonfinite-optimizer": case_nonfinite_optimizer,
         "nonfinite-error-feedback": case_nonfinite_error_feedback, "zeros": case_zeros, "empty": case_empty,
         "scalar": case_scalar, "noncontiguous": case_noncontiguous, "integers": case_integers,
         "sparse": case_sparse, "low-precision": case_low_precision, "meta-device": case_meta_device,
         "unnamed-mismatch": case_unnamed_mismatch, "unnamed-state": case_unnamed_state,
         "threads-shared": case_threads_shared, "direct-decompress": case_direct_decompress,
         "shape-collision": case_shape_collision, "hierarchical-shapes": case_hierarchical_shapes}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("case", nargs="*", default=list(CASES))
    args = p.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    for name in args.case:
        torch.manual_seed(0)
        CASES[name](hvd.size(), hvd.rank())
        print(f"OK {name}", flush=True)


if __name__ == "__main__":
    main()
