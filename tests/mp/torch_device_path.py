"""Worker: the PyTorch adapter's device path against its host path, under horovodrun.

``torch_device_path.py DEVICE all|CONFIGURATION...``, DEVICE one of
- ``emulated`` (tests/test_cuda.py): the CUDA library emulated on the host (tests/emulated_cuda.py, its
  path in ``HVD_QSGD_EMULATED_CUDA_LIB``), host tensors standing for CUDA tensors;
- ``cuda`` (``make gpu-check-horovod``): real CUDA tensors on the visible GPU (the ranks share it).

For each configuration, every rank runs the same three steps twice through
``hvd.DistributedOptimizer(..., compression=...)``: on the host path (``backends.CpuBackend``, CPU
tensors) and on the device path (``backends.CudaBackend``: fused error feedback, the chunk steps,
server error feedback, half precision read in its own dtype). Both compressors have the same creation
index, so the same exchange names and seeds. Every step's result, every worker residual and every
server residual must be equal bit for bit; the device run must have taken the CUDA backend (no host
fallback counted; emulated: the wrappers called the emulated kernels), except for the Elias coding,
which must go through the host with every exchange counted. The device's verdicts on a step's
decoded results are read once, at the step's last decompress (``hvd_qsgd.cuda.settle``), and the
fixed coding's headers are never read from the device (the device checks them).
``deferred-verdict-corrupt``: a payload corrupted before its device decode makes that step raise on
every rank, naming its tensor, where the step's results are handed over. Each rank prints
``OK <configuration>``.
"""
import os
import sys

import numpy as np
import torch
import horovod.torch as hvd

import hvd_qsgd
import hvd_qsgd.cuda
import hvd_qsgd.torch
from hvd_qsgd.settings import Settings
from tests import emulated_cuda

STEPS = 3
SIZES = (20_011, 12_000)  # an odd size (a partial bucket, uneven chunks) and an even one
CONFIGS = {  # name: (settings, dtype)
    "allgather": (Settings.make(bits=4, reduction="allgather"), torch.float32),
    "allgather-ef-fp16": (Settings.make(bits=4, reduction="allgather", error_feedback=True), torch.float16),
    "allgather-ef-bf16-l2": (Settings.make(bits=8, norm="l2", reduction="allgather", error_feedback=True),
                             torch.bfloat16),
    "scatter": (Settings.make(bits=4, bucket_size=128, reduction="scatter_allgather"), torch.float32),
    "scatter-ef": (Settings.make(bits=2, bucket_size=128, reduction="scatter_allgather", error_feedback=True),
                   torch.float32),
    "scatter-server-ef-fp16": (Settings.make(bits=4, reduction="scatter_allgather", error_feedback=True,
                                             server_error_feedback=True), torch.float16),
    "blocksign": (hvd_qsgd.BlockSign(block_size=256).settings, torch.float32),
    # nodes of one rank (HVD_QSGD_RANKS_PER_NODE=1 in this worker): the node scatter and gather go to
    # the rank itself, the cross stage among the 3 "nodes"; every stage's operation on the device
    "hierarchical-fp16": (Settings.make(bits=4, reduction="hierarchical"), torch.float16),
    # a slow node link (0.1 Gbit/s) makes the cross stage among 3 or more nodes scatter_allgather: the
    # chunk encode with error feedback, the reduce step and the reduced chunks' decode on the device
    "hierarchical-cross-scatter-ef": (Settings.make(bits=4, bucket_size=128, reduction="hierarchical", link_gbps=0.1,
                                                    error_feedback=True), torch.float32),
    # fusion: the step's allgather tensors in one allgather (the payloads joined and cut on the device)
    "fused-ef-fp16": (Settings.make(bits=4, reduction="allgather", error_feedback=True, fusion=True), torch.float16),
    # fusion buffers: both gradients in one buffer (at bucket boundaries, staged and sliced on the device),
    # each member's residual cut from the buffer's
    "buffers-ef-fp16": (Settings.make(bits=4, reduction="allgather", error_feedback=True, fusion_mb=0.2),
                        torch.float16),
    "buffers-scatter-ef": (Settings.make(bits=4, bucket_size=128, reduction="scatter_allgather", error_feedback=True,
                                         fusion_mb=0.2), torch.float32),
    # overlap: the first phase started in compress, the second from decompress
    "overlap-scatter-ef": (Settings.make(bits=4, bucket_size=128, reduction="scatter_allgather", error_feedback=True,
                                         overlap=True), torch.float32),
    # the Elias coding on the device: its encode (error feedback unfused) and decode-sum kernels
    "elias-ef": (Settings.make(bits=4, coding="elias", reduction="allgather", error_feedback=True), torch.float32),
    # the Elias coding has no chunk kernels: scatter_allgather goes through the host, every exchange counted
    "elias-scatter-through-the-host": (Settings.make(bits=4, bucket_size=128, coding="elias",
                                                     reduction="scatter_allgather"), torch.float32),
}
THROUGH_HOST = {"elias-scatter-through-the-host"}
CORRUPT = "deferred-verdict-corrupt"   # (allgather on the device, a payload of p1 corrupted at step 1)


