"""Soak test: thousands of training steps through hvd_qsgd under real ``horovodrun --gloo -np 2``
jobs, and nothing may grow: not memory, not Horovod's handles, not the collective names the
compressor uses, not the compressor's own per-name and per-exchange state.

Workers: tests/mp/soak_worker.py, PyTorch: a control phase with ``hvd.Compression.none``;
``hvd.DistributedOptimizer`` with ``hvd_qsgd.QSGD(4, error_feedback=True, named_parameters=...)``
under ``reduction="allgather"`` and ``"scatter_allgather"``; a plain optimizer without names; and
unnamed ``hvd.allreduce`` / ``hvd.grouped_allreduce`` calls. tests/mp/soak_tf_worker.py,
TensorFlow: a ``tf.function`` step with ``hvd.DistributedGradientTape(tape,
compression=hvd_qsgd.QSGD(4, error_feedback=True))``, and eager ``hvd.allreduce`` /
``hvd.grouped_allreduce`` calls. Each phase warms up first; every rule is checked on every rank over
the measured steps that follow, and a failure reports the measured numbers.

Rules:

* Horovod handles: the size of ``horovod.torch.mpi_ops._handle_map`` after every step equals its
  size after the warm-up (every handle a step starts is waited on and released).
* File descriptors and threads: the same at every sample (every 100 steps).
* Collective names: no name the compressor hands to Horovod is new after the warm-up, and there
  are exactly as many as a step has exchanges (3 named allgathers; 3 alltoalls and 3 allgathers for
  scatter_allgather; the optimizer's names for the optimizer whose compressor was given none; n0, n1
  for the unnamed allreduces).
  Horovod keeps state per name (its response cache: 1024 entries by default, LRU; with
  HOROVOD_TIMELINE also the timeline's per-name table, never shrunk). A new name per exchange misses
  that cache every time and evicts its entries ("A response has been evicted from cache"). The
  numbered exchanges used to be named ``hvd_qsgd.<k>.s<seq>``, a new name per exchange forever
  (3,000 new names in 1,000 steps of each unnamed phase); they now reuse slot names.
* Adapter state: after every step no exchange is pending, in flight, holding a numbered slot or
  waiting for its second phase; the per-name dicts (``names.occurrences``, ``residuals``, the
  places' ``_by_grad`` and ``_kept``, ``hvd_qsgd.adapters.torch_places``) keep the size they had after
  the warm-up; every named exchange's occurrence count
  equals the steps taken; ``names.seq`` grows by exactly the numbered exchanges a step (it counts them
  forever: one integer, used only for the payload seeds); no exchange context (``_Exchange``) is
  alive after the last step.
* Python objects, counted after a full garbage collection: the objects the garbage collector
  tracks grow by less than one per 10 steps over the measured steps; in PyTorch, the pymalloc
  blocks in use (``sys.getallocatedblocks``, strings and numbers too) by less than one per 2 steps
  in at least one of the two halves of the measured steps. A leak raises both halves (one object
  kept per step: at least one block a step in each, twice the bound, and fails); a one-time shift
  moves one half: the first half may still fill caches (ctypes, NumPy), and past their filling the
  count still wanders without a leak (measured: up to about 100 blocks over 400 steps, where a
  gc.collect() finds Horovod's and PyTorch's caches; once -177 then +114 over the halves of the
  400-step ``none`` control, which failed a second-half-only rule at 0.57 a step). So every phase
  measures halves of 400 steps or more: a leak of one object a step adds at least 400 to each, the
  bound 200. The filling itself lasts longer in some phases: after only 150
  warm-up steps the unnamed allreduce phase once measured 0.51 a step over 400 steps, Horovod's own
  cache filling (allreduce-none shows the same fill without hvd_qsgd), hence the longer warm-ups in
  TORCH_PHASES. (TensorFlow's own blocks drift by about -0.7 a step, its caches churning, which would
  hide such a leak; there the compressor's Python code runs only while tracing, or per eager call,
  and the tracked objects, malloc and RSS rules watch it.)
* malloc: the bytes glibc's malloc has handed out (``mallinfo2``: all arenas, mmapped chunks;
  counted after a full collection) may grow over the second half of the measured steps by at most
  what one step allocates at the least: its gradients (or the allreduced tensors) plus the payload
  bytes it sends and receives (from the compressor's stats), 170 to 260 KiB here. Measured growth
  without a leak: at most 40 KiB. A retention of about 350 to 500 bytes a step fails. This is the
  rule that sees a leak in native memory even where freed heap from earlier phases hides it from
  RSS (measured: a 4 KiB tensor kept per step left RSS flat in some phases).
* Resident memory outside malloc (after every step): the process's resident anonymous and shared
  memory (``RssAnon`` + ``RssShmem``: all but mapped files' pages) less the heap glibc's malloc
  holds (``mallinfo2``: arenas and mmapped chunks, in use or free), so what pymalloc's arenas and
  any other mapping keep resident. The measured steps are cut into five equal windows; the rule
  fails when each window's median is above the one before it by more than half of what one step
  allocates. A leak raises all four; a one-time level shift, even one that ramps over a window's
  length, moves the median of one window against the next (a median follows the level most of its
  window holds), so three or four of them never. This has the old two-halves rule's reach (a leak
  of ``step_bytes / (0.4 N)`` a step over N steps: halves of 0.4 N steps, each by a step's bytes; now
  windows of 0.2 N steps, each by half), without its weakness: CI once failed the uncompressed
  allreduce-none control (no hvd_qsgd in it) on a one-time +1.2 MiB shift that ramped inside the
  middle of its three windows and so rose in both halves (+924 and +236 KiB, allowed 203). Malloc's
  heap itself is the malloc rule's: plain RSS once rose by 11 MiB in both halves of the
  uncompressed allreduce-none control while malloc's bytes in use stayed within 140 KiB: the heap
  fragmenting, not a leak. The RSS is still printed per phase.
* TensorFlow: no retrace after the warm-up; the compressor's variables, traced exchanges and
  occurrence counters, and the live tf.Variable objects stay; every occurrence counter equals the
  steps taken; eager exchanges advance ``names.seq`` by 3 a step and leave no slot taken. Eager
  exchanges used to leak about 116 KB each (TensorFlow keeps a kernel per distinct attr value, and
  the exchange number was in the ``where`` and ``seed`` attrs; and an eager tensor per distinct
  Python number): 200 MB in 600 steps. They now keep their attrs constant
  (hvd_qsgd/adapters/tensorflow/compressor.py).

Step counts (warm-up + measured): PyTorch 150 + 1000 (control), 150 + 1200 (named allgather),
1000 + 1000 (named scatter_allgather), 150 + 1000 (unnamed optimizer), 1500 + 800 (unnamed
allreduces without compression, their control) and 1500 + 1600 (unnamed allreduces); TensorFlow
2000 + 1200 (tf.function; TensorFlow's own dispatch cache fills during the first ~2000 calls) and
100 + 600 (eager): 14,950 steps in all. On this 2-core machine the file takes
about 1.5 minutes with the cores to itself, and up to about 3 minutes while other test runs share
them (measured at load averages of 4 to 6). The two controls (3,450 of those steps) run only with
``HVD_QSGD_SOAK_CONTROLS=1`` or ``HVD_QSGD_SOAK_INJECT=1``: they are the rules' calibration, not a
check of hvd_qsgd, and the suite's time had to come down.

``HVD_QSGD_SOAK_INJECT=1`` also runs test_rules_catch_injected_leaks: each kind of deliberate leak
(``--inject`` in the workers) must make its rule fail in every phase it applies to.
"""
import json
import os
import re

