"""What the elastic workers share (tests/mp/elastic_worker.py for PyTorch, tf_elastic_worker.py for
TensorFlow): the flags, the global batches and their per-rank slices (the same at any world size),
and the ``ELASTIC`` event lines the tests read."""
import argparse
import hashlib
import json
import os
import time

import numpy as np

SEED = 42
GLOBAL_BATCH = 96  # a multiple of 2 and 3: equal slices at either world size
LR, MOMENTUM = 0.05, 0.9


def parse_args(description, argv=None):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--reduction", default="allgather", choices=("allgather", "scatter_allgather"))
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--commit-every", type=int, default=5)
    p.add_argument("--kill-step", type=int, default=23)
    p.add_argument("--rejoin-step", type=int, default=40)
    p.add_argument("--max-ranks", type=int, default=3)
    p.add_argument("--out", help="directory for the victim's marker file")
    p.add_argument("--reference", metavar="PATH", help="train uncompressed in this process; write JSON here")
    return p.parse_args(argv)


def steps(n_train, epochs):
    """(steps per epoch, total steps): the global batches of an epoch, the remainder dropped."""
    per_epoch = n_train // GLOBAL_BATCH
    return per_epoch, per_epoch * epochs


def global_batch(step, n_train, per_epoch):
    epoch, b = divmod(step, per_epoch)
    order = np.random.default_rng([SEED, epoch]).permutation(n_train)
    return order[b * GLOBAL_BATCH:(b + 1) * GLOBAL_BATCH]


def rank_slice(idx, rank, size):
    per = len(idx) // size
    assert per * size == len(idx), (len(idx), size)
    return idx[rank * per:(rank + 1) * per]


def digest(layout):
    """A short hash of a JSON-able layout (creation index, counters, residual names and sizes)."""
    return hashlib.blake2b(json.dumps(layout).encode(), digest_size=6).hexdigest()


def reporter(hvd, host, state, snapshot):
    """report(event, **extra): print one ``ELASTIC`` line with the rank and size (None while Horovod is
    shut down), the state's step and ``snapshot()``."""
    def report(event, **extra):
        try:
            rank, size = hvd.rank(), hvd.size()
        except ValueError:  # Horovod is shut down
            rank = size = None
        line = dict(event=event, time=round(time.time(), 3), pid=os.getpid(), host=host, rank=rank, size=size,
                    step=state.step, **snapshot(), **extra)
        print("ELASTIC " + json.dumps(line, sort_keys=True), flush=True)
    return report


def write_reference(args, total, test_accuracy):
    """The uncompressed run's result, written to ``--reference`` and printed."""
    result = {"compression": "none", "steps": total, "test_accuracy": test_accuracy}
    with open(args.reference, "w") as f:
        json.dump(result, f)
    print(json.dumps(result))
