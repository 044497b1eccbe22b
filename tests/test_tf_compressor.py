"""hvd_qsgd.QSGD in Horovod's TensorFlow API, under real horovodrun jobs (tests/mp/tf_compressor.py),
and the TensorFlow ops against the PyTorch binding and the NumPy codec.

Exactness: after a step, every rank's averaged gradient (GradientTape in a tf.function; eager and
grouped allreduce; a tf_keras model.fit step; a tf.compat.v1 DistributedOptimizer) equals the
single-process decode_sum of every rank's payload, re-encoded independently from the documented
seeds, and is bit-identical across ranks. With reduction="scatter_allgather" (and "auto") it equals
``hvd_qsgd.reduction.simulate`` of every rank's input, regenerated in each worker. Mismatches fail
the step on every rank.
"""
import functools
import json
import os
import re
import subprocess
import sys

import pytest

from hvd_qsgd import codec
from tests.helpers import ROOT, launch, launch_once, mp_env, raised_in

WORKER = "tests/mp/tf_compressor.py"


def ok_count(out, scenario):
    return len(re.findall(rf"<stdout>:OK {re.escape(scenario)}(?![\w-])", out))


def tape_launch(np_, controller):
    """(scenarios, output) of the tape launch; on Gloo it ends with the traced join (Horovod 0.28.1
    carries one uneven join per process: a second one shuts it down, compressed or not)."""
    scenarios = ("tape", "allreduce", "keras", "error-feedback", "error-feedback-lr")
    scenarios += ("join-traced",) if controller == "gloo" else ()
    return scenarios, launch_once(np_, controller, (WORKER, *scenarios), timeout=330)


@pytest.mark.parametrize("np_,controller", [(2, "gloo"), (2, "mpi")])
def test_tape_allreduce_and_keras_equal_single_process_decode_on_every_rank(np_, controller):
    # (at 4 Gloo ranks too until the suite's time had to come down: 70 s on 2 cores; 4 ranks are
    # test_keras3_tape_and_fit_...'s and test_scatter_allgather_...'s, whose jobs start at 4 too)
    scenarios, out = tape_launch(np_, controller)
    for s in scenarios:
        assert ok_count(out, s) == np_, f"{s}:\n{out[-3000:]}"
    # that the training step is a tf.function whose graph holds the codec's ops and Horovod's
    # collectives is asserted by every rank before it prints "OK tape" (scenario_tape); the printed
    # op list is not matched here, because MPI may split a rank's line with another rank's output


def test_compat_v1_distributed_optimizer_in_a_session():
    out = launch(2, "gloo", [WORKER, "v1"], timeout=200)
    assert ok_count(out, "v1") == 2, out[-3000:]


def test_a_join_that_would_overflow_horovods_buffer_is_refused_on_every_stepping_rank():
    """At 7 ranks, rank 0 joined: the others' traced step is refused, each with an error naming
    Horovod's buffer (the job crashed: free(): invalid next size), and the job ends cleanly
    (tests/mp/join_guard_tf.py)."""
    out = launch(7, "gloo", ["tests/mp/join_guard_tf.py"], timeout=300)
    results = sorted(re.findall(r"RESULT (\d+) (\d+) (True|False)", out))
    assert results == [("0", "0", "True")] + [(str(r), "1", "True") for r in range(1, 7)], out[-3000:]


def test_join_after_traced_steps_is_carried_as_horovods_joined_allreduce():
    """A rank that joins after two tf.function steps: the other rank's third step gives Horovod's
    joined result for allgather (Average, Sum), scatter_allgather and error feedback, counted as
    joined exchanges. The control vector is reduced at every step (not folded into a constant when
    the function is optimized), so the join is seen."""
    scenarios, out = tape_launch(2, "gloo")
    assert "join-traced" in scenarios and ok_count(out, "join-traced") == 2, out[-3000:]


KERAS3 = ["keras3", "keras3-tape", "keras3-tape-none", "keras3-fit", "keras3-fit-none", "keras3-pqasgd"]
# the TensorFlow forms of DQSGD and dist-EF-SGDM, step by step against their re-statements: both at
# 2 ranks (Gloo); dist-EF-SGDM's server residuals also at 4 (four chunks), DQSGD on MPI
ALGORITHMS = {(2, "gloo"): ["dqsgd", "keras3-efsgdm"], (4, "gloo"): ["keras3-efsgdm"], (2, "mpi"): ["dqsgd"]}
# the uncompressed controls (the mean through the same tape and fit; nested and local sources) run at
# 2 ranks: at 4 they checked Horovod's own mean again, 19 s of the 4-rank job on 2 cores
CONTROLS = ["keras3-tape-none", "keras3-fit-none"]


@pytest.mark.parametrize("np_,controller", [(2, "gloo"), (4, "gloo"), (2, "mpi")])
def test_keras3_tape_and_fit_equal_single_process_decode_on_every_rank(np_, controller):
    """Keras 3 (no legacy flag): Horovod's tape over tf_variables; hvd_qsgd.tensorflow's tape over the
    model's own variables; model.fit with hvd_qsgd.tensorflow.keras.DistributedOptimizer and its
    callbacks; each with QSGD(4), and at 2 ranks with hvd.Compression.none; PQASGD step by step;
    DQSGD and dist-EF-SGDM (``ALGORITHMS``) step by step."""
    scenarios = [s for s in KERAS3 if np_ == 2 or s not in CONTROLS] + ALGORITHMS[(np_, controller)]
    out = launch(np_, controller, [WORKER] + scenarios, timeout=420)
    for s in scenarios:
        assert ok_count(out, s) == np_, f"{s}:\n{out[-3000:]}"