import pytest

from tests.helpers import launch

TORCH_WORKER = "tests/mp/soak_worker.py"
TF_WORKER = "tests/mp/soak_tf_worker.py"
# PHASE:STEPS[:WARMUP]; unnamed hvd.allreduce calls fill caches of Horovod and PyTorch for ~1,500 steps
# (measured with hvd.Compression.none: +700 pymalloc blocks in the first 500 steps, +60 in the next
# 500, then about +10 per 500), so those phases warm up for 1,500 steps, and allreduce-none shows it;
# scatter_allgather's alltoalls fill for longer than 150 steps too (measured: +136 and +30 blocks in
# the halves of 1,000 steps after 150; flat after 1,000)
TORCH_PHASES = ["none:1000", "named-allgather:1200", "named-scatter:1000:1000", "unnamed:1000",
                "allreduce-none:800:1500", "allreduce:1600:1500"]
CONTROLS = {"none", "allreduce-none"}   # the phases without hvd_qsgd
# the controls show the rules hold on Horovod's own path (how their bounds were set); they take a
# third of the file's steps, so the suite runs them only with HVD_QSGD_SOAK_CONTROLS=1 (or _INJECT)
if not (os.environ.get("HVD_QSGD_SOAK_CONTROLS") or os.environ.get("HVD_QSGD_SOAK_INJECT")):
    TORCH_PHASES = [p for p in TORCH_PHASES if p.split(":")[0] not in CONTROLS]
