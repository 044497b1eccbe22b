"""Worker for tests/test_readme_quickstarts.py: the README's quickstart code blocks, run as written
under ``horovodrun -np 2``.

``python tests/mp/readme_quickstarts.py BLOCK...``, BLOCK among ``pytorch`` (the one ```python block
of "## Quickstart: PyTorch"), ``keras3-fit`` and ``custom-step`` (the first and second ```python
blocks of "## Quickstart: TensorFlow") and ``tf_keras`` (that section's indented code block; only in
a job launched with ``TF_USE_LEGACY_KERAS=1``, since Keras is chosen when TensorFlow is imported).

Each block is read from README.md by its section and its order there (the worker stops, saying what
it found, if a block is missing or the section's blocks changed), and run with ``exec`` in a fresh
namespace a prelude fills with what the block uses but does not show: a tiny model with one weight of
at least ``min_numel`` (10,000) elements, so QSGD quantizes it, an optimizer, a loss, this rank's data
``x, y`` (different on each rank) and the imports. Only the README's literal placeholders are filled
in: ``loss=...`` becomes a real loss, and the ``# ... the usual loop; then:`` comment two real
training steps; every other line runs as the README writes it (compiled under README.md's name and
line numbers, so a traceback points at the README line). After each block a check that could fail;
each rank then prints ``OK <block>``, or ``FAIL <block> <type>: <message>`` (and the traceback on
stderr) and goes on to the next block; the exit status is 0 once every block has its line. A README
whose quickstart sections changed (a block missing, more blocks, a block without what identifies it,
a placeholder gone) stops the worker with exit status 1 and a message saying what it found.
"""
import copy
import os
import sys
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
RANK = int(os.environ.get("HOROVOD_RANK", "0"))   # set by horovodrun; the data differ per rank
STEPS, BATCH, IN, HIDDEN, CLASSES = 4, 32, 64, 256, 4   # HIDDEN * IN = 16,384 >= min_numel
PYTORCH, TORCH_LOOP = "Quickstart: PyTorch", "# ... the usual loop; then:"
TENSORFLOW, LOSS_PLACEHOLDER = "Quickstart: TensorFlow", "loss=..."


# ---- reading the README ----------------------------------------------------------------------

def code_blocks(text):
    """[(section, kind, first line number, code)] of every code block of a Markdown text, in order:
    kind is a fenced block's info string ("python", "" for a bare fence) or "indented"; section is
    the title of the "## " heading above it."""
    lines = text.split("\n")
    blocks, section, i = [], None, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            info, start, i = line[3:].strip(), i + 2, i + 1
            while i < len(lines) and not lines[i].startswith("```"):
                i += 1
            if i == len(lines):
                raise SystemExit(f"README.md: the code fence opened at line {start - 1} is never closed")
            blocks.append((section, info, start, "\n".join(lines[start - 1:i])))
        elif line.startswith("## "):
            section = line[3:].strip()
        elif line.startswith("    ") and line.strip() and (i == 0 or not lines[i - 1].strip()):
            start = i + 1
            while i + 1 < len(lines) and (lines[i + 1].startswith("    ") or not lines[i + 1].strip()):
                i += 1
            body = lines[start - 1:i + 1]
            while not body[-1].strip():
                body.pop()
            blocks.append((section, "indented", start, "\n".join(b[4:] for b in body)))
        i += 1
    return blocks


def readme_block(name):
    """(first line number, code) of the quickstart block ``name``; stops with what the README holds if
    its structure changed."""
    with open(README, encoding="utf-8") as f:
        blocks = code_blocks(f.read())
    where = {"pytorch": (PYTORCH, "python", 0, "hvd.DistributedOptimizer("),
             "keras3-fit": (TENSORFLOW, "python", 0, "model.fit("),
             "custom-step": (TENSORFLOW, "python", 1, "DistributedGradientTape("),
             "tf_keras": (TENSORFLOW, "indented", 0, "import hvd_qsgd.tensorflow.keras as hvd")}
    section, kind, index, marker = where[name]
    expected = {PYTORCH: {"python": 1}, TENSORFLOW: {"python": 2, "indented": 1}}[section]
    found = [(k, line) for s, k, line, _ in blocks if s == section]
    counts = {k: sum(1 for kk, _ in found if kk == k) for k, _ in found}
    if counts != expected:
        raise SystemExit(f"README.md changed: section '## {section}' holds the code blocks {found} "
                         f"(kind, first line), expected {expected}; this worker takes the {name} block "
                         "from there by its order")
    start, code = [(line, c) for s, k, line, c in blocks if s == section and k == kind][index]
    if marker not in code:
        raise SystemExit(f"README.md changed: block {index + 1} ({kind}) of '## {section}' (line {start}) "
                         f"has no '{marker}', which the {name} quickstart had")
    return start, code


