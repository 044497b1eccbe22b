"""Fusion buffers (``fusion_mb``) under horovodrun, checked against references built from every
rank's gradients with the codec alone: run from tests/mp/torch_compressor.py ("buffers").

The reference of a buffer follows the documented layout (hvd_qsgd.exchange.buffers): its members in
the order they reached the compressor, each at the next multiple of bucket_size, zeros between;
its fingerprint that of the members' fingerprints at their offsets; its seed the payload seed of
the buffer's name and occurrence; every member's result its slice of the buffer's decoded sum,
times alpha."""
import copy

import numpy as np
import torch
import torch.nn as nn
import horovod.torch as hvd

from hvd_qsgd import codec, protocol, reduction

SEED = 7


def layers():
    """Gradients of 20,000 / 30,000 / 12,000 / 45,000 elements (and biases below min_numel)."""
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(40, 500), nn.ReLU(), nn.Linear(500, 60), nn.ReLU(), nn.Linear(60, 200),
                         nn.ReLU(), nn.Linear(200, 225))


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 40, generator=g), torch.randn(8, 225, generator=g)


def gather(t, name):
    return [x for x in hvd.allgather(t.detach().float().reshape(1, -1), name=name).unbind(0)]


def staged(grads, layout, numel):
    """One rank's buffer: its members' gradients at their offsets, zeros between (float32)."""
    out = np.zeros(numel, dtype=np.float32)
    for (label, offset, size) in layout:
        out[offset:offset + size] = grads[label].numpy().reshape(-1)
    return out


def buffer_fingerprint(model, layout, numel, dtype):
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    fps = [codec.tensor_fingerprint(label, shapes[label], dtype) for label, _, _ in layout]
    return codec.tensor_fingerprint("|".join(f"{fp}@{o}" for fp, (_, o, _) in zip(fps, layout)), (numel,), dtype)


def check_layouts(closed, model, cap):
    """Every compressed gradient in one buffer, at a multiple of bucket_size after the member
    before it; no buffer over the cap; the last layer's gradients filled the first, and more than
    one buffer held more than one gradient's worth (52,428 elements a buffer at fusion_mb=0.2)."""
    placed = []
    for _, _, members in closed:
        end = 0
        for label, o, size in members:
            assert o % 512 == 0 and o >= end, members
            end = o + size
            placed.append(label.rsplit(".p.", 1)[1])
        assert end <= cap, (members, cap)
    assert sorted(placed) == sorted(n for n, p in model.named_parameters() if p.numel() >= 10000), closed
    assert len(closed) == 3 and max(len(m) for _, _, m in closed) == 2, closed


