"""Worker for tests/test_soak.py: thousands of PyTorch training steps through hvd_qsgd under
horovodrun, recording whatever could grow. tests/test_soak.py applies the rules.

Phases, ``PHASE[:STEPS[:WARMUP]]`` in the order given, each with its own model, compressor and optimizer in
the same processes (three weights above min_numel: 12,800, 20,000 and 10,000 elements; five
tensors below):

* ``none``: ``hvd.DistributedOptimizer(..., compression=hvd.Compression.none)``, everything but
  the compressor (the control: the same rules hold for PyTorch and Horovod alone);
* ``named-allgather`` / ``named-scatter``: ``hvd.DistributedOptimizer(..., named_parameters=...,
  compression=hvd_qsgd.QSGD(4, error_feedback=True, named_parameters=..., reduction=...))``;
* ``unnamed``: the same without names given to the compressor or the optimizer (the compressor
  takes the optimizer's, Horovod's ``allreduce.noname.<i>.<j>``: named exchanges, residuals by name);
* ``allreduce``: no optimizer; each step ``hvd.allreduce(a, compression=c)`` and
  ``hvd.grouped_allreduce([a, b], compression=c)`` without names (c = ``hvd_qsgd.QSGD(4)``; three
  numbered exchanges a step, two of them in flight at once);
* ``allreduce-none``: the same calls with ``hvd.Compression.none`` (its control).

After the warm-up steps (``--warmup``, or a phase's own), every step records into preallocated arrays (recording keeps nothing
per step) this process's RSS (psutil) and its resident anonymous memory outside malloc's heap
(``soak_memory.resident_outside_malloc``), the size of ``horovod.torch.mpi_ops._handle_map`` and the
adapter's per-name and per-exchange state; every ``SAMPLE`` steps the open file descriptors and the
threads; at the start, the middle and the end of the measured steps (after a full garbage
collection) the pymalloc blocks in use (``sys.getallocatedblocks``) and the bytes glibc's malloc
has handed out (``mallinfo2``); at the start and the end the objects the garbage collector tracks
and the live exchange contexts. Every collective name the compressor hands to Horovod is recorded
(``horovod.torch.allgather_async`` and ``alltoall_async`` are wrapped). Each rank prints
``SOAK <phase> <json>`` per phase.

``--inject`` adds a deliberate leak to the compressed phases, to show that the rules catch it:
``rss`` keeps a 4 KiB tensor per step; ``handles`` starts one uncompressed allreduce per step and
never waits for it (its entry stays in ``_handle_map``); ``objects`` keeps one small Python object
per step; ``mapped`` maps and touches one 4 KiB page per step outside malloc and keeps it; ``names``
never frees a numbered exchange's slot (each step's exchanges get new names).
"""
import argparse
import gc
import json
import mmap
import sys
import time

import numpy as np
import psutil
import torch
import torch.nn as nn
import horovod.torch as hvd
from horovod.torch import mpi_ops

import hvd_qsgd
from hvd_qsgd.exchange.chains import Exchange as _Exchange
from tests.mp.soak_memory import malloc_in_use, memory_fields, resident_outside_malloc

SAMPLE = 100          # steps between descriptor and thread counts
ALLREDUCE_NUMEL = (20000, 12000)   # the allreduce phase's tensors
PHASES = ("none", "named-allgather", "named-scatter", "unnamed", "allreduce-none", "allreduce")
CONTROLS = ("none", "allreduce-none")   # the phases without hvd_qsgd


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 200)
        self.fc2 = nn.Linear(200, 100)
        self.fc3 = nn.Linear(100, 100)
        self.out = nn.Linear(100, 10)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = torch.relu(self.fc2(h))
        h = torch.relu(self.fc3(h))
        return self.out(h)


NAMES = {}   # collective -> the names the compressor passed (a dict as an ordered set)


def record_collective_names():
    for fn in ("allgather_async", "alltoall_async"):
        inner = getattr(hvd, fn)

        def wrapped(*args, _inner=inner, _fn=fn, **kwargs):
            NAMES.setdefault(_fn, {})[kwargs.get("name")] = None
            return _inner(*args, **kwargs)
        setattr(hvd, fn, wrapped)


def distinct_names():
    return sum(len(v) for v in NAMES.values())


class _NeverFreed(set):
    """``--inject names``: a slot set that forgets to free slots."""

    def discard(self, item):
        pass


STATE = ("occurrences", "residuals", "grad_names", "places", "in_flight", "numbered", "scattering", "pending",
         "seq")


def adapter_state(a):
    return (len(a.names.occurrences), len(a.residuals), len(a._places._by_grad), len(a._places._kept),
            len(a.names.in_flight), len(a.names.slots), len(a.driver), a.names.pending, a.names.seq)


def live_exchanges():
    return sum(1 for o in gc.get_objects() if isinstance(o, _Exchange))


