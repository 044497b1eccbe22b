"""``python -m benchmarks overhead --calls``: the compressor's own time per call, in one process.

A step of the ``overhead`` benchmark on two ranks sharing two cores moves by more from launch to
launch than the Python a gradient costs, so this mode times that Python where nothing else runs:
one process (Horovod of one rank, no ``horovodrun``), K parameters of ``--numel`` elements
(loss = sum of p * x) through ``hvd.DistributedOptimizer`` (zero_grad, backward, step), the
compressor told nothing (it learns the parameters' names from the optimizer, as it does in a job)
and wrapped to time its calls. Per mode and K: the median over blocks of 30 steps of the time per call of
compress, of decompress after the step's first, and of the step's first decompress (which waits for
the step's collectives and, with fusion buffers, encodes and decodes the buffer), and the step's
time per gradient; then, over 3 more steps, the Python instructions (``sys.settrace``'s opcode
events) a gradient's compress and decompress run, the step's first decompress spread over its
gradients: a count that does not move with the machine's load, as the times here do by 10-30%,
to compare two trees' Python paths with (the C calls they make are not in it). Beside the medians, the
fastest block's compress and decompress (over every run of the tree): the least disturbed by other
load, as ``timeit`` reports its best. Each tree in
``--trees`` runs in its own process, alternating, ``--repeats`` times.
With ``--device cuda`` the parameters are CUDA tensors: a call's time is then the host's (the kernels
run on the device's stream; a decode waits for the device where it reads the payloads' headers and
its verdict), and a block of steps is timed until the device is done.
"""
import contextlib
import json
import os
import statistics
import sys
import time

BLOCK = 30   # steps a block
OPCODE_STEPS = 3   # steps whose Python instructions are counted (the same at every step: deterministic)


def worker(args):
    """One process: every mode and K; the medians as JSON on stdout's last line."""
    import torch
    import horovod.torch as hvd
    import hvd_qsgd
    from benchmarks.overhead import compression_of, torch_device
    hvd.init()
    device, done = torch_device(torch, hvd, args.device)
    clock, results = time.perf_counter, {}
    for mode in args.modes.split(","):
        for k in [int(v) for v in args.tensors.split(",")]:
            torch.manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(args.numel, device=device)) for _ in range(k)]
            xs = [torch.randn(args.numel, device=device) for _ in range(k)]   # p's gradient: loss = sum of p * x
            timed = Timed(compression_of(hvd, hvd_qsgd, mode), clock)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.0), compression=timed,
                                           named_parameters=[(f"p{i}", p) for i, p in enumerate(params)])
            opt._register_hooks()   # (what Horovod's optimizer does itself with more than one rank)

            def step():
                timed.first = True
                opt.zero_grad()
                sum((p * x).sum() for p, x in zip(params, xs)).backward()
                opt.step()

            for _ in range(args.warmup):
                step()
            rows = []
            for _ in range(max(1, args.steps // BLOCK)):
                timed.spent[:] = [0.0, 0.0, 0.0]
                t0 = clock()
                for _ in range(BLOCK):
                    step()
                done()
                wall = clock() - t0
                spent = timed.spent
                rows.append((spent[0] / BLOCK / k, spent[1] / BLOCK / max(1, k - 1), spent[2] / BLOCK,
                             wall / BLOCK / k))
            timed.opcodes = [0, 0]   # one more block of steps, counting the Python instructions run
            for _ in range(OPCODE_STEPS):
                step()
            done()
            cols = list(zip(*rows))
            results[f"{mode}/{k}"] = [statistics.median(col) for col in cols] + [min(cols[0]), min(cols[1])] + [
                n / OPCODE_STEPS / k for n in timed.opcodes]
            timed.opcodes = None
    print(json.dumps(results))


class Timed:
    """The compression Horovod's optimizer is given: ``inner``'s compress and decompress, timed
    (``spent``: compress, decompress after the step's first, the step's first decompress). Its
    method is named ``compress``, as any wrapper's is, so the compressor still learns the parameter's
    name and process set from the optimizer's frames (``hvd_qsgd.horovod_caller``)."""

    def __init__(self, inner, clock):
        self.inner, self.clock, self.spent, self.first = inner, clock, [0.0, 0.0, 0.0], True
        self.opcodes = None   # [compress, decompress]: the Python instructions counted (``_counting``)

    def compress(self, tensor):
        if self.opcodes is not None:   # (a block, not a helper's call: the frames between Horovod's and
            with self._counting(0):    # the compressor's are passed over only if named compress)
                return self.inner.compress(tensor)
        t0 = self.clock()
        out = self.inner.compress(tensor)
        self.spent[0] += self.clock() - t0
        return out

    @contextlib.contextmanager
    def _counting(self, which):
        """Every Python instruction this thread runs inside the block counted in ``opcodes[which]``
        (``sys.settrace``): a measure of the Python path that does not move with the machine's load, as
        time does."""
        counts = self.opcodes

        def trace(frame, event, arg):
            frame.f_trace_opcodes = True
            if event == "opcode":
                counts[which] += 1
            return trace
        sys.settrace(trace)
        try:
            yield
        finally:
            sys.settrace(None)

    def decompress(self, tensor, ctx):
        if self.opcodes is not None:
            with self._counting(1):
                return self.inner.decompress(tensor, ctx)
        t0 = self.clock()
        out = self.inner.decompress(tensor, ctx)
        self.spent[2 if self.first else 1] += self.clock() - t0
        self.first = False
        return out


def run(args, trees, ks, modes):
    """Launch the worker in each tree (alternating, ``--repeats`` times) and print the table."""
    from benchmarks.common import REPO_ROOT, machine_info, tree_runs
    table = tree_runs(trees, args.repeats, ["--calls-worker", "--tensors", args.tensors, "--numel", str(args.numel),
                                            "--modes", args.modes, "--steps", str(args.steps),
                                            "--warmup", str(args.warmup), "--device", args.device])
    if table is None:
        return 1
    info = machine_info()
    print(f"{info['cpu']}, {info['usable_cores']} usable cores, load {info['load_avg_1min']:.1f}; one process "
          f"(Horovod of one rank), gradients of {args.numel} elements on the {args.device.upper()}; us a call (first decompress: ms), median "
          f"over blocks of {BLOCK} steps, median of {args.repeats} runs per tree, in ABBA order")
    print("| tree | K | mode | compress | decompress | first decompress (ms) | step a gradient | fastest block: "
          "compress / decompress | Python instructions a gradient: compress / decompress |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k in ks:
        for mode in modes:
            for tree in trees:
                name = os.path.relpath(tree, REPO_ROOT) if tree.startswith(REPO_ROOT) else tree
                cols = list(zip(*table[(tree, f"{mode}/{k}")]))
                comp, dec, first, step = (statistics.median(col) for col in cols[:4])
                fast_c, fast_d = min(cols[4]), min(cols[5])   # (the block least disturbed by the machine's load)
                ops_c, ops_d = (statistics.median(col) for col in cols[6:])
                print(f"| {name} | {k} | {mode} | {1e6 * comp:.0f} | {1e6 * dec:.0f} | {1e3 * first:.2f} | "
                      f"{1e6 * step:.0f} | {1e6 * fast_c:.1f} / {1e6 * fast_d:.1f} | {ops_c:.0f} / {ops_d:.0f} |")
    return 0
