"""What the digits examples share, whatever the framework.

``examples/pytorch_digits.py``, ``examples/tensorflow2_digits.py`` and ``examples/keras_digits.py``
train the same MLP on scikit-learn's digits with the same flags, data split and shards, and report
the same results. This module holds the parts that do not depend on the framework:

* :func:`parse_args`: the command line (every flag of the three examples);
* :func:`load_data`: the fixed train/test split and this rank's shard, as numpy arrays;
* :func:`make_compression`: ``none``, ``fp16`` or ``hvd_qsgd.QSGD`` from the flags;
* :func:`schedule`, :func:`minibatches`, :func:`announce`, :func:`progress_bar`: the step count,
  the per-rank shuffling, rank 0's first line and progress bar;
* :func:`checksum`: the digest of the parameters whose equality across ranks is checked;
* :func:`bytes_sent`, :func:`results`, :func:`report`: the end of the run -- bytes per step from
  the compressor's stats, the results dict (the JSON keys), the printed summary and the JSON file.

What differs stays in each example: the model, the training step, Horovod's collectives, and how
many bytes an uncompressed element costs (4 in PyTorch, 8 in TensorFlow, whose adapter sends the
uncompressed tensors as float64). The examples are run as scripts (``python examples/x.py``), so
``examples/`` is ``sys.path[0]`` and ``import digits_common`` finds this file wherever they are run
from.
"""
import argparse
import hashlib
import json
import os
import sys

import numpy as np

import hvd_qsgd
from hvd_qsgd import protocol

SPLIT_SEED = 0  # the train/test split is fixed, independent of --seed
TEST_FRACTION = 0.25


def parse_args(argv, description, threads_help):
    """The examples' command line, parsed; ``threads_help`` is the framework's text for --threads."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--compression", choices=("none", "fp16", "qsgd"), default="none")
    p.add_argument("--bits", type=int, default=4, help="QSGD bits per element (default 4)")
    p.add_argument("--bucket-size", type=int, default=None,
                   help="QSGD bucket size (default: the compressor's, 512, or 128 for bits <= 2)")
    p.add_argument("--min-numel", type=int, default=10000,
                   help="QSGD leaves tensors with fewer elements uncompressed (default 10000)")
    p.add_argument("--error-feedback", action="store_true", help="QSGD with error feedback")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--max-steps", type=int, default=None, metavar="N",
                   help="stop after N optimizer steps in total (for quick launch checks)")
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size (default 32)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seed", type=int, default=42,
                   help="model initialisation, shuffling and QSGD randomness (default 42)")
    p.add_argument("--threads", type=int, default=1, help=threads_help)
    p.add_argument("--json", metavar="PATH", help="rank 0 writes the results here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.epochs < 1:
        p.error("--epochs must be at least 1")
    if args.max_steps is not None and args.max_steps < 1:
        p.error("--max-steps must be at least 1")
    return args


def load_data(rank, size):
    """The fixed stratified split, features standardised on the training set; this rank's shard.

    Returns ``((x, y) of this rank's shard, (x, y) of the test set, training set size)``: x float32,
    y int64 numpy arrays. Shards are equal in size (the training set is cut to a multiple of
    ``size``), so every rank takes the same number of steps and the collectives stay matched."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=TEST_FRACTION, stratify=y, random_state=SPLIT_SEED)
    scaler = StandardScaler().fit(x_tr)
    x_tr = scaler.transform(x_tr).astype(np.float32)
    x_te = scaler.transform(x_te).astype(np.float32)
    per_rank = len(x_tr) // size
    if per_rank == 0:
        raise SystemExit(f"[digits] error: {size} ranks but only {len(x_tr)} training samples")
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    shard = (x_tr[lo:hi], y_tr[lo:hi].astype(np.int64))
    test = (x_te, y_te.astype(np.int64))
    return shard, test, len(x_tr)


def make_compression(args, compression, **qsgd_kwargs):
    """The compressor the flags ask for: ``compression`` is the framework's ``hvd.Compression``;
    ``qsgd_kwargs`` go to ``hvd_qsgd.QSGD`` (PyTorch: ``named_parameters``)."""
    if args.compression == "none":
        return compression.none
    if args.compression == "fp16":
        return compression.fp16
    return hvd_qsgd.QSGD(args.bits, bucket_size=args.bucket_size, min_numel=args.min_numel,
                         seed=args.seed, error_feedback=args.error_feedback, **qsgd_kwargs)


def schedule(args, shard_len):
    """``(steps per epoch, total steps, epochs)``: --epochs over a shard of ``shard_len`` samples
    (the last batch of an epoch may be short), cut to --max-steps; epochs counts a started one."""
    steps_per_epoch = (shard_len + args.batch_size - 1) // args.batch_size
    total_steps = steps_per_epoch * args.epochs
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)
    epochs = (total_steps + steps_per_epoch - 1) // steps_per_epoch
    return steps_per_epoch, total_steps, epochs