def fill(code, placeholder, replacement, name):
    """The code with the README's one literal ``placeholder`` replaced (same number of lines)."""
    if code.count(placeholder) != 1:
        raise SystemExit(f"README.md changed: the {name} block has {code.count(placeholder)} times "
                         f"'{placeholder}', the placeholder this worker fills in (expected once)")
    return code.replace(placeholder, replacement)


# the README's literal placeholders, and what fills them in
PLACEHOLDERS = {"pytorch": (TORCH_LOOP, "_usual_loop()"), "keras3-fit": (LOSS_PLACEHOLDER, "loss=_loss"),
                "custom-step": None, "tf_keras": (LOSS_PLACEHOLDER, "loss=_loss")}


def runnable(name):
    """(first line number, code) of the quickstart block ``name`` with its placeholder filled in."""
    start, code = readme_block(name)
    if PLACEHOLDERS[name] is not None:
        code = fill(code, *PLACEHOLDERS[name], name)
    return start, code


def run_block(name, ns):
    start, code = runnable(name)
    # padded so that line numbers in a traceback are README.md's
    exec(compile("\n" * (start - 1) + code, README, "exec"), ns)
    return ns


# ---- checks ----------------------------------------------------------------------------------

def rank_data(seed, n=STEPS * BATCH):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, IN)).astype(np.float32), rng.integers(0, CLASSES, n)


def same_on_both_ranks(gathered, what):
    rows = np.asarray(gathered)
    if not all(np.array_equal(rows[0], r) for r in rows[1:]):
        raise AssertionError(f"{what} differ between the ranks (largest difference "
                             f"{np.max(np.abs(rows - rows[0])):.3g})")


def tf_identical_weights(model, what, hvd):
    flat = np.concatenate([np.ravel(w) for w in model.get_weights()]).astype(np.float64)
    same_on_both_ranks(hvd.allgather(flat.reshape(1, -1)).numpy(), what)
    return flat


# ---- blocks ----------------------------------------------------------------------------------

def block_pytorch():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(0)        # the same model on both ranks (the block broadcasts nothing)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
    x, y = (torch.from_numpy(a) for a in rank_data(100 + RANK))
    ns = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "torch": torch}
    reference = {}

    def usual_loop(steps=2):
        """Two training steps through the block's (distributed) optimizer; before the last, the exact
        mean of the ranks' gradients from a copy of the model."""
        for step in range(steps):
            if step == steps - 1:
                ref = copy.deepcopy(model)
                F.cross_entropy(ref(x), y).backward()
                reference.update((n, p.grad.detach().clone()) for n, p in ref.named_parameters())
            ns["optimizer"].zero_grad()
            F.cross_entropy(model(x), y).backward()
            ns["optimizer"].step()

    ns["_usual_loop"] = usual_loop
    run_block("pytorch", ns)
    hvd, compression = ns["hvd"], ns["compression"]
    if not compression.stats["bytes_sent"] > 0:
        raise AssertionError(f"compression.stats['bytes_sent'] is {compression.stats['bytes_sent']}")
    for n, p in model.named_parameters():
        grad = p.grad.detach().reshape(1, -1)
        same_on_both_ranks(hvd.allgather(grad, name=f"readme.grad.{n}").numpy(), f"the averaged gradients of {n}")
        exact = hvd.allreduce(reference[n].reshape(1, -1), op=hvd.Average, name=f"readme.ref.{n}")
        if p.numel() >= 10000:  # quantized: unbiased, close to the mean
            err = float(torch.linalg.norm(grad - exact) / torch.linalg.norm(exact))
            if not err < 0.5:
                raise AssertionError(f"the quantized gradient of {n} is {err:.3f} (relative) from the ranks' mean")
        elif not torch.allclose(grad, exact, rtol=1e-5, atol=1e-7):
            raise AssertionError(f"the uncompressed gradient of {n} is not the ranks' mean")
    if compression.stats["elements"] < HIDDEN * IN:
        raise AssertionError(f"QSGD quantized {compression.stats['elements']} elements, fewer than the "
                             f"{HIDDEN * IN} of the first layer's weight")