@pytest.mark.parametrize("kind,pattern", [
    ("bits", r"InvalidArgumentError: hvd_qsgd: .*ranks disagree on the compressor settings: ranks use different "
             r"compressor settings \(bits, bucket_size"),
    # the swap mismatches both exchanges; TensorFlow decodes them concurrently, so either one
    # reports first: rank 0 traced (20000, 30000), rank 1 (30000, 20000)
    ("order", r"InvalidArgumentError: hvd_qsgd: .*payloads disagree on numel "
              r"\(rank 0: (20000, rank 1: 30000|30000, rank 1: 20000)\); the ranks handed different tensors"),
    # rank 0 made one compressor more (the ranks waited forever: Horovod's allreduce names differed)
    ("creation-order", r"InvalidArgumentError: hvd_qsgd: .*ranks disagree on the compressor creation order"),
    # a rank without the compressor: Horovod's own check of the allreduced tensors' dtypes; a rank
    # whose op is still pending when another has stopped gets Horovod's shutdown error
    ("no-compression", r"Error: (Mismatched data types: One rank had type float(32|64), but another rank had "
                       r"type float(64|32)|Horovod has been shut down)"),
])
def test_mismatch_fails_the_step_on_every_rank(kind, pattern):
    scenario = f"mismatch-{kind}"
    out = step_failures_launch(SHARED_LAUNCH if scenario in SHARED_LAUNCH else (scenario,))
    raised = raised_in(out, scenario)
    assert sorted(r for r, _ in raised) == [0, 1], out[-3000:]
    for _, msg in raised:
        assert re.search(pattern, "RAISED " + msg), msg


# One launch runs the two mismatches, then the join scenario: each error fails a step after its
# exchange completed, so Horovod is whole for the next. Horovod's own dtype error leaves a tensor
# pending on one rank: "no-compression" runs in a launch of its own.
SHARED_LAUNCH = ("mismatch-bits", "mismatch-order", "mismatch-creation-order", "join")


def step_failures_launch(scenarios):
    return launch_once(2, "gloo", (WORKER, *scenarios), timeout=60 + 30 * len(scenarios))


def test_join_carries_eager_exchanges_as_horovods_joined_allreduce():
    out = step_failures_launch(SHARED_LAUNCH)
    assert ok_count(out, "join") == 2, out[-3000:]


def test_join_off_steps_without_the_conditional_and_fails_the_step_a_join_would_take():
    """QSGD(4, join=False): a traced step every rank takes gives the ranks' mean; when rank 1 then
    joins, rank 0's next step fails, naming the setting (its conditional-free chain cannot carry a
    join), and Horovod stops the joined rank. (A launch of its own: the join shuts Horovod down.)"""
    out = step_failures_launch(("mismatch-join-off",))
    raised = dict(raised_in(out, "mismatch-join-off"))
    assert sorted(raised) == [0, 1], out[-3000:]
    assert re.search(r"InvalidArgumentError: hvd_qsgd: .*1 rank\(s\) of the set have joined \(hvd.join\), and the "
                     r"compressor was made with join=False.*pass join=True", raised[0]), raised[0]
    assert "Horovod has been shut down" in raised[1], raised[1]


SCATTER = ["scatter-tape", "scatter-eager", "elias", "auto"]


@pytest.mark.parametrize("np_,controller", [(3, "gloo"), (4, "gloo"), (3, "mpi")])
def test_scatter_allgather_equals_the_reduction_simulation_on_every_rank(np_, controller):
    """scatter_allgather and auto: tf.function tape steps with uneven and empty chunks, error
    feedback, eager Average / Sum / fp16, Elias payloads of per-rank lengths under both reductions,
    and the statistics, each exact against the single-process reference on every rank (the worker
    asserts). At -np 3 with Gloo the same job then runs the two mismatches of this reduction: ranks with
    different ``reduction`` settings fail the control check on every rank; a tensor of another shape
    (same size) makes every rank's reduce fail, and every rank, having joined the phase-2 allgather
    with an empty chunk, raises naming the ranks that could not reduce."""
    mismatches = ["mismatch-reduction", "mismatch-fingerprint"] if (np_, controller) == (3, "gloo") else []
    out = launch(np_, controller, [WORKER] + SCATTER + mismatches, timeout=300)
    for s in SCATTER:
        assert ok_count(out, s) == np_, f"{s}:\n{out[-3000:]}"
    if not mismatches:
        return
    raised = re.findall(r"^\[(\d+)\]<stdout>:(RAISED .*)$", out, flags=re.M)
    settings = [int(r) for r, m in raised if re.search(
        r"InvalidArgumentError: hvd_qsgd: .*ranks disagree on the compressor settings", m)]
    reduce = [int(r) for r, m in raised if re.search(
        r"InvalidArgumentError: hvd_qsgd: .*rank\(s\) \[0, 1, 2\] could not reduce their chunk; this rank's "
        r"reason: reducing chunk [0-2]: the ranks' payloads disagree on fingerprint", m)]
    assert sorted(settings) == [0, 1, 2] and sorted(reduce) == [0, 1, 2] and len(raised) == 6, out[-3000:]