def minibatches(rng, shard_len, batch_size, total_steps):
    """Yields ``(epoch, indices, end)`` for ``total_steps`` steps: every epoch draws a fresh
    ``rng.permutation(shard_len)`` and cuts it into batches; ``end`` marks an epoch's last step and
    the very last one."""
    steps_per_epoch = (shard_len + batch_size - 1) // batch_size
    step = 0
    epoch = 0
    while step < total_steps:
        order = rng.permutation(shard_len)
        for b in range(steps_per_epoch):
            if step == total_steps:
                break
            step += 1
            yield epoch, order[b * batch_size:(b + 1) * batch_size], (
                b == steps_per_epoch - 1 or step == total_steps)
        epoch += 1


def announce(args, compression, framework, size, n_train, shard_len, n_test, total_steps):
    """Rank 0's first line: the run's settings (``framework``: None for PyTorch, the original)."""
    print(f"[digits] {framework + ' ' if framework else ''}np={size} compression={args.compression}"
          + (f" {compression!r}" if args.compression == "qsgd" else "") + f" train={n_train} "
          f"(shard {shard_len}/rank) test={n_test} steps={total_steps}", flush=True)


def progress_bar(args, compression, total_steps):
    """Rank 0's tqdm bar over the steps, or None with --no-progress."""
    if args.no_progress:
        return None
    from tqdm import tqdm
    # Short enough for an 80-column terminal behind horovodrun's "[0]<stdout>:" prefix.
    desc = f"qsgd{compression.settings.bits}" if args.compression == "qsgd" else args.compression
    return tqdm(total=total_steps, desc=desc, mininterval=0.5, file=sys.stdout,
                bar_format="{desc} {percentage:3.0f}%|{bar:16}| {n_fmt}/{total_fmt} "
                           "[{elapsed}<{remaining}]{postfix}")