def keras_model(keras, seed):
    model = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(HIDDEN, activation="relu"),
                              keras.layers.Dense(CLASSES)])
    rng = np.random.default_rng(seed)
    model.set_weights([rng.standard_normal(w.shape).astype(np.float32) * 0.1 for w in model.get_weights()])
    return model


def block_keras3_fit():
    import keras
    import tensorflow as tf

    x, y = rank_data(200 + RANK)
    model = keras_model(keras, 300 + RANK)      # different on each rank: the broadcast callback must act
    ns = {"keras": keras, "tf": tf, "model": model, "x": x, "y": y,
          "_loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True)}
    before = np.concatenate([np.ravel(w) for w in model.get_weights()])
    run_block("keras3-fit", ns)
    hvd = ns["hvd"]
    after = tf_identical_weights(model, "the Keras 3 model's weights after fit", hvd)
    if np.array_equal(after, before):
        raise AssertionError("fit did not change the weights")


def block_custom_step():
    import keras
    import tensorflow as tf
    import horovod.tensorflow as hvd
    import hvd_qsgd
    import hvd_qsgd.tensorflow  # noqa: F401 -- the block uses hvd_qsgd.tensorflow.DistributedGradientTape

    if not hvd.is_initialized():
        hvd.init()
    x, y = rank_data(400 + RANK)
    model = keras_model(keras, 500)             # the same on both ranks (the block broadcasts nothing)

    def loss_fn(labels, logits):                # a Keras loss's order, as the README calls it: loss_fn(y, model(x))
        return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))

    ns = {"tf": tf, "hvd_qsgd": hvd_qsgd, "model": model, "optimizer": keras.optimizers.SGD(0.1),
          "loss_fn": loss_fn}   # (the block makes its compressor, outside its step)
    before = tf_identical_weights(model, "the initial weights", hvd)
    run_block("custom-step", ns)
    for step in range(2):
        ns["train_step"](tf.constant(x[step * BATCH:(step + 1) * BATCH]), tf.constant(y[step * BATCH:(step + 1) * BATCH]))
    after = tf_identical_weights(model, "the weights after two custom steps", hvd)
    if np.array_equal(after, before):
        raise AssertionError("the custom step did not change the weights")
    sent = float(np.asarray(ns["compression"].stats["bytes_sent"]))
    if not sent > 0:
        raise AssertionError(f"compression.stats['bytes_sent'] is {sent}")


def block_tf_keras():
    if os.environ.get("TF_USE_LEGACY_KERAS") != "1":
        raise SystemExit("the tf_keras block runs in a job launched with TF_USE_LEGACY_KERAS=1")
    import tensorflow as tf
    import horovod.tensorflow as htf

    if not tf.keras.__name__.startswith("tf_keras"):
        raise AssertionError(f"tf.keras is {tf.keras.__name__}, not tf_keras")
    x, y = rank_data(600 + RANK)
    model = keras_model(tf.keras, 700 + RANK)   # different on each rank: the broadcast callback must act
    ns = {"tf": tf, "model": model, "x": x, "y": y,
          "_loss": tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)}
    before = np.concatenate([np.ravel(w) for w in model.get_weights()])
    run_block("tf_keras", ns)
    after = tf_identical_weights(model, "the tf_keras model's weights after fit", htf)
    if np.array_equal(after, before):
        raise AssertionError("fit did not change the weights")


BLOCKS = {"pytorch": block_pytorch, "keras3-fit": block_keras3_fit, "custom-step": block_custom_step,
          "tf_keras": block_tf_keras}


def main():
    names = sys.argv[1:]
    unknown = [n for n in names if n not in BLOCKS]
    if not names or unknown:
        raise SystemExit(f"usage: readme_quickstarts.py BLOCK... with BLOCK in {list(BLOCKS)} (got {unknown})")
    if "tf_keras" in names and len(names) > 1:
        raise SystemExit("tf_keras needs a job of its own (TF_USE_LEGACY_KERAS=1)")
    for name in names:
        try:
            BLOCKS[name]()
        except Exception as e:  # noqa: BLE001 -- reported on its line; the test reads it
            print(f"FAIL {name} {type(e).__name__}: {e}".replace("\n", " "), flush=True)
            traceback.print_exc()
            sys.stdout.flush()
        else:
            print(f"OK {name}", flush=True)


if __name__ == "__main__":
    main()
