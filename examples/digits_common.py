"""What the digits examples share, whatever the framework.

``examples/pytorch_digits.py``, ``examples/tensorflow2_digits.py`` and ``examples/keras_digits.py``
train the same MLP on scikit-learn's digits with the same flags, data split and shards, and report
the same results. This module holds the parts that do not depend on the framework:

* :func:`parse_args`: the command line (every flag of the three examples; the PyTorch example adds
  ``--method`` and its flags, see below);
* :func:`load_data`: the fixed train/test split (:func:`prepared_split`, kept after its first
  computation) and this rank's shard, as numpy arrays;
* :func:`make_compression`: ``none``, ``fp16`` or the package's compressor from the flags;
* :func:`schedule`, :func:`minibatches`, :func:`announce`, :func:`progress_bar`: the step count,
  the per-rank shuffling, rank 0's first line and progress bar;
* :func:`checksum`: the digest of the parameters whose equality across ranks is checked;
* :func:`bytes_so_far`, :func:`bytes_sent`, :func:`results`, :func:`report`: the end of the run --
  bytes sent (so far, and per step) from the compressor's stats, the results dict (the JSON keys),
  the printed summary and the JSON file.

Methods (``--method``, PyTorch only: the example passes ``methods=METHODS`` to :func:`parse_args`;
the TensorFlow and Keras examples take no such flag and always run ``sgd``):

* ``sgd``: ``hvd.DistributedOptimizer`` with ``--compression none|fp16|qsgd`` (the default);
* ``dqsgd``: ``hvd.DistributedOptimizer`` with ``hvd_qsgd.DynamicQSGD(--budget-bits)``;
* ``pqasgd``: ``hvd_qsgd.torch.PeriodicQuantizedAveraging`` over momentum SGD, every ``--period``
  steps, ``hvd_qsgd.QSGD(--bits, default 2)``, ``--pqasgd-momentum local|average|reset``;
* ``efsgdm``: ``hvd_qsgd.torch.EFSGDM`` with ``hvd_qsgd.BlockSign(--block-size)``
  (scatter_allgather, worker and server error feedback: two-way compression).

For a method other than ``sgd``, ``args.compression`` is set to what it sends (``dqsgd``, ``qsgd``
or ``blocksign``); ``--compression`` itself is only for ``sgd``.

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
METHODS = ("sgd", "dqsgd", "pqasgd", "efsgdm")
PQASGD_MOMENTUM = ("local", "average", "reset")
# What a method other than sgd sends (args.compression, the JSON key "compression").
METHOD_COMPRESSION = {"dqsgd": "dqsgd", "pqasgd": "qsgd", "efsgdm": "blocksign"}


def parse_args(argv, description, threads_help, methods=("sgd",), add_flags=None):
    """The examples' command line, parsed; ``threads_help`` is the framework's text for --threads.

    ``methods``: the training methods the example offers; with more than ``sgd`` (the PyTorch
    example: ``METHODS``) the flags ``--method``, ``--budget-bits``, ``--period``,
    ``--pqasgd-momentum`` and ``--block-size`` exist. Without them ``args.method`` is ``"sgd"``.
    ``add_flags(parser)``, when given, adds an example's own flags (and defaults) last."""
    p = argparse.ArgumentParser(description=description)
    if len(methods) > 1:
        p.add_argument("--method", choices=methods, default="sgd",
                       help="sgd: hvd.DistributedOptimizer with --compression (default); dqsgd: "
                            "hvd.DistributedOptimizer with hvd_qsgd.DynamicQSGD(--budget-bits); pqasgd: "
                            "PeriodicQuantizedAveraging, QSGD(--bits) every --period steps; efsgdm: EFSGDM "
                            "with BlockSign(--block-size)")
    p.add_argument("--compression", choices=("none", "fp16", "qsgd"), default=None,
                   help="gradient compression of --method sgd (default none)")
    p.add_argument("--bits", type=int, default=None,
                   help="QSGD bits per element (default 4; 2 for --method pqasgd)")
    p.add_argument("--bucket-size", type=int, default=None,
                   help="QSGD bucket size (default: the compressor's, 512, or 128 for bits <= 2)")
    p.add_argument("--min-numel", type=int, default=10000,
                   help="QSGD leaves tensors with fewer elements uncompressed (default 10000)")
    p.add_argument("--error-feedback", action="store_true", help="QSGD with error feedback")
    p.add_argument("--reduction", choices=("auto", "allgather", "scatter_allgather"), default=None,
                   help="QSGD's reduction (default: the compressor's, auto)")
    if len(methods) > 1:
        p.add_argument("--budget-bits", type=float, default=3.0,
                       help="dqsgd: average bits per quantized coordinate (default 3.0)")
        p.add_argument("--period", type=int, default=4, help="pqasgd: local steps between syncs (default 4)")
        p.add_argument("--pqasgd-momentum", choices=PQASGD_MOMENTUM, default="local",
                       help="pqasgd: the momentum buffers at a sync (default local)")
        p.add_argument("--block-size", type=int, default=512,
                       help="efsgdm: BlockSign block size (default 512)")
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
    if add_flags is not None:
        add_flags(p)
    args = p.parse_args(argv)
    if args.epochs < 1:
        p.error("--epochs must be at least 1")
    if args.max_steps is not None and args.max_steps < 1:
        p.error("--max-steps must be at least 1")
    if len(methods) == 1:
        args.method = methods[0]
    if args.method == "sgd":
        args.compression = args.compression or "none"
    else:
        if args.compression is not None:
            p.error(f"--compression is for --method sgd; --method {args.method} sends "
                    f"{METHOD_COMPRESSION[args.method]}")
        args.compression = METHOD_COMPRESSION[args.method]
        if args.period < 1:
            p.error("--period must be at least 1")
        if args.block_size < 1:
            p.error("--block-size must be at least 1")
    if args.bits is None:
        args.bits = 2 if args.method == "pqasgd" else 4
    return args