def gradient(rank, step, i, numel):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + i)
    return torch.randn(numel, generator=g) * (1 + rank)


def run(settings, dtype, index, device="cpu"):
    """(every step's averaged gradients on the host, the compressor) of STEPS steps of
    hvd.DistributedOptimizer with a fresh compressor, the parameters on ``device``; each parameter's
    gradient is this rank's ``gradient`` (in its dtype)."""
    named, c, opt = optimizer(settings, dtype, index, device)
    results = []
    for step in range(STEPS):
        backward(opt, named, step, device)
        opt.synchronize()
        results += [p.grad.detach().cpu().clone() for _, p in named]
        with opt.skip_synchronize():
            opt.step()
    return results, c


def optimizer(settings, dtype, index, device):
    """(the named parameters of SIZES on ``device``, a fresh compressor, hvd.DistributedOptimizer)."""
    named = [(f"p{i}", torch.nn.Parameter(torch.zeros(numel, dtype=dtype, device=device)))
             for i, numel in enumerate(SIZES)]
    c = hvd_qsgd.torch.QSGD(settings=settings, creation_index=index, named_parameters=named)
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.0), named_parameters=named,
                                   compression=c)
    return named, c, opt


def backward(opt, named, step, device):
    """zero_grad and this rank's ``gradient`` of each parameter, through backward (its hooks compress)."""
    opt.zero_grad()
    loss = sum((p.float() * gradient(hvd.rank(), step, i, p.numel()).to(device)).sum()
               for i, (_, p) in enumerate(named))
    loss.backward()


def as_bytes(v):
    """The bytes of a residual: a torch tensor or a NumPy array."""
    a = v.detach().cpu().contiguous().view(torch.uint8).numpy() if torch.is_tensor(v) else np.asarray(v)
    return a.view(np.uint8).tobytes()


def counting(name, measure):
    """Wrap ``hvd_qsgd.cuda.<name>``: the list it fills has ``measure(argument)`` per call, where not
    None; and the function that restores it."""
    real, seen = getattr(hvd_qsgd.cuda, name), []

    def wrapped(first, *args, **kwargs):
        value = measure(first)
        if value is not None:
            seen.append(value)
        return real(first, *args, **kwargs)
    setattr(hvd_qsgd.cuda, name, wrapped)
    return seen, lambda: setattr(hvd_qsgd.cuda, name, real)