IDENTITY = r'''
import os, sys, json
import numpy as np
import tensorflow as tf
import torch
from hvd_qsgd import codec, protocol
from hvd_qsgd.tensorflow import ops
rng = np.random.default_rng(3)
cases = []
for n, bits, bucket, coding, dtype in [(20000, 4, 512, "fixed", "float32"), (12345, 2, 128, "fixed", "float32"),
                                       (70001, 8, 512, "fixed", "float16"), (4096, 3, 100, "elias", "float32"),
                                       (30000, 2, 2048, "elias", "bfloat16"), (1000, 1, 64, "fixed", "float32")]:
    x32 = (rng.standard_normal(n) * 3).astype(np.float32)
    tdtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    xt = torch.from_numpy(x32).to(tdtype)            # the same values in each framework
    xtf = tf.cast(tf.constant(x32), dtype)
    base = protocol.exchange_seed(5, 1, "e")
    seed = protocol.payload_seed(5, 1, "e", 7)
    fp = codec.tensor_fingerprint("w", (n,), dtype)
    p_np = codec.encode(xt.float().numpy(), bits, bucket, "max", seed, coding, fp, True, source_dtype=dtype)
    p_tf = ops.load().qsgd_encode(xtf, tf.constant(7, tf.int64), bits=bits, bucket_size=bucket,
                                  coding=codec.CODINGS[coding], dtype_code=codec.DTYPE_NAMES.index(dtype),
                                  seed=ops.as_int64_attr(base), fingerprint=ops.as_int64_attr(fp)).numpy()
    sums = [codec.decode_sum([p_np, p_np], 0.5),
            ops.load().qsgd_decode_sum(tf.constant(np.concatenate([p_tf, p_tf])), tf.constant(0.5), count=2,
                                       numel=n, bits=bits, bucket_size=bucket, coding=codec.CODINGS[coding],
                                       dtype_code=codec.DTYPE_NAMES.index(dtype),
                                       fingerprint=ops.as_int64_attr(fp)).numpy()]
    cases.append(dict(n=n, bits=bits, coding=coding, dtype=dtype, same_bytes=bool(np.array_equal(p_np, p_tf)),
                      same_sum=bool(np.array_equal(sums[0], sums[1])), nbytes=int(p_tf.size)))
print("RESULT " + json.dumps(cases))
'''