def method_label(args):
    """A short name of what trains: ``none``, ``fp16``, ``qsgd4``, ``qsgd2+ef``, ``dqsgd3``,
    ``pqasgd4-qsgd2``, ``efsgdm-blocksign512``."""
    if args.method == "sgd":
        if args.compression != "qsgd":
            return args.compression
        return f"qsgd{args.bits}" + ("+ef" if args.error_feedback else "")
    if args.method == "dqsgd":
        return f"dqsgd{args.budget_bits:g}" + ("+ef" if args.error_feedback else "")
    if args.method == "pqasgd":
        return f"pqasgd{args.period}-qsgd{args.bits}" + ("+ef" if args.error_feedback else "")
    return f"efsgdm-blocksign{args.block_size}"


def uses_compressor(args):
    """Whether the run's gradients (or updates, or model differences) go through a compressor of
    the package (which counts its bytes in ``stats``), rather than none or fp16."""
    return args.compression not in ("none", "fp16")


def _split_cache_path():
    """Where the prepared split is kept: one file per scikit-learn version and split constants (the
    split is a pure function of them), under ``$HVD_QSGD_CACHE`` (default ``~/.cache/hvd_qsgd``)."""
    from importlib.metadata import version
    root = os.environ.get("HVD_QSGD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hvd_qsgd")
    name = f"digits-sklearn{version('scikit-learn')}-test{TEST_FRACTION}-seed{SPLIT_SEED}.npz"
    return os.path.join(root, "datasets", name)


def prepared_split():
    """(x_train, y_train, x_test, y_test): the fixed stratified split, features standardised on the
    training set (float32). Computed with scikit-learn once and kept (``_split_cache_path``); later
    runs load the same arrays, not scikit-learn (about 1.8 s of every rank's start on 2 cores)."""
    path = _split_cache_path()
    try:
        with np.load(path) as f:
            return f["x_tr"], f["y_tr"], f["x_te"], f["y_te"]
    except (OSError, KeyError, ValueError):
        pass  # not kept yet (or unreadable): computed below
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=TEST_FRACTION, stratify=y, random_state=SPLIT_SEED)
    scaler = StandardScaler().fit(x_tr)
    x_tr = scaler.transform(x_tr).astype(np.float32)
    x_te = scaler.transform(x_te).astype(np.float32)
    try:  # whole or not at all: ranks starting together each write their own file, then rename it
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            np.savez(f, x_tr=x_tr, y_tr=y_tr, x_te=x_te, y_te=y_te)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: every run computes the split
    return x_tr, y_tr, x_te, y_te


def load_data(rank, size):
    """The fixed stratified split, features standardised on the training set; this rank's shard.

    Returns ``((x, y) of this rank's shard, (x, y) of the test set, training set size)``: x float32,
    y int64 numpy arrays. Shards are equal in size (the training set is cut to a multiple of
    ``size``), so every rank takes the same number of steps and the collectives stay matched."""
    x_tr, y_tr, x_te, y_te = prepared_split()
    per_rank = len(x_tr) // size
    if per_rank == 0:
        raise SystemExit(f"[digits] error: {size} ranks but only {len(x_tr)} training samples")
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    shard = (x_tr[lo:hi], y_tr[lo:hi].astype(np.int64))
    test = (x_te, y_te.astype(np.int64))
    return shard, test, len(x_tr)