def check_buffers(n, rank):
    """Through hvd.DistributedOptimizer, three steps: allgather and scatter_allgather buffers (two
    or three a step at fusion_mb=0.2), error feedback with both, float16; every gradient equals its reference
    bit for bit on every rank, replicas are identical, stats count members (elements without the
    padding) and the payload bytes of the allgather buffers."""
    from hvd_qsgd.adapters.torch import TorchCompressor
    configs = [dict(reduction="allgather"), dict(reduction="scatter_allgather"),
               dict(reduction="allgather", error_feedback=True), dict(reduction="allgather", dtype=torch.float16),
               dict(reduction="allgather", error_feedback=True, overlap=True),
               dict(reduction="scatter_allgather", overlap=True), dict(reduction="scatter_allgather", error_feedback=True)]
    for i, cfg in enumerate(configs):
        cfg = dict(cfg)
        dtype = cfg.pop("dtype", torch.float32)
        dname = str(dtype).replace("torch.", "")
        model = layers().to(dtype)
        c = TorchCompressor(seed=SEED, fusion_mb=0.2, creation_index=2000 + i, **cfg)
        started = log_collectives(c)
        reduced = log_collectives(c, ("allreduce",))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                       named_parameters=model.named_parameters(), compression=c)
        residuals = {}   # (rank, parameter) -> the reference's error-feedback residual
        sent = 0
        for step in range(3):
            x, y = batch(rank, step)
            mine = copy.deepcopy(model)
            nn.functional.mse_loss(mine(x.to(dtype)).float(), y).backward()
            everyone = {name: gather(p.grad, f"buffers.{i}.{step}.{name}") for name, p in mine.named_parameters()}
            before, mark = len(c.runner.buffers.recent), len(started)
            in_flight = []   # payload collectives started when the input's gradient (the last) is computed
            x = x.to(dtype).requires_grad_(True)
            ended = []   # the allreduces started before backward() ends
            x.register_hook(lambda grad: in_flight.append(len(started) - mark) or ended.append(len(reduced)))
            opt.zero_grad()
            nn.functional.mse_loss(model(x).float(), y).backward()
            opt.step()
            # overlap: the two buffers filled by the last layers' gradients (full, so closed at once)
            # are on the wire before backward() ends; without it nothing before the first decompress
            assert in_flight[0] >= 2 if cfg.get("overlap") else in_flight == [0], (i, in_flight)
            # the buffer closed at the first decompress starts its chain at once, as every rank steps
            # alike: no presence allreduce after backward() (without overlap, the full buffers' went
            # during it)
            late = [name for name in reduced[ended[0]:] if name.endswith(".present")]
            assert late == [], (i, step, late)
            assert cfg.get("overlap") or any(name.endswith(".present") for name in reduced[:ended[0]]), (i, reduced)
            closed = list(c.runner.buffers.recent)[before:]
            check_layouts(closed, model, c.settings.fusion_elements())
            # every buffer is encoded from its members where they are (allgather's payload,
            # scatter_allgather's chunks: hvd_qsgd.codec_segments), with error feedback from their
            # residuals where they are too: no staging array
            assert not c.runner.buffers._staging, (i, list(c.runner.buffers._staging))
            expected = {}
            for name, occurrence, members in closed:
                layout = [(label.rsplit(".p.", 1)[1], o, size) for label, o, size in members]
                numel = layout[-1][1] + layout[-1][2]
                fp = buffer_fingerprint(model, layout, numel, dname)
                xs = []
                for r in range(n):
                    v = staged({k: everyone[k][r] for k, _, _ in layout}, layout, numel)
                    if cfg.get("error_feedback"):
                        for k, o, size in layout:
                            v[o:o + size] += residuals.get((r, k), np.zeros(size, np.float32))
                    xs.append(v)
                seeds = [protocol.payload_seed(SEED, r, name, occurrence) for r in range(n)]
                if cfg["reduction"] == "allgather":
                    payloads = [codec.encode(xs[r], 4, 512, "max", seeds[r], "fixed", fp, True, source_dtype=dname)
                                for r in range(n)]
                    total = codec.decode_sum(payloads, 1.0)
                    sent += payloads[rank].size
                    for r in range(n):
                        d = xs[r] - codec.decode(payloads[r])
                        for k, o, size in layout:
                            residuals[(r, k)] = d[o:o + size]
                else:
                    total = reduction.simulate(xs, c.settings, seeds, 1.0, fp, dname)[0]
                    for r in range(n) if cfg.get("error_feedback") else ():   # v - its own phase-1 chunks
                        chunks, lens = reduction.encode_chunks(xs[r], c.settings, seeds[r], n, fp, dname)
                        d = xs[r] - reduction.decode_chunks(reduction.split_by(chunks, lens), 1.0, numel, 512)
                        for k, o, size in layout:
                            residuals[(r, k)] = d[o:o + size]
                for k, o, size in layout:
                    expected[k] = torch.from_numpy(total[o:o + size] * (1.0 / n))
            for name, p in model.named_parameters():
                if p.numel() < 10000:
                    continue
                ref = expected[name].view(p.shape).to(dtype)
                assert torch.equal(p.grad, ref), f"config {i} step {step} {name}: max diff {(p.grad - ref).abs().max()}"
                copies = gather(p.grad, f"buffers.same.{i}.{step}.{name}")
                assert all(torch.equal(cp, copies[0]) for cp in copies), f"config {i} step {step} {name}: replicas differ"
        st = c.stats
        big = [p.numel() for p in model.parameters() if p.numel() >= 10000]
        assert st["tensors"] == 3 * len(big) and st["elements"] == 3 * sum(big), (i, st)
        if cfg["reduction"] == "allgather":
            assert st["bytes_sent"] == sent, (i, st["bytes_sent"], sent)