def snippet_cases(code):
    """Run ``code`` in a fresh interpreter (one process per TensorFlow snippet); the cases it prints
    after ``RESULT ``."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=mp_env(), capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1])

XLA = r'''
import json
import tensorflow as tf
import horovod.tensorflow as hvd
import hvd_qsgd
hvd.init()
c = hvd_qsgd.QSGD(4)
v = tf.Variable(tf.ones([20000]))
out = {}
for jit in (True, False):
    @tf.function(jit_compile=jit)
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * v)
        return hvd.DistributedGradientTape(tape, compression=c).gradient(loss, [v])[0]
    try:
        out[str(jit)] = float(tf.reduce_sum(step()).numpy())
    except ValueError as e:
        out[str(jit)] = str(e)
print("RESULT " + json.dumps(out))
'''


def test_a_tape_step_compiled_with_xla_is_refused_where_it_is_traced():
    """tf.function(jit_compile=True) around a tape step: refused where it is traced, saying what to
    change (it failed at run time naming the package's Timestamp op, which has no XLA kernel); the
    same step without XLA runs."""
    out = snippet_cases(XLA)
    assert "XLA-compiled function (jit_compile=True)" in out["True"] and "jit_compile=False" in out["True"], out
    assert out["False"] == 40000.0, out   # (one rank: the average of 2 * ones, quantized exactly)


def test_tensorflow_ops_and_the_torch_binding_produce_identical_payloads():
    """Same input (converted to each framework's fp32/fp16/bf16), bits, bucket, coding and seed: the
    TensorFlow op's payload equals the PyTorch path's (codec.encode of the torch tensor) byte for
    byte, and QsgdDecodeSum equals codec.decode_sum exactly."""
    cases = snippet_cases(IDENTITY)
    assert len(cases) == 6
    for c in cases:
        assert c["same_bytes"] and c["same_sum"], c
    assert cases[0]["nbytes"] == codec.payload_nbytes(20000, 4, 512)


CHUNK_OPS = r'''
import json
import numpy as np
import tensorflow as tf
from hvd_qsgd import codec, protocol, reduction
from hvd_qsgd.settings import Settings
from hvd_qsgd.tensorflow import ops
o = ops.load()
cases = []
for n, d, bits, coding, dtype in [(3, 20000, 4, "fixed", "float32"), (4, 1000, 4, "elias", "float32"),
                                  (3, 700, 2, "fixed", "float16"), (3, 50001, 3, "elias", "bfloat16")]:
    s = Settings.make(bits, coding=coding)
    fp = codec.tensor_fingerprint("w", (d,), dtype)
    attrs = dict(bits=bits, bucket_size=s.bucket_size, coding=codec.CODINGS[coding], dtype_code=codec.DTYPES[dtype],
                 fingerprint=ops.as_int64_attr(fp), world=n)
    xs = [tf.cast(np.random.default_rng(r).standard_normal(d).astype(np.float32) * (r + 1), dtype) for r in range(n)]
    occ = tf.constant(3, tf.int64)
    base = [ops.as_int64_attr(protocol.exchange_seed(7, r, "e")) for r in range(n)]
    ref, sent, reduced = reduction.simulate([tf.cast(x, tf.float32).numpy() for x in xs], s,
                                            [protocol.payload_seed(7, r, "e", 3) for r in range(n)], 1.0 / n, fp, dtype)
    ok = True
    for r in range(n):
        p, sp = o.qsgd_encode_chunks(xs[r], occ, seed=base[r], **attrs)
        ok &= np.array_equal(p.numpy(), np.concatenate(sent[r])) and sp.numpy().tolist() == [len(c) for c in sent[r]]
    mine = []
    for j in range(n):
        part = [sent[r][j] for r in range(n)]
        p, err = o.qsgd_reduce_chunk(np.concatenate(part), [len(c) for c in part], occ, seed=base[j], chunk=j,
                                     numel=d, **attrs)
        ok &= err.numpy() == b"" and np.array_equal(p.numpy(), reduced[j])
        mine.append(p.numpy())
    out = o.qsgd_decode_chunks(np.concatenate(mine), [len(q) for q in mine], 1.0 / n, "", numel=d, **attrs)
    ok &= np.array_equal(out.numpy(), ref)
    # a bad chunk: the reduce does not raise, it returns an empty payload and the reason
    bad = [sent[r][0] for r in range(n)]
    bad[1] = bad[1][:-1]
    p, err = o.qsgd_reduce_chunk(np.concatenate(bad), [len(b) for b in bad], occ, seed=base[0], chunk=0, numel=d,
                                 **attrs)
    reduce_error = err.numpy().decode()
    ok &= p.shape == (0,)
    try:
        o.qsgd_decode_chunks(np.concatenate(mine[1:]), [0] + [len(q) for q in mine[1:]], 1.0, reduce_error,
                             numel=d, **attrs)
        decode_error = ""
    except tf.errors.InvalidArgumentError as e:
        decode_error = e.message
    g = tf.function(lambda x: o.qsgd_encode_chunks(x, occ, seed=0, **attrs)).get_concrete_function(
        tf.TensorSpec([d], dtype)).structured_outputs
    cases.append(dict(n=n, ok=bool(ok), reduce_error=reduce_error, decode_error=decode_error,
                      payloads_shape=g[0].shape.as_list(), splits_shape=g[1].shape.as_list(),
                      static=int(sum(len(c) for c in sent[0])) if coding == "fixed" else None))
print("RESULT " + json.dumps(cases))
'''


def test_chunk_ops_equal_the_reduction_module_and_report_failures_without_raising():
    """QsgdEncodeChunks, QsgdReduceChunk and QsgdDecodeChunks give the bytes and values of
    hvd_qsgd.reduction (fixed and Elias, fp32/fp16/bf16, uneven and empty chunks); a truncated
    payload makes QsgdReduceChunk return an empty payload and its reason (no error raised), and
    QsgdDecodeChunks then fails naming the rank with the empty slot and this rank's reason; the
    phase-1 length is static for the fixed coding."""
    cases = snippet_cases(CHUNK_OPS)
    assert len(cases) == 4
    for c in cases:
        assert c["ok"], c
        assert re.fullmatch(r"tensor: reducing chunk 0: the payload of rank 1 \(\d+ bytes\): .*", c["reduce_error"]), c
        assert re.search(r"tensor: rank\(s\) \[0\] could not reduce their chunk; this rank's reason: "
                         r"reducing chunk 0: the payload of rank 1", c["decode_error"]), c
        assert c["splits_shape"] == [c["n"]], c
        assert c["payloads_shape"] == [c["static"]], c



ERROR_FEEDBACK_OPS = r"""
import json
import numpy as np
import tensorflow as tf
from hvd_qsgd import codec, error_feedback, protocol, reduction
from hvd_qsgd.settings import Settings
from hvd_qsgd.tensorflow import ops
o = ops.load()
rng = np.random.default_rng(11)
cases = []
for d, bits, coding, dtype, factor, world in [(20000, 4, "fixed", "float32", 1.0, 3), (70001, 8, "fixed", "float16", 0.5, 2),
                                              (4096, 3, "elias", "float32", 2.0, 4), (30000, 2, "elias", "bfloat16", 1.0, 3),
                                              (1000, 1, "fixed", "float32", 0.25, 2)]:
    s = Settings.make(bits, coding=coding)
    fp = codec.tensor_fingerprint("w", (d,), dtype)
    x = tf.cast(tf.constant((rng.standard_normal(d) * 3).astype(np.float32)), dtype)
    x32 = tf.cast(x, tf.float32).numpy()
    x32[5], x32[d // 2] = np.nan, np.inf          # their buckets decode non-finite
    x = tf.cast(tf.constant(x32), dtype)
    r = (0.1 * rng.standard_normal(d)).astype(np.float32)
    e = r * np.float32(factor)                    # the residual as it is worth now
    base = protocol.exchange_seed(5, 1, "e")
    seed = protocol.step_seed(base, 7)
    attrs = dict(bits=bits, bucket_size=s.bucket_size, coding=codec.CODINGS[coding], dtype_code=codec.DTYPES[dtype],
                 seed=ops.as_int64_attr(base), fingerprint=ops.as_int64_attr(fp))
    occ = tf.constant(7, tf.int64)
    # the worker's encode: the PyTorch/NumPy path's native call on the same values
    want_e = e.copy()
    want_p = error_feedback.encode(codec.prepare(d, bits, s.bucket_size, "max", coding, fp, True, dtype), x32, seed,
                                   want_e)
    v = tf.Variable(r)
    held = v.read_value()   # a read still alive: the op updates a copy of its own (the variable's)
    p = o.qsgd_encode_ef(x, occ, v.handle, tf.constant(factor), **attrs)
    new = v.numpy()
    kept = ~np.isfinite(x32 + e - codec.decode(want_p))
    case = dict(d=d, coding=coding, dtype=dtype, same_bytes=bool(np.array_equal(p.numpy(), want_p)),
                same_residual=bool(np.array_equal(new, want_e)), kept=int(kept.sum()),
                kept_rescaled=bool(np.array_equal(new[kept], e[kept])), finite=bool(np.isfinite(new).all()),
                read_unchanged=bool(np.array_equal(held.numpy(), r)))
    # phase 1 of scatter_allgather (no read alive: updated in place)
    want_c = e.copy()
    buf, lens = reduction.encode_chunks(x32, s, seed, world, fp, dtype, residual=want_c)
    v = tf.Variable(r)
    pc, sp = o.qsgd_encode_chunks_ef(x, occ, v.handle, tf.constant(factor), world=world, **attrs)
    case.update(same_chunks=bool(np.array_equal(pc.numpy(), buf)) and sp.numpy().tolist() == [int(v) for v in lens],
                same_chunk_residual=bool(np.array_equal(v.numpy(), want_c)))
    # a residual of another size fails the op, naming the tensor
    errors = []
    for call in (lambda: o.qsgd_encode_ef(x, occ, tf.Variable(tf.zeros([d + 1])).handle, tf.constant(1.0),
                                          where="layer1.w", **attrs),
                 lambda: o.qsgd_encode_chunks_ef(x, occ, tf.Variable(tf.zeros([d - 1])).handle, tf.constant(1.0),
                                                 where="layer1.w", world=world, **attrs)):
        try:
            call()
            errors.append("")
        except tf.errors.InvalidArgumentError as err:
            errors.append(err.message)
    case["errors"] = errors
    cases.append(case)
print("RESULT " + json.dumps(cases))
"""


def test_the_error_feedback_ops_equal_the_pytorch_paths_native_call():
    """QsgdEncodeEf and QsgdEncodeChunksEf (error feedback in one op, the residual's variable updated
    in place) give the payload bytes and the residual bits of the PyTorch/NumPy path's native calls
    (error_feedback.encode, reduction.encode_chunks with a residual) on the same values: fixed and
    Elias, fp32/fp16/bf16, a residual worth 1, 0.5, 2 or 0.25 times its value (learning-rate
    following). Where a bucket decodes non-finite, the new residual keeps the rescaled value, as
    PyTorch's does. A read of the variable taken before the op keeps its value. A residual of
    another size fails the op with a message naming the tensor."""
    cases = snippet_cases(ERROR_FEEDBACK_OPS)
    assert len(cases) == 5
    for c in cases:
        assert c["same_bytes"] and c["same_residual"] and c["same_chunks"] and c["same_chunk_residual"], c
        assert c["kept"] > 0 and c["kept_rescaled"] and c["finite"] and c["read_unchanged"], c
        assert re.search(r"layer1\.w: its error-feedback residual has \d+ elements, the tensor " + str(c["d"]),
                         c["errors"][0]), c
        assert re.search(r"layer1\.w: its error-feedback residual has \d+ elements", c["errors"][1]), c

def test_the_tensorflow_op_library_was_built():
    here = os.path.join(ROOT, "hvd_qsgd", "tensorflow")
    assert any(f.startswith("_qsgd_ops") and f.endswith(".so") for f in os.listdir(here))


CONTROL_VECTOR = r'''
import json
import numpy as np
import tensorflow as tf
from tensorflow.python.framework import op_def_registry
from hvd_qsgd.tensorflow import ops
o = ops.load()
table = np.arange(12, dtype=np.float64).reshape(3, 4) + 0.5
cases = dict(stateful=op_def_registry.get("QsgdControlVector").is_stateful,
             rows=[o.qsgd_control_vector(table, np.int32(i)).numpy().tolist() for i in range(3)],
             traced=tf.function(lambda i: o.qsgd_control_vector(tf.constant(table), i))(tf.constant(2)).numpy().tolist())
try:
    o.qsgd_control_vector(table, np.int32(3), where="hvd_qsgd: compressed tensor w")
    cases["raised"] = None
except tf.errors.InvalidArgumentError as e:
    cases["raised"] = e.message

# QsgdCheckControl's verdicts on vectors reduced over some of a 4-rank set's ranks, against the
# PyTorch runner's (protocol.check_control / joined_verdict)
from hvd_qsgd import protocol
world, ranks = 4, [0, 1, 2, 3]
def vec(g, settings_tag=7):
    return protocol.control_vector(world, g, g, protocol.exchange_tags(world, 0, settings_tag, 5))
def verdict(r, sum_join):
    try:
        alpha, joined = o.qsgd_check_control(tf.constant(r), world=world, set_ranks=ranks,
                                             tag_names=[protocol.tag_explanation(n) for n in protocol.TAG_NAMES],
                                             where="hvd_qsgd: compressed tensor w",
                                             sum_join=sum_join)
        return [float(alpha.numpy()), bool(joined.numpy())]
    except tf.errors.InvalidArgumentError as e:
        return e.message
def python_verdict(r):
    try:
        return [protocol.check_control(r, world, ranks, "w"), False]
    except protocol.MismatchError:
        try:
            v = protocol.joined_verdict(r, world, ranks, "w")
        except protocol.MismatchError as e:
            return str(e)
        return None if v is None else [v[1], True, v[0], v[2]]
some = vec(0) + vec(2)
vectors = {"all, average": sum(vec(g) for g in ranks) / 4, "0 and 2, sum": some, "0 and 2, average over the set": some / 4,
           "0 and 2, average over them": some / 2, "0 and 2, settings differ": vec(0) + vec(2, settings_tag=8),
           "0 alone, sum": vec(0), "weighted (Adasum)": 0.75 * vec(0) + 0.25 * vec(1) + 0.5 * (vec(2) + vec(3))}
cases["verdicts"] = {k: [verdict(r, False), verdict(r, True), python_verdict(r)] for k, r in vectors.items()}
print("RESULT " + json.dumps(cases))
'''


@functools.lru_cache(maxsize=None)
def control_op_cases():
    """The control ops' cases (one TensorFlow process for the two tests that read them)."""
    return snippet_cases(CONTROL_VECTOR)


def test_the_control_vector_op_is_stateful_and_returns_the_row_asked_for():
    """QsgdControlVector: a stateful op (TensorFlow never folds it, nor the allreduce of its result,
    into a constant), its table's row ``index`` eagerly and traced, and an index out of range an
    error naming the tensor."""
    c = control_op_cases()
    assert c["stateful"] is True
    assert c["rows"] == [[4 * i + k + 0.5 for k in range(4)] for i in range(3)]
    assert c["traced"] == c["rows"][2]
    assert "compressed tensor w" in c["raised"] and "control vector 3 of 3" in c["raised"], c["raised"]


def test_the_control_check_op_tells_a_join_from_a_smaller_set_as_the_pytorch_runner_does():
    """QsgdCheckControl on vectors reduced over ranks 0 and 2 of a 4-rank set: averaged over the set,
    a join (alpha 1/4, joined) wherever the compressor's set came from; summed, a join only where the
    set is Horovod's own (``sum_join``), else an error naming both causes; averaged over the two
    alone, an allreduce over a smaller set, naming its ranks; a settings disagreement among them, that
    error; a weighted sum over no set of ranks (Adasum), the op. The
    PyTorch runner's verdicts (protocol.check_control, joined_verdict) agree: the same native check."""
    v = control_op_cases()["verdicts"]
    assert v["all, average"] == [[0.25, False], [0.25, False], [0.25, False]], v
    assert v["0 and 2, average over the set"] == [[0.25, True], [0.25, True], [0.25, True, [0, 2], True]], v
    tf_sum, tf_sum_join, torch_sum = v["0 and 2, sum"]
    assert "hvd.join" in tf_sum and "smaller process set" in tf_sum and "took no part" in tf_sum, tf_sum
    assert tf_sum_join == [1.0, True] and torch_sum == [1.0, True, [0, 2], False], v
    assert v["0 alone, sum"][1] == [1.0, True] and v["0 alone, sum"][2] == [1.0, True, [0], False], v
    tf_error, tf_error_too, python = v["0 and 2, average over them"]
    assert "reduced over global ranks [0, 2], but the compressor's process set is [0, 1, 2, 3]" in tf_error, v
    assert tf_error == tf_error_too and python is None, v
    # a weighted sum that is no sum over any ranks (Adasum's): the op named, as the runner names it
    # (it was blamed on the process set)
    tf_error, tf_error_too, python = v["weighted (Adasum)"]
    assert python is None, v   # (not a join: the runner raises check_control's own error, the op's)
    for said in (tf_error, tf_error_too):
        assert "the reduction op is not a sum or an average" in said and "Adasum" in said, v
    tf_error, tf_error_too, python = v["0 and 2, settings differ"]
    assert "ranks disagree on the compressor settings" in tf_error and tf_error == tf_error_too, v
    assert "ranks disagree on the compressor settings" in python, v
    assert python.split(": ranks disagree", 1)[1] in tf_error, (python, tf_error)   # the same hint


ENCODER = r'''
import json
import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd
import hvd_qsgd
import hvd_qsgd.tensorflow
from hvd_qsgd import codec
from hvd_qsgd.tensorflow import ops
hvd.init()   # one process: the exchange runs its ops on this rank's payloads alone
o = ops.load()
reduced = []   # (what the adapter passed as encoder=, the reduced payload) of every eager reduce step
real_reduce = o.qsgd_reduce_chunk
def recording_reduce(*args, **kwargs):
    out = real_reduce(*args, **kwargs)
    reduced.append(out[0].numpy())
    return out
o.qsgd_reduce_chunk = recording_reduce
x = tf.constant(np.random.default_rng(0).standard_normal(20000).astype(np.float32))
cases = []
for kw in ({}, {"encoder": 1}, {"encoder": 2}):
    for red in ("allgather", "scatter_allgather"):
        reduced.clear()
        c = hvd_qsgd.tensorflow.QSGD(4, reduction=red, **kw)
        ctrl, ctx = c.compress(x)   # eager: the encode op's payload(s)
        payload = ctx.exchanges[0].payload
        sent = ([payload.numpy()] if red == "allgather" else codec.split_payloads(payload.numpy(), count=1))
        c.decompress(hvd.allreduce(ctrl, op=hvd.Average), ctx)
        cases.append(dict(setting=kw, reduction=red, sent=[codec.read_header(p).encoder for p in sent],
                          reduced=[codec.read_header(p).encoder for p in reduced]))
    # in a traced step with both error feedbacks: the attr of every encoding op of the graph
    c = hvd_qsgd.tensorflow.QSGD(4, reduction="scatter_allgather", error_feedback=True,
                                 server_error_feedback=True, **kw)
    def traced(v):
        ctrl, ctx = c.compress(v)
        return c.decompress(hvd.allreduce(ctrl, op=hvd.Average), ctx)
    gd = tf.function(traced).get_concrete_function(tf.TensorSpec([20000], tf.float32)).graph.as_graph_def()
    nodes = list(gd.node) + [n for f in gd.library.function for n in f.node_def]   # (and the branches')
    attrs = sorted((n.op, n.attr["encoder"].i) for n in nodes
                   if n.op in ("QsgdEncode", "QsgdEncodeEf", "QsgdEncodeChunks", "QsgdEncodeChunksEf",
                               "QsgdReduceChunk", "QsgdReduceChunkEf"))
    cases.append(dict(setting=kw, reduction="traced", ops=attrs))
print("RESULT " + json.dumps(cases))
'''


def test_the_encoder_setting_reaches_the_tensorflow_ops():
    """hvd_qsgd.tensorflow.QSGD(encoder=...) hands the setting to every encoding op: the payloads of
    the encode ops and of the reduce step (eager, allgather and scatter_allgather) record it in their
    header (2 by default), and in a traced step with both error feedbacks every QsgdEncodeChunksEf
    and QsgdReduceChunkEf op carries it as its attr (and no encoding op without error feedback is
    left in that graph)."""
    cases = snippet_cases(ENCODER)
    assert len(cases) == 9
    for c in cases:
        want = c["setting"].get("encoder", 2)
        if c["reduction"] == "traced":
            assert c["ops"] == [["QsgdEncodeChunksEf", want], ["QsgdReduceChunkEf", want]], c
        else:
            assert c["sent"] == [want], c
            assert c["reduced"] == ([want] if c["reduction"] == "scatter_allgather" else []), c


TALLY = r'''
import json
import tensorflow as tf
from hvd_qsgd import _tf_ops
ops = _tf_ops.load()
counts = [tf.Variable(0, dtype=tf.int64), tf.Variable(100, dtype=tf.int64)]
time = tf.Variable(0.0, dtype=tf.float64)

def tally(a, b):
    return ops.qsgd_tally(counters=[v.handle for v in counts], amounts=[a, b], timers=[time.handle],
                          stamps=[tf.constant(x, tf.float64) for x in (1.0, 1.5, 2.0, 4.0)],
                          constants=[10, 0], amount_into=[0, 0], stamp_into=[0, 0])

cases = []
before = counts[0].read_value()          # a read alive while the op adds: keeps its value
tally(tf.constant(5, tf.int64), tf.constant(7, tf.int64))
cases.append(dict(eager=[int(v.numpy()) for v in counts], time=float(time.numpy()), before=int(before.numpy())))
traced = tf.function(lambda: tally(tf.constant(1, tf.int64), tf.constant(2, tf.int64)) and None)
traced(); traced()
cases.append(dict(traced=[int(v.numpy()) for v in counts], time=float(time.numpy())))
errors = []
for bad in (dict(constants=[0, 0], amount_into=[2]), dict(constants=[0], amount_into=[0])):
    try:
        ops.qsgd_tally(counters=[v.handle for v in counts], amounts=[tf.constant(1, tf.int64)], timers=[],
                       stamps=[], stamp_into=[], **bad)
    except (tf.errors.InvalidArgumentError, ValueError) as e:
        errors.append(str(e).splitlines()[0])
try:   # a float counter
    ops.qsgd_tally(counters=[time.handle], amounts=[], timers=[], stamps=[], constants=[1], amount_into=[],
                   stamp_into=[])
except tf.errors.InvalidArgumentError as e:
    errors.append(str(e).splitlines()[0])
cases.append(dict(errors=errors))
print("RESULT " + json.dumps(cases))
'''


def test_the_tally_op_adds_a_scopes_counts_and_times_to_their_variables():
    """QsgdTally, the op a scope's statistics become (``tally.Tally``): each counter gets its
    constant and the amounts directed to it, each timer the differences of its pairs of stamps;
    a read of a counter taken before the op keeps its value; the same eagerly and traced; attrs
    that do not match the inputs, and a counter that is not an int64 scalar, are errors."""
    eager, traced, errors = snippet_cases(TALLY)
    assert eager == dict(eager=[22, 100], time=2.5, before=0), eager
    assert traced == dict(traced=[22 + 2 * 13, 100], time=7.5), traced
    assert len(errors["errors"]) == 3, errors
    assert "amount_into out of range" in errors["errors"][0], errors
    assert "constants must name every counter" in errors["errors"][1], errors
    assert "not an initialized int64 scalar" in errors["errors"][2], errors


UNORDERED = r'''
import json
import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd
import hvd_qsgd.tensorflow
hvd.init()   # one process: the step is traced, not run across ranks
cases = []
for red, join in (("allgather", True), ("scatter_allgather", True), ("allgather", False)):
    vs = [tf.Variable(np.full(20000, i + 1.0, np.float32)) for i in range(4)]
    c = hvd_qsgd.tensorflow.QSGD(4, reduction=red, error_feedback=True, join=join)
    def step():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * v) for v in vs])
        return hvd.DistributedGradientTape(tape, compression=c).gradient(loss, vs)
    graph = tf.function(step).get_concrete_function().graph
    branches = [op for op in graph.get_operations() if op.type in ("If", "StatelessIf")]
    chained = [(op.name, dep.name) for op in branches for dep in op.control_inputs if dep in branches]
    library = graph.as_graph_def().library.function
    verdicts = [n.attr["_lower_using_switch_merge"].b for f in library for n in f.node_def if n.op == "Case"]
    kinds = [n.op for f in library for n in f.node_def] + [op.type for op in graph.get_operations()]
    cases.append(dict(reduction=red, join=join, branches=len(branches), chained=chained, verdicts=verdicts,
                      tallies=kinds.count("QsgdTally"), assign_adds=kinds.count("AssignAddVariableOp"),
                      stamps=kinds.count("Timestamp")))
print("RESULT " + json.dumps(cases))
'''


def test_a_tape_steps_exchanges_are_not_ordered_by_the_statistics_counters():
    """In a traced DistributedGradientTape step, each gradient's exchange runs in a tf.cond of its own
    (Horovod's), and every one adds to the compressor's statistics counters. TensorFlow orders the
    stateful branches that touch one resource: the counters made each gradient's branch wait for the
    one before, so a step's exchanges ran one after another (docs/performance.md). No branch has
    another among its control inputs (hvd_qsgd.adapters.tensorflow.accumulators). Each exchange's
    join verdict is a Case op that TensorFlow does not lower to switch and merge ops
    (``GraphRun.switch``: lowered, both branches joined the graph optimized at the first step).
    Each scope's statistics are one QsgdTally op (``tally.Tally``): one in compress and one in
    each of the verdict's two branches, a gradient; the only variable additions left are the
    gradients' occurrence counters (before, 13 ``assign_add``s a gradient). With join=False there
    is no verdict conditional: the chain alone, its statistics one op in compress and one in
    decompress."""
    cases = snippet_cases(UNORDERED)
    assert [(c["reduction"], c["join"]) for c in cases] == [("allgather", True), ("scatter_allgather", True),
                                                            ("allgather", False)]
    for c in cases:
        assert c["branches"] == 4 and c["chained"] == [], c
        assert c["verdicts"] == ([False] * 4 if c["join"] else []), c
        assert c["tallies"] == (3 if c["join"] else 2) * 4 and c["assign_adds"] == 4, c


def test_a_wrapper_putting_the_compression_into_hvd_allreduce_is_not_recursed_into(monkeypatch):
    """Code that wraps ``hvd.allreduce`` to put the compression in (as a harness forcing it into
    Horovod's own tests does): the exchange's own collectives are Horovod's ops, not the wrapped
    function, so a traced allreduce (whose branch for joined ranks is always built) runs once through
    the wrapper; it recursed without end. One process: the result is the tensor's own decoded payload."""
    import numpy as np
    import tensorflow as tf
    import horovod.tensorflow as hvd
    import hvd_qsgd
    hvd.init()
    plain, calls = hvd.allreduce, []

    def forced(tensor, *args, **kwargs):
        calls.append(kwargs.get("name"))
        kwargs["compression"] = hvd_qsgd.QSGD(4, min_numel=1, seed=3)
        return plain(tensor, *args, **kwargs)
    monkeypatch.setattr(hvd, "allreduce", forced)
    x = tf.constant(np.linspace(-1.0, 1.0, 600, dtype=np.float32))
    out = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, name="wrapped"))(x)
    assert calls == ["wrapped"], calls
    step = 1.0 / hvd_qsgd.levels(4)   # a level step of a bucket of max-norm 1 at most
    assert out.shape == (600,) and float(tf.reduce_max(tf.abs(out - x))) <= step * (1 + 1e-6)


def test_tf_gradients_in_a_v1_graph_go_through_a_compressed_allreduce_as_through_horovods():
    """In a v1 graph, tf.gradients of hvd.allreduce(x, compression=...) is Horovod's gradient (the
    allreduce of the upstream gradient, scaled alike), where it was None, silently (Horovod's
    test_horovod_allreduce_grad_cpu_process_sets, graph mode)."""
    import numpy as np
    import tensorflow as tf
    import horovod.tensorflow as hvd
    import hvd_qsgd
    hvd.init()
    grads = {}
    for label, compression in (("none", hvd.Compression.none), ("qsgd", hvd_qsgd.QSGD(4, min_numel=1))):
        with tf.Graph().as_default(), tf.compat.v1.Session() as session:
            x = tf.constant(np.linspace(-1, 1, 300, dtype=np.float32))
            outs = [hvd.allreduce(x, compression=compression, op=hvd.Average, name=f"grad.{label}"),
                    hvd.grouped_allreduce([x, 2 * x], compression=compression, op=hvd.Sum)[1]]
            grad = tf.gradients(outs, x, grad_ys=[tf.fill([300], 3.0), tf.fill([300], 5.0)])
            assert grad[0] is not None, label
            grads[label] = session.run(grad[0])
    np.testing.assert_array_equal(grads["qsgd"], grads["none"])
    np.testing.assert_array_equal(grads["none"], np.full(300, 3.0 + 10.0, np.float32))


def test_the_tensorflow_compressor_summarises_its_eager_exchanges(capsys):
    """hvd_qsgd.tensorflow.QSGD has summary() as hvd_qsgd.QSGD does (it had none): eagerly, the
    counters of its exchanges, printed on rank 0; in a traced step its counters are tensors, refused."""
    import tensorflow as tf
    import horovod.tensorflow as hvd
    import hvd_qsgd.tensorflow
    hvd.init()
    c = hvd_qsgd.tensorflow.QSGD(4, min_numel=1)
    hvd.allreduce(tf.ones([3000]), compression=c, name="summarised")
    s = c.summary(print_on_rank0=True)
    assert s["tensors"] == 1 and s["bytes_received"] == 0 and s["codec_s"] > 0, s   # (one rank: nothing received)
    assert capsys.readouterr().out.startswith("hvd_qsgd.tensorflow.QSGD(")

    @tf.function
    def traced():
        return c.summary()
    with pytest.raises(TypeError, match=r"hvd_qsgd.tensorflow.QSGD.summary: the statistics are graph tensors"):
        traced()


def test_a_compressor_is_refused_in_a_second_graph_naming_both():
    """A compressor's TensorFlow state lives where its first exchange made it (a v1 tf.Graph here):
    used eagerly after that, or in another graph, it says so, instead of TensorFlow's "out of scope"
    error naming one of its counter variables."""
    import tensorflow as tf
    import horovod.tensorflow as hvd
    import hvd_qsgd
    hvd.init()
    c = hvd_qsgd.QSGD(4, min_numel=1)
    with tf.Graph().as_default():
        hvd.allreduce(tf.ones([100]), compression=c, name="first")
    with pytest.raises(ValueError, match=r"compressor \d+ was used in tf.Graph 0x[0-9a-f]+, .* and now in eager "
                                         r"execution: make one compressor for each tf.Graph"):
        hvd.allreduce(tf.ones([100]), compression=c, name="eager")
    with tf.Graph().as_default(), pytest.raises(ValueError, match=r"and now in tf.Graph 0x"):
        hvd.allreduce(tf.ones([100]), compression=c, name="second")
    eager = hvd_qsgd.QSGD(4, min_numel=1)
    hvd.allreduce(tf.ones([100]), compression=eager, name="eager")
    tf.function(lambda: hvd.allreduce(tf.ones([100]), compression=eager, name="traced"))()   # both eager: fine