def make_compression(args, compression, **qsgd_kwargs):
    """The compressor the flags ask for: ``compression`` is the framework's ``hvd.Compression``;
    ``qsgd_kwargs`` go to the package's compressor (PyTorch: ``named_parameters``).

    ``sgd``: ``none``, ``fp16`` or ``hvd_qsgd.QSGD``; ``dqsgd``: ``hvd_qsgd.DynamicQSGD``;
    ``pqasgd``: ``hvd_qsgd.QSGD`` (of the model differences); ``efsgdm``: ``hvd_qsgd.BlockSign``."""
    if args.compression == "none":
        return compression.none
    if args.compression == "fp16":
        return compression.fp16
    if getattr(args, "reduction", None) is not None and getattr(args, "method", "sgd") in ("sgd", "dqsgd"):
        qsgd_kwargs["reduction"] = args.reduction
    if args.method == "dqsgd":
        return hvd_qsgd.DynamicQSGD(args.budget_bits, bucket_size=args.bucket_size, min_numel=args.min_numel,
                                    seed=args.seed, error_feedback=args.error_feedback, **qsgd_kwargs)
    if args.method == "efsgdm":
        return hvd_qsgd.BlockSign(block_size=args.block_size, min_numel=args.min_numel, **qsgd_kwargs)
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
    method = f"method={args.method} " if args.method != "sgd" else ""
    print(f"[digits] {framework + ' ' if framework else ''}np={size} {method}compression={args.compression}"
          + (f" {compression!r}" if uses_compressor(args) else "") + f" train={n_train} "
          f"(shard {shard_len}/rank) test={n_test} steps={total_steps}", flush=True)


def progress_bar(args, compression, total_steps):
    """Rank 0's tqdm bar over the steps, or None with --no-progress."""
    if args.no_progress:
        return None
    from tqdm import tqdm
    # Short enough for an 80-column terminal behind horovodrun's "[0]<stdout>:" prefix.
    desc = method_label(args).split("+")[0]
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
    """The compressor's counters (``compression.stats``), None for ``none`` and ``fp16``."""
    return compression.stats if uses_compressor(args) else None


def bytes_so_far(args, numel, stats, steps, raw_bytes=4, extra=0):
    """The bytes this rank has sent in the gradient exchange in its first ``steps`` steps, with
    ``stats`` the compressor's counters then (:func:`compressor_stats`): ``4 * numel`` a step for
    ``none``, ``2 * numel`` for ``fp16``; otherwise the compressor's payload bytes plus ``raw_bytes``
    for every element it left uncompressed. For ``pqasgd`` that counts the syncs only (the local
    steps send nothing); for ``efsgdm`` both phases of scatter_allgather (the chunks a rank sends
    to the others, and its reduced chunk). ``extra``: bytes sent outside the compressor (pqasgd's
    fp32 allreduce of the momentum buffers at each sync with ``--pqasgd-momentum average``)."""
    if args.compression == "none":
        return 4 * numel * steps + extra
    if args.compression == "fp16":
        return 2 * numel * steps + extra
    return stats["bytes_sent"] + raw_bytes * stats["raw_elements"] + extra


def _exact(total, steps):
    """total / steps: an int where it divides, else a float."""
    return total // steps if total % steps == 0 else total / steps


def bytes_sent(args, numel, stats, steps, size, raw_bytes, extra=0):
    """(bytes this rank sent per step, control-vector bytes per step) of the gradient exchange.

    ``numel``: the number of gradient elements; ``stats``: :func:`compressor_stats`; ``size``: the
    number of ranks; ``raw_bytes``: what one element of an uncompressed tensor costs next to QSGD (4:
    float32 in PyTorch, 8: float64 with the TensorFlow adapter). With ``sgd`` and ``efsgdm`` every
    step sends the same: an error if the counters are not a whole number of steps. ``dqsgd`` (bits
    vary by step) and ``pqasgd`` (only syncs send) give the mean over the steps, a float where it
    does not divide. ``extra``: as for :func:`bytes_so_far`, over all the steps."""
    if not uses_compressor(args):
        return bytes_so_far(args, numel, stats, 1, raw_bytes), 0
    total = bytes_so_far(args, numel, stats, steps, raw_bytes, extra)
    control = stats["tensors"] * 8 * protocol.control_length(size)
    if args.method in ("dqsgd", "pqasgd"):
        return _exact(total, steps), _exact(control, steps)
    if total % steps or stats["tensors"] % steps:
        raise SystemExit(f"[digits] error: the compressor's counters {stats} are not a multiple of "
                         f"{steps} steps")
    return total // steps, control // steps