TORCH_WARMUP = 150
TF_PHASES = ["tape:1200:2000", "eager:600:100"]
PARAMS = ["fc1.weight", "fc2.weight", "fc3.weight"]   # the worker's tensors above min_numel
NAMES = {"none": 0, "named-allgather": 3, "named-scatter": 6, "unnamed": 3, "allreduce-none": 0, "allreduce": 2}
# "unnamed": the compressor is given no names, and takes the optimizer's (hvd_qsgd.horovod_caller):
# named exchanges, no numbered ones; the numbered exchanges are the allreduce phase's
SEQ_PER_STEP = {"named-allgather": 0, "named-scatter": 0, "unnamed": 0, "allreduce": 3}
OBJECTS_PER_STEP = 0.1   # tracked objects a step may add
BLOCKS_PER_STEP = 0.5    # pymalloc blocks a step may add


def results(out):
    """{(phase, rank): the worker's measurements}."""
    found = {}
    for m in re.finditer(r"SOAK (\S+) (\{.*\})", out):
        r = json.loads(m.group(2))
        found[(m.group(1), r["rank"])] = r
    return found


def outside_malloc_violation(r):
    medians = r["outside_windows"]
    rises = [b - a for a, b in zip(medians, medians[1:])]
    if min(rises) > r["step_bytes"] / 2:
        return (f"resident memory outside malloc's heap rose from each of {len(medians)} windows to the next over {r['steps']} "
                f"steps: window medians {[round(m / 2**20, 2) for m in medians]} MiB (rises "
                f"{[round(x / 1024) for x in rises]} KiB over {r['distance']} steps each; allowed "
                f"{r['step_bytes'] / 2048:.0f} KiB, half of what a step allocates); curve (KiB from the first step): "
                f"{[int((x - r['outside_curve'][0]) / 1024) for x in r['outside_curve']]}; RSS curve: "
                f"{[int((x - r['rss_curve'][0]) / 1024) for x in r['rss_curve']]}")
    return None


def malloc_violation(r):
    start, mid, end = r["malloc"]
    if end - mid > r["step_bytes"]:
        return (f"malloc in use grew by {(end - mid) / 1024:.0f} KiB over the second half of {r['steps']} steps "
                f"(allowed {r['step_bytes'] / 1024:.0f} KiB, what one step allocates; start, middle, end: "
                f"{r['malloc']})")
    return None