def check(name, device, lib, index):
    settings, dtype = CONFIGS[name]
    host, c_host = run(settings, dtype, index)
    # per settle that had verdicts to read, their count; per read of payloads' headers to the host, theirs
    settles, restore = counting("settle", lambda pending: len(pending) or None)
    reads, restore_reads = counting("device_headers", len)
    try:
        if device == "emulated":
            with emulated_cuda.on_host(lib, adapter=True) as emu:
                on_device, c_dev = run(settings, dtype, index)
            assert (emu.calls > 0) != (name in THROUGH_HOST), f"{name}: {emu.calls} calls of the emulated kernels"
        else:
            on_device, c_dev = run(settings, dtype, index, device="cuda")
    finally:
        restore()
        restore_reads()
    # the fixed coding's headers are checked on the device, never read to the host (the Elias coding's
    # lengths, and fusion=True's cut of its members, read them)
    reads_headers = settings.coding == "elias" and name not in THROUGH_HOST or settings.fusion
    assert bool(reads) == bool(reads_headers), f"{name}: headers read from the device {reads}"
    # the results' verdicts read once a step, a decode each (a fusion buffer's: one for its members;
    # the hierarchical reduction decodes in its stages, whose results go on to other ranks: read
    # there; through the host: checked in the call)
    decodes = 1 if settings.fusion_mb else len(SIZES)
    want = [] if name in THROUGH_HOST or "hierarchical" in name else [decodes] * STEPS
    assert settles == want, f"{name}: verdicts read {settles}, expected {want}"
    fallbacks = STEPS * len(SIZES) if name in THROUGH_HOST else 0
    assert c_dev.stats["host_fallbacks"] == fallbacks, f"{name}: {c_dev.stats['host_fallbacks']} host fallbacks"
    for k, (a, b) in enumerate(zip(host, on_device)):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape, (name, k, a.dtype, b.dtype)
        assert as_bytes(a) == as_bytes(b), f"{name}: step result {k} differs between the host and device paths"
    for what, mine, theirs in (("worker", c_host.residuals.residuals, c_dev.residuals.residuals),
                               ("server", c_host.residuals.server, c_dev.residuals.server)):
        assert mine.keys() == theirs.keys(), (name, what, mine.keys(), theirs.keys())
        for key in mine:
            assert as_bytes(mine[key]) == as_bytes(theirs[key]), f"{name}: {what} residual {key!r} differs"
    if settings.server_error_feedback and settings.reduction == "scatter_allgather":
        assert c_dev.residuals.server and all(torch.is_tensor(v) for v in c_dev.residuals.server.values()), \
            f"{name}: the device path kept no server residual on the device"
        saved = c_dev.state_dict()["server_residuals"]  # a checkpoint holds the same values from either path
        assert {k: as_bytes(v) for k, v in saved.items()} == \
            {k: as_bytes(v) for k, v in c_host.state_dict()["server_residuals"].items()}, name
    if settings.error_feedback:
        assert c_dev.residuals.residuals, f"{name}: no worker residual"


def check_corrupt(device, lib, index):
    """A payload of the first gradient decoded at step 1 corrupted (one data byte, on every rank alike)
    before its device decode: the step's other decode still runs, then the step raises on every rank,
    naming the corrupted tensor, where its results are handed over."""
    real = hvd_qsgd.cuda.decode_sum
    state = {"step": 0, "decoded": []}

    def corrupting(payloads, *args, **kwargs):
        where = kwargs.get("where", "")
        if state["step"] == 1:
            if not state["decoded"]:
                payloads = [p.clone() for p in payloads]
                payloads[0][-1] ^= 1   # (the last packed byte: the checksum says so, on the device)
            state["decoded"].append(where)
        return real(payloads, *args, **kwargs)

    named, _, opt = optimizer(CONFIGS["allgather"][0], torch.float32, index, device)
    hvd_qsgd.cuda.decode_sum = corrupting
    try:
        for step in range(2):
            state["step"] = step
            backward(opt, named, step, device)
            try:
                opt.synchronize()
            except hvd_qsgd.PayloadError as e:
                first = state["decoded"][0]
                assert step == 1 and len(state["decoded"]) == len(SIZES), (step, state["decoded"])
                assert str(e).startswith(first) and "checksum" in str(e), (first, str(e))
                return
            with opt.skip_synchronize():
                opt.step()
        raise AssertionError("the corrupt payload was not reported")
    finally:
        hvd_qsgd.cuda.decode_sum = real


def main():
    os.environ["HVD_QSGD_RANKS_PER_NODE"] = "1"   # for the hierarchical configuration, alike on every rank
    device, names = sys.argv[1], sys.argv[2:]
    names = [*CONFIGS, CORRUPT] if names == ["all"] else names
    if device not in ("emulated", "cuda") or not names or not set(names) <= {*CONFIGS, CORRUPT}:
        raise SystemExit(f"usage: torch_device_path.py emulated|cuda all|CONFIGURATION... ({', '.join(CONFIGS)})")
    hvd.init()
    torch.set_num_threads(1)
    lib = emulated_cuda.load(emulated_cuda.environ_path()) if device == "emulated" else None
    if device == "cuda" and not hvd_qsgd.cuda.available():
        raise SystemExit("torch_device_path.py cuda: hvd_qsgd's CUDA library or a CUDA device is not available")
    for k, name in enumerate(names):
        if name == CORRUPT and device == "emulated":
            with emulated_cuda.on_host(lib, adapter=True):
                check_corrupt("cpu", lib, 900 + k)
        elif name == CORRUPT:
            check_corrupt("cuda", lib, 900 + k)
        else:
            check(name, device, lib, 900 + k)
        print(f"OK {name}", flush=True)


if __name__ == "__main__":
    main()