def results(args, compression, named_sizes, *, size, epochs, steps, test_accuracy, per_step,
            control_per_step, train_time, checksums, stats, framework=None,
            raw_bytes_per_element=None, test_loss=None, first_step=None, method_info=None,
            bytes_total=None, curve=None):
    """Rank 0's results, in the order of the JSON keys.

    ``named_sizes``: ``(name, number of elements)`` of every parameter, in order; ``checksums``: the
    :func:`checksum` of every rank. The keys ``framework``, ``raw_bytes_per_element`` (None unless
    QSGD), ``test_loss`` and ``first_step_s`` are there only for the examples that give them (the
    TensorFlow ones); ``method`` with the method's settings (``method_info``), ``bytes_sent_total``
    and ``curve`` (one point per epoch: epoch, step, bytes_sent_so_far, test_accuracy) only for the
    PyTorch one. For ``dqsgd`` ``bits`` is None (they vary; ``budget_bits_per_coord`` is the
    budget), and so is ``bucket_size`` unless --bucket-size fixes it."""
    comp = uses_compressor(args)
    none_bytes = 4 * sum(n for _, n in named_sizes)
    dynamic = args.method == "dqsgd"
    r = {}
    if framework is not None:
        r["framework"] = framework
    if method_info is not None:
        r["method"] = args.method
        r.update(method_info)
    r.update(
        compression=args.compression,
        compressor=repr(compression) if comp else None,
        bits=compression.settings.bits if comp and not dynamic else None,
        bucket_size=(compression.settings.bucket_size
                     if comp and not (dynamic and args.bucket_size is None) else None),
        min_numel=compression.settings.min_numel if comp else None,
        error_feedback=compression.settings.error_feedback if comp else None,
        quantized=[name for name, n in named_sizes if n >= args.min_numel] if comp else [],
    )
    if raw_bytes_per_element is not None:
        r["raw_bytes_per_element"] = raw_bytes_per_element if comp else None
    r.update(np=size, epochs=epochs, batch_size=args.batch_size, lr=args.lr,
             momentum=args.momentum, seed=args.seed, steps=steps, test_accuracy=test_accuracy)
    if test_loss is not None:
        r["test_loss"] = test_loss
    r.update(bytes_per_step=per_step, bytes_per_step_none=none_bytes,
             ratio_vs_none=per_step / none_bytes, control_bytes_per_step=control_per_step,
             train_time_s=train_time)
    if bytes_total is not None:
        r["bytes_sent_total"] = bytes_total
    if first_step is not None:
        r["first_step_s"] = first_step
    r.update(params_identical=len(set(checksums)) == 1,
             param_checksums=[f"{s:016x}" for s in checksums], stats=stats)
    if curve is not None:
        r["curve"] = curve
    return r


def _count(v):
    """A byte count for the summary line: 1,234 (or 1,234.5 for a mean that is not whole)."""
    return f"{v:,}" if isinstance(v, int) else f"{v:,.1f}"


def report(args, r, what="parameters"):
    """Prints rank 0's summary of :func:`results` ``r``, writes it to --json, and fails (SystemExit)
    if the ranks' parameters differ. ``what``: the word for them ("weights" in Keras)."""
    comp = uses_compressor(args)
    loss = f" (loss {r['test_loss']:.4f})" if "test_loss" in r else ""
    # The TensorFlow examples say how their uncompressed tensors travel (float64).
    raw = (f"; uncompressed tensors as float{8 * r['raw_bytes_per_element']}"
           if comp and r.get("raw_bytes_per_element") else "")
    first = f" (first step {r['first_step_s']:.2f} s)" if "first_step_s" in r else ""
    label = args.compression if args.method == "sgd" else method_label(args)
    mean = " (mean)" if args.method in ("dqsgd", "pqasgd") else ""
    print(f"[digits] {label}: test accuracy {r['test_accuracy']:.4f}{loss} after "
          f"{r['steps']} steps, {_count(r['bytes_per_step'])} bytes sent per step{mean} by rank 0 "
          f"({r['ratio_vs_none']:.3f} of float32"
          + (f"{raw}; + {_count(r['control_bytes_per_step'])} control bytes" if comp else "")
          + f"), training {r['train_time_s']:.2f} s{first}, "
          f"{what} bit-identical on all {r['np']} ranks: {r['params_identical']}", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    if not r["params_identical"]:
        raise SystemExit(f"[digits] error: {what} differ across ranks: {r['param_checksums']}")