def blocks_violation(blocks, steps):
    """A leak of k blocks a step raises both halves by k times their steps; a one-time shift (a cache
    filling, an arena freed) moves one half. So both halves must rise by more than BLOCKS_PER_STEP a step."""
    first = (blocks[1] - blocks[0]) / (steps // 2)
    second = (blocks[2] - blocks[1]) / (steps - steps // 2)
    if min(first, second) > BLOCKS_PER_STEP:
        return (f"pymalloc blocks in use grew by {first:.2f} and {second:.2f} a step over the halves of {steps} "
                f"steps (start, middle, end: {blocks})")
    return None


def torch_violations(r):
    v = []
    steps, phase = r["steps"], r["phase"]
    if not r["handles_min"] == r["handles_max"] == r["handles_baseline"]:
        v.append(f"_handle_map size went from {r['handles_baseline']} to between {r['handles_min']} and "
                 f"{r['handles_max']} after a step")
    for what in ("fds", "threads"):
        if len(set(r[what])) != 1:
            v.append(f"{what} changed: {r[what]}")
    if (r["objects_after"] - r["objects_before"]) > OBJECTS_PER_STEP * steps:
        v.append(f"tracked objects grew by {r['objects_after'] - r['objects_before']} in {steps} steps")
    if r["exchanges_after"] != 0:
        v.append(f"{r['exchanges_after']} exchange contexts alive after the last step")
    v.append(blocks_violation(r["blocks"], steps))
    v.append(malloc_violation(r))
    v.append(outside_malloc_violation(r))
    if r["names_end"] != r["names_after_warmup"] or r["names_end"] != NAMES[phase]:
        v.append(f"collective names: {r['names_after_warmup']} after the warm-up, {r['names_end']} at the end "
                 f"(expected {NAMES[phase]}): {r['names']}")
    if phase not in CONTROLS:
        for k in ("in_flight", "numbered", "scattering", "pending"):
            if r["state_max"][k] != 0:
                v.append(f"after a step {k} was up to {r['state_max'][k]}")
        for k in ("occurrences", "residuals", "grad_names", "places"):
            if not r["state_min"][k] == r["state_max"][k] == r["state_before"][k]:
                v.append(f"{k} had {r['state_before'][k]} entries after the warm-up, between "
                         f"{r['state_min'][k]} and {r['state_max'][k]} later")
        if r["seq_per_step"] != SEQ_PER_STEP[phase]:
            v.append(f"_seq grew by {r['seq_per_step']} a step, expected {SEQ_PER_STEP[phase]}")
        if phase.startswith("named") and r["occurrences"] != {p: r["warmup"] + steps for p in PARAMS}:
            v.append(f"occurrences {r['occurrences']}, expected {r['warmup'] + steps} for each of {PARAMS}")
    return [x for x in v if x]


def tf_violations(r):
    v = []
    before, after, steps, phase = r["before"], r["after"], r["steps"], r["phase"]
    for k in ("traces", "variables", "traced_exchanges", "occurrences", "residuals", "tf_variables"):
        if before.get(k) != after.get(k):
            v.append(f"{k}: {before.get(k)} after the warm-up, {after.get(k)} at the end")
    seq_growth = after["seq"] - before["seq"]
    if seq_growth != (0 if phase == "tape" else 3 * steps):
        v.append(f"_seq grew by {seq_growth} in {steps} steps")
    if after["eager_slots"] != 0:
        v.append(f"{after['eager_slots']} eager slots still taken after the last step")
    if r["occurrence_values"] != ([r["warmup"] + steps] if phase == "tape" else []):
        v.append(f"occurrence counters {r['occurrence_values']}, expected [{r['warmup'] + steps}]")
    for what in ("fds", "threads"):
        if len(set(r[what])) != 1:
            v.append(f"{what} changed: {r[what]}")
    if after["objects"] - before["objects"] > OBJECTS_PER_STEP * steps:
        v.append(f"tracked objects grew by {after['objects'] - before['objects']} in {steps} steps")
    v.append(malloc_violation(r))
    v.append(outside_malloc_violation(r))
    return [x for x in v if x]


def summary(r):
    def rises(medians):
        return ", ".join(f"{(b - a) / 1024:+.0f}" for a, b in zip(medians, medians[1:]))
    return (f"rank {r['rank']} {r['phase']}: {r['steps']} steps in {r['measured_s']} s; RSS window medians "
            f"{' / '.join(f'{m / 2**20:.2f}' for m in r['rss_windows'])} MiB ({rises(r['rss_windows'])} KiB); "
            f"outside malloc {rises(r['outside_windows'])} KiB (allowed {r['step_bytes'] / 2048:.0f} each); "
            f"pymalloc blocks {r['blocks']}; malloc in use {r['malloc']}")


# per framework: worker, phases, extra arguments, the rules, default timeout, what to print per phase
FRAMEWORKS = {
    "torch": (TORCH_WORKER, TORCH_PHASES, ["--warmup", str(TORCH_WARMUP)], torch_violations, 360, summary),
    "tf": (TF_WORKER, TF_PHASES, [], tf_violations, 180, lambda r: f"{summary(r)} {r['after']}"),
}


def soak(framework, extra=(), timeout=None):
    """Run the framework's phases on 2 ranks; return {(phase, rank): violations} of those that break
    a rule (every phase must report on both ranks)."""
    worker, phase_args, fixed, violations, default_timeout, show = FRAMEWORKS[framework]
    out = launch(2, "gloo", [worker] + phase_args + fixed + list(extra), timeout=timeout or default_timeout)
    found = results(out)
    phases = [p.split(":")[0] for p in phase_args]
    assert sorted(found) == sorted((p, r) for p in phases for r in range(2)), out[-3000:]
    failures = {}
    for key, r in sorted(found.items()):
        print(show(r))
        v = violations(r)
        if v:
            failures[key] = v
    return failures


def test_torch_training_steps_leave_nothing_growing():
    failures = soak("torch")
    assert not failures, json.dumps({f"{p} rank {r}": v for (p, r), v in failures.items()}, indent=1)


def test_tensorflow_training_steps_leave_nothing_growing():
    failures = soak("tf")
    assert not failures, json.dumps({f"{p} rank {r}": v for (p, r), v in failures.items()}, indent=1)


# each injected leak and the rule that must catch it (in the phases it applies to)
INJECTED = {
    "torch-rss": (["--inject", "rss"], "malloc in use grew"),
    "torch-handles": (["--inject", "handles"], "_handle_map"),
    "torch-objects": (["--inject", "objects"], "pymalloc blocks in use grew"),
    "torch-names": (["--inject", "names"], "collective names"),
    "torch-mapped": (["--inject", "mapped"], "outside malloc's heap"),
    "tf-rss": (["--inject", "rss"], "malloc in use grew"),
    "tf-retrace": (["--inject", "retrace"], "traces"),
}


@pytest.mark.skipif(not os.environ.get("HVD_QSGD_SOAK_INJECT"), reason="set HVD_QSGD_SOAK_INJECT=1 (several minutes)")
@pytest.mark.parametrize("kind", sorted(INJECTED))
def test_rules_catch_injected_leaks(kind):
    args, rule = INJECTED[kind]
    if kind.startswith("torch"):
        failures = soak("torch", args, timeout=400)
        caught = {p for (p, _), v in failures.items() if any(rule in x for x in v)}
        expected = {"unnamed", "allreduce"}
        if kind != "torch-names":
            expected |= {"named-allgather", "named-scatter"}
    else:
        failures = soak("tf", args, timeout=400)
        caught = {p for (p, _), v in failures.items() if any(rule in x for x in v)}
        expected = {"tape"} if kind == "tf-retrace" else {"tape", "eager"}
    assert caught == expected, failures