def log_collectives(c, kinds=("allgather", "alltoall")):
    """The names of the collectives of ``kinds`` (by default the payload collectives: allgather,
    alltoall) compressor ``c`` starts, as it starts them."""
    log = []
    for kind in kinds:
        inner = getattr(c.runner.collectives, kind)
        setattr(c.runner.collectives, kind, lambda *a, _inner=inner, **k: log.append(a[-2]) or _inner(*a, **k))
    return log


def check_buffer_fault(n, rank):
    """A buffer the last rank cannot encode (an injected failure of its encode), closed at the first
    decompress: with overlap=True, and with overlap=False, where the member's control vector shows
    every rank stepping alike and the buffer's chain starts at once as well: that rank sends nothing
    in each of the chain's collectives, every member of the buffer raises on every rank (that rank
    naming its own failure), nobody waits, and the next exchange works."""
    from hvd_qsgd.adapters.torch import TorchCompressor
    for i, (red, overlap) in enumerate([(red, overlap) for overlap in (True, False)
                                        for red in ("allgather", "scatter_allgather")]):
        c = TorchCompressor(seed=SEED, fusion_mb=1, overlap=overlap, reduction=red, creation_index=2200 + i)
        encode = c.runner.encode

        def failing(ex, x, lr=None, _encode=encode):
            if ex.offsets is not None and rank == n - 1:   # a fusion buffer, on the last rank
                raise RuntimeError("injected encode failure")
            return _encode(ex, x, lr)
        c.runner.encode = failing
        grads = {k: torch.randn(size, generator=torch.Generator().manual_seed(rank)) for k, size in
                 (("a", 20000), ("b", 30000))}
        ctxs = {k: c.compress(g) for k, g in grads.items()}
        handles = {k: hvd.allreduce_async(ctxs[k][0], name=f"buffer-fault.{i}.{k}") for k in grads}
        for k in grads:
            try:
                c.decompress(hvd.synchronize(handles[k]), ctxs[k][1])
            except protocol.MismatchError as e:
                msg = str(e)
            else:
                raise AssertionError(f"{red}: member {k} of a buffer rank {n - 1} could not encode did not raise")
            assert "fusion buffer" in msg, msg
            if rank == n - 1:
                assert "could not encode it: injected encode failure" in msg, msg
        c.runner.encode = encode
        t = torch.full((20000,), float(rank + 1))
        out = hvd.allreduce(t, op=hvd.Sum, compression=c, name=f"buffer-fault.{i}.after")
        assert torch.all(out == n * (n + 1) / 2), (red, out[:4])   # (a constant quantizes exactly)