def run_phase(phase, steps, warmup, inject):
    rank, n = hvd.rank(), hvd.size()
    proc = psutil.Process()
    torch.manual_seed(0)
    model = Net()
    named = phase.startswith("named")
    if phase in CONTROLS:
        c = hvd.Compression.none
    elif phase == "allreduce":
        c = hvd_qsgd.QSGD(4)
    else:
        c = hvd_qsgd.QSGD(4, error_feedback=True,
                          reduction="scatter_allgather" if phase == "named-scatter" else "allgather",
                          named_parameters=model.named_parameters() if named else None)
    opt = None if phase.startswith("allreduce") else hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters() if named or phase == "none" else None, compression=c)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(8)]
    a, b = (torch.randn(k, generator=g) for k in ALLREDUCE_NUMEL)
    inject = inject if phase not in CONTROLS else None
    kept = []

    def step(i):
        if opt is not None:
            x, y = batches[i % len(batches)]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        else:
            hvd.allreduce(a, compression=c)
            hvd.grouped_allreduce([a, b], compression=c)
        if inject == "rss":
            kept.append(torch.ones(1024))
        elif inject == "handles":
            kept.append(hvd.allreduce_async(torch.ones(4), name=f"soak.leak.{i}"))
        elif inject == "objects":
            kept.append(object())
        elif inject == "mapped":   # a page mapped and touched outside malloc, kept
            page = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            page[0] = 1
            kept.append(page)

    t0 = time.perf_counter()
    step(0)
    adapter = None if phase in CONTROLS else c._adapters["torch"]
    if inject == "names":
        adapter.names.slots = _NeverFreed(adapter.names.slots)
    for i in range(1, warmup):
        step(i)
    gc.collect()  # also empties the free lists: the block counts below are what is still in use
    blocks0, objects0, exchanges0 = sys.getallocatedblocks(), len(gc.get_objects()), live_exchanges()
    heap0 = malloc_in_use()
    names0, handles0 = distinct_names(), len(mpi_ops._handle_map)
    state0 = adapter_state(adapter) if adapter else None
    stats0 = c.stats if adapter else None
    rss, handles = np.zeros(steps, dtype=np.int64), np.zeros(steps, dtype=np.int64)
    outside = np.zeros(steps, dtype=np.int64)
    state = np.zeros((steps, len(STATE)), dtype=np.int64)
    fds, threads = [], []
    t1 = time.perf_counter()
    for j, i in enumerate(range(warmup, warmup + steps)):
        step(i)
        rss[j] = proc.memory_info().rss
        outside[j] = resident_outside_malloc()
        handles[j] = len(mpi_ops._handle_map)
        if adapter:
            state[j] = adapter_state(adapter)
        if j == steps // 2:
            gc.collect()
            blocks_mid, heap_mid = sys.getallocatedblocks(), malloc_in_use()
        if j % SAMPLE == 0 or j == steps - 1:
            fds.append(proc.num_fds())
            threads.append(proc.num_threads())
    t2 = time.perf_counter()
    gc.collect()
    blocks1, objects1, exchanges1 = sys.getallocatedblocks(), len(gc.get_objects()), live_exchanges()
    heap1 = malloc_in_use()
    for h in kept:
        if isinstance(h, int):
            hvd.synchronize(h)
    kept.clear()
    # what a step allocates at the least: the gradients (or the allreduced tensors' results) and the
    # payloads it sends and receives
    grad_bytes = 4 * (sum(ALLREDUCE_NUMEL) + ALLREDUCE_NUMEL[0] if opt is None
                      else sum(p.numel() for p in model.parameters()))
    payload_bytes = 0.0
    if adapter:
        st = c.stats
        payload_bytes = (st["bytes_sent"] + st["bytes_received"]
                         - stats0["bytes_sent"] - stats0["bytes_received"]) / steps
    result = {
        "phase": phase, "rank": rank, "size": n, "warmup": warmup, "steps": steps,
        "warmup_s": round(t1 - t0, 2), "measured_s": round(t2 - t1, 2),
        "step_bytes": int(grad_bytes + payload_bytes), "grad_bytes": grad_bytes, "payload_bytes": int(payload_bytes),
        **memory_fields(rss.tolist(), outside.tolist()),
        "blocks": [blocks0, blocks_mid, blocks1], "malloc": [heap0, heap_mid, heap1],
        "handles_baseline": handles0, "handles_min": int(handles.min()), "handles_max": int(handles.max()),
        "fds": fds, "threads": threads,
        "objects_before": objects0, "objects_after": objects1,
        "exchanges_before": exchanges0, "exchanges_after": exchanges1,
        "names_after_warmup": names0, "names_end": distinct_names(),
        "names": {k: list(v)[:8] for k, v in NAMES.items()},
    }
    if adapter:
        result.update(
            state_before=dict(zip(STATE, state0)), state_end=dict(zip(STATE, state[-1].tolist())),
            state_max=dict(zip(STATE, state.max(axis=0).tolist())),
            state_min=dict(zip(STATE, state.min(axis=0).tolist())),
            seq_per_step=(int(state[-1][STATE.index("seq")]) - state0[STATE.index("seq")]) / steps,
            occurrences=dict(adapter.names.occurrences), residual_keys=sorted(map(str, adapter.residuals.residuals)))
    print(f"SOAK {phase} {json.dumps(result)}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("phases", nargs="+", help="PHASE[:STEPS[:WARMUP]], PHASE one of " + ", ".join(PHASES))
    p.add_argument("--steps", type=int, default=1000, help="steps of a phase given without a count")
    p.add_argument("--warmup", type=int, default=150, help="warm-up steps of a phase given without them")
    p.add_argument("--inject", choices=["rss", "handles", "objects", "names", "mapped"])
    args = p.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    record_collective_names()
    for spec in args.phases:
        phase, count, warmup = (spec.split(":") + [None, None])[:3]
        if phase not in PHASES:
            raise SystemExit(f"unknown phase {phase}")
        NAMES.clear()
        run_phase(phase, int(count or args.steps), int(warmup or args.warmup), args.inject)


if __name__ == "__main__":
    main()