def checksum(named_arrays):
    """A 63-bit digest of ``(name, numpy array)`` pairs: each name and the array's bytes, in order."""
    h = hashlib.blake2b(digest_size=8)
    for name, a in named_arrays:
        h.update(name.encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return int.from_bytes(h.digest(), "little") >> 1  # fits a signed int64 tensor


def compressor_stats(args, compression):
    """The QSGD compressor's counters (``compression.stats``), None for ``none`` and ``fp16``."""
    return compression.stats if args.compression == "qsgd" else None


def bytes_sent(args, numel, stats, steps, size, raw_bytes):
    """(bytes this rank sent per step, control-vector bytes per step) of the gradient exchange.

    ``numel``: the number of gradient elements; ``stats``: :func:`compressor_stats`; ``size``: the
    number of ranks; ``raw_bytes``: what one element of an uncompressed tensor costs next to QSGD (4:
    float32 in PyTorch, 8: float64 with the TensorFlow adapter). An error if the counters are not a
    whole number of steps."""
    if args.compression == "none":
        return 4 * numel, 0
    if args.compression == "fp16":
        return 2 * numel, 0
    total = stats["bytes_sent"] + raw_bytes * stats["raw_elements"]
    if total % steps or stats["tensors"] % steps:
        raise SystemExit(f"[digits] error: the compressor's counters {stats} are not a multiple of "
                         f"{steps} steps")
    control = stats["tensors"] // steps * 8 * protocol.control_length(size)
    return total // steps, control


def results(args, compression, named_sizes, *, size, epochs, steps, test_accuracy, per_step,
            control_per_step, train_time, checksums, stats, framework=None,
            raw_bytes_per_element=None, test_loss=None, first_step=None):
    """Rank 0's results, in the order of the JSON keys.

    ``named_sizes``: ``(name, number of elements)`` of every parameter, in order; ``checksums``: the
    :func:`checksum` of every rank. The keys ``framework``, ``raw_bytes_per_element`` (None unless
    QSGD), ``test_loss`` and ``first_step_s`` are there only for the examples that give them (the
    TensorFlow ones)."""
    qsgd = args.compression == "qsgd"
    none_bytes = 4 * sum(n for _, n in named_sizes)
    r = {}
    if framework is not None:
        r["framework"] = framework
    r.update(
        compression=args.compression,
        compressor=repr(compression) if qsgd else None,
        bits=compression.settings.bits if qsgd else None,
        bucket_size=compression.settings.bucket_size if qsgd else None,
        min_numel=compression.settings.min_numel if qsgd else None,
        error_feedback=args.error_feedback if qsgd else None,
        quantized=[name for name, n in named_sizes if n >= args.min_numel] if qsgd else [],
    )
    if raw_bytes_per_element is not None:
        r["raw_bytes_per_element"] = raw_bytes_per_element if qsgd else None
    r.update(np=size, epochs=epochs, batch_size=args.batch_size, lr=args.lr,
             momentum=args.momentum, seed=args.seed, steps=steps, test_accuracy=test_accuracy)
    if test_loss is not None:
        r["test_loss"] = test_loss
    r.update(bytes_per_step=per_step, bytes_per_step_none=none_bytes,
             ratio_vs_none=per_step / none_bytes, control_bytes_per_step=control_per_step,
             train_time_s=train_time)
    if first_step is not None:
        r["first_step_s"] = first_step
    r.update(params_identical=len(set(checksums)) == 1,
             param_checksums=[f"{s:016x}" for s in checksums], stats=stats)
    return r


def report(args, r, what="parameters"):
    """Prints rank 0's summary of :func:`results` ``r``, writes it to --json, and fails (SystemExit)
    if the ranks' parameters differ. ``what``: the word for them ("weights" in Keras)."""
    qsgd = args.compression == "qsgd"
    loss = f" (loss {r['test_loss']:.4f})" if "test_loss" in r else ""
    # The TensorFlow examples say how their uncompressed tensors travel (float64).
    raw = (f"; uncompressed tensors as float{8 * r['raw_bytes_per_element']}"
           if qsgd and r.get("raw_bytes_per_element") else "")
    first = f" (first step {r['first_step_s']:.2f} s)" if "first_step_s" in r else ""
    print(f"[digits] {args.compression}: test accuracy {r['test_accuracy']:.4f}{loss} after "
          f"{r['steps']} steps, {r['bytes_per_step']:,} bytes sent per step by rank 0 "
          f"({r['ratio_vs_none']:.3f} of float32"
          + (f"{raw}; + {r['control_bytes_per_step']} control bytes" if qsgd else "")
          + f"), training {r['train_time_s']:.2f} s{first}, "
          f"{what} bit-identical on all {r['np']} ranks: {r['params_identical']}", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    if not r["params_identical"]:
        raise SystemExit(f"[digits] error: {what} differ across ranks: {r['param_checksums']}")