def check_buffer_ops(n, rank):
    """Members of one buffer reduced with different ops (``hvd.allreduce_async`` of Average and Sum):
    the buffer is decoded once with the alpha of the member that decompresses first; a member of
    that member's op gets the bits of alpha times its slice of the sum, one of the other op its slice
    rescaled (within rounding of alpha times its sum, three float32 roundings); every rank alike."""
    from hvd_qsgd.adapters.torch import TorchCompressor
    sizes = {"a": 20000, "b": 30000, "c": 12000}
    ops = {"a": hvd.Average, "b": hvd.Sum, "c": hvd.Average}
    for i, order in enumerate((["a", "b", "c"], ["b", "a", "c"])):   # Average first, Sum first
        c = TorchCompressor(seed=SEED, fusion_mb=1, reduction="allgather", creation_index=2300 + i)
        grads = {r: {k: torch.randn(v, generator=torch.Generator().manual_seed(10 * r + j))
                     for j, (k, v) in enumerate(sizes.items())} for r in range(n)}
        ctxs = {k: c.compress(grads[rank][k]) for k in sizes}
        handles = {k: hvd.allreduce_async(ctxs[k][0], op=ops[k], name=f"buffer-ops.{i}.{k}") for k in sizes}
        got = {k: c.decompress(hvd.synchronize(handles[k]), ctxs[k][1]) for k in order}
        (name, occurrence, members), = list(c.runner.buffers.recent)
        offsets = [o for _, o, _ in members]
        numel = offsets[-1] + sizes["c"]
        fps = [codec.tensor_fingerprint("", (v,), "float32") for v in sizes.values()]
        fp = codec.tensor_fingerprint("|".join(f"{f}@{o}" for f, o in zip(fps, offsets)), (numel,), "float32")
        layout = [(k, o, v) for (k, v), o in zip(sizes.items(), offsets)]
        payloads = [codec.encode(staged(grads[r], layout, numel), 4, 512, "max",
                                 protocol.payload_seed(SEED, r, name, occurrence), "fixed", fp, True) for r in range(n)]
        total = codec.decode_sum(payloads, 1.0)
        first = ops[order[0]]
        for k, o, size in layout:
            exact = total[o:o + size] * (1.0 / n if ops[k] == hvd.Average else 1.0)
            mine = got[k].numpy()
            if ops[k] == first:
                assert np.array_equal(mine, exact), (order, k, np.abs(mine - exact).max())
            else:
                assert np.allclose(mine, exact, rtol=3 * 2.0 ** -24, atol=0), (order, k, np.abs(mine - exact).max())
            copies = gather(got[k], f"buffer-ops.same.{i}.{k}")
            assert all(torch.equal(cp, copies[0]) for cp in copies), (order, k)


def check_join_buffered(n, rank):
    """hvd.join() with fusion buffers: rank r takes 3 - r steps, then joins. While ranks have joined,
    a buffer goes through Horovod's allreduce of the stepping ranks' dequantized buffers (the joined
    add zeros), and each gradient is its slice over n: bit for bit the stepping ranks' own buffers,
    encoded again here and summed (with at most two ranks stepping, the float32 sum is exact in any
    order); every member counted as a joined exchange."""
    from hvd_qsgd.adapters.torch import TorchCompressor
    steps = 3 - rank
    model = layers()
    c = TorchCompressor(seed=SEED, fusion_mb=0.2, reduction="allgather", creation_index=2100)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), compression=c)
    params = dict(model.named_parameters())
    big = {k: p.numel() for k, p in params.items() if p.numel() >= 10000}
    own = {k: torch.zeros(3, v) for k, v in big.items()}    # [step] this rank's dequantized contribution
    got = {k: torch.zeros(3, v) for k, v in big.items()}
    for step in range(steps):
        x, y = batch(rank, step)
        mine = copy.deepcopy(model)
        nn.functional.mse_loss(mine(x), y).backward()
        grads = {k: p.grad for k, p in mine.named_parameters()}
        before = len(c.runner.buffers.recent)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        for name, occurrence, members in list(c.runner.buffers.recent)[before:]:
            layout = [(label.rsplit(".p.", 1)[1], o, size) for label, o, size in members]
            numel = layout[-1][1] + layout[-1][2]
            fp = buffer_fingerprint(model, layout, numel, "float32")
            payload = codec.encode(staged(grads, layout, numel), 4, 512, "max",
                                   protocol.payload_seed(SEED, rank, name, occurrence), "fixed", fp, True)
            d = codec.decode(payload)
            for k, o, size in layout:
                own[k][step] = torch.from_numpy(d[o:o + size])
        for k in big:
            got[k][step] = params[k].grad.reshape(-1)
    hvd.join()   # every rank has joined: collectives work again
    for k, numel in big.items():
        contributions = [t.reshape(3, numel) for t in gather(own[k], f"buffers.join.{k}")]
        for step in range(steps):
            stepping = [r for r in range(n) if step < 3 - r]
            if len(stepping) == n:
                continue  # nobody joined yet: the usual buffers, checked by check_buffers
            ref = sum(contributions[r][step] for r in stepping) * (1.0 / n)
            assert torch.equal(got[k][step], ref), f"{k} step {step}: max diff {(got[k][step] - ref).abs().max()}"
    joined_steps = sum(1 for step in range(steps) if any(step >= 3 - r for r in range(n)))
    assert c.stats["joined_exchanges"] == joined_steps * len(big), (c.stats, joined_steps)
