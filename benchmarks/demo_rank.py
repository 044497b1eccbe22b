"""One rank of the demo's shaped-link runs (``benchmarks.demo_shaped``; also of ``python -m benchmarks
convergence --workload lm --rate R``, which puts ``--example pytorch_lm`` first, and of ``demo_shaped
--example tensorflow2_digits``): ``examples/pytorch_digits.py`` (or the example named) in a rank's
network namespace, started by ``benchmarks.e2e_launch`` as ``ip netns exec <namespace>
python -m benchmarks.demo_rank <digits flags> --rate R`` with the Gloo worker's environment.

It runs the example's ``main`` with the digits flags unchanged, and reads its own ``veth0`` byte
counters (``netns.read_counters``: the namespace's only link, shaped to R) around the training loop:
at the example's ``hvd.allreduce(..., name="start")``, which lines the ranks up just before the
timed loop, and at its ``hvd.allgather(..., name="param_checksum")`` just after it (the two calls are
wrapped to take the readings, and otherwise do what they did). Rank 0 adds them to the example's
JSON results as ``link``: the rate, and the bytes the link carried out and in during the loop
(frames as the veth counts them: Ethernet/IP/TCP headers, Horovod's coordination and the control
vectors included; the start-up broadcast of the parameters and the final checks are not).
"""
import json
import os
import sys

from benchmarks import netns
from benchmarks.common import REPO_ROOT

START, END = "start", "param_checksum"  # the example's collectives around its training loop
# the examples with those two collectives, and the Horovod module each calls them through
HOROVOD_OF = {"pytorch_digits": "horovod.torch", "pytorch_lm": "horovod.torch",
              "tensorflow2_digits": "horovod.tensorflow"}


def split_rate(argv):
    """(digits flags, rate): the launcher appends ``--rate R`` after the flags it was given."""
    if len(argv) < 2 or argv[-2] != "--rate":
        raise SystemExit(f"demo_rank: expected '<digits flags> --rate R', got {argv!r}")
    return argv[:-2], argv[-1]


def json_path(flags):
    return flags[flags.index("--json") + 1] if "--json" in flags else None


def watch_loop(hvd, readings):
    """Wrap ``hvd.allreduce`` and ``hvd.allgather`` so that the counters are read into
    ``readings[START]`` after the first and ``readings[END]`` before the second."""
    allreduce, allgather = hvd.allreduce, hvd.allgather

    def allreduce_then_read(*args, **kwargs):
        out = allreduce(*args, **kwargs)
        if kwargs.get("name") == START:
            readings[START] = netns.read_counters()
        return out

    def read_then_allgather(*args, **kwargs):
        if kwargs.get("name") == END:
            readings[END] = netns.read_counters()
        return allgather(*args, **kwargs)

    hvd.allreduce, hvd.allgather = allreduce_then_read, read_then_allgather


def main(argv=None):
    flags, rate = split_rate(sys.argv[1:] if argv is None else argv)
    example = "pytorch_digits"
    if flags[:1] == ["--example"]:  # another example with the same two collectives (examples/pytorch_lm.py)
        example, flags = flags[1], flags[2:]
    if example not in HOROVOD_OF:
        raise SystemExit(f"demo_rank: no link readings for the example {example!r} (known: {', '.join(HOROVOD_OF)})")
    sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))  # as `python examples/<example>.py`
    import importlib

    readings = {}
    watch_loop(importlib.import_module(HOROVOD_OF[example]), readings)
    result = importlib.import_module(example).main(flags)
    path = json_path(flags)
    if result is not None and path:  # rank 0
        if set(readings) != {START, END}:
            raise SystemExit(f"demo_rank: the example's {START!r} / {END!r} collectives were not seen")
        (tx0, rx0), (tx1, rx1) = readings[START], readings[END]
        result["link"] = dict(rate=rate, iface=netns.IFACE, tx_bytes=tx1 - tx0, rx_bytes=rx1 - rx0)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
