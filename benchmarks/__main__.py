"""Command line of the benchmarks: ``python -m benchmarks <subcommand> [options]``.

A subcommand is a module of this package with ``add_arguments(parser)`` and ``run(args)`` (returning
an exit status or None). To add one (``torch``, ``e2e``, ``convergence``, ...), write the module and
add a line to ``SUBCOMMANDS``. Every module is imported to declare its arguments, so a module keeps
heavy imports (torch, horovod, ...) inside ``run``.
"""
import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS = {
    "kernels": ("benchmarks.kernels",
                "codec encode/decode throughput vs memcpy and NumPy / PyTorch baselines"),
    "error-feedback": ("benchmarks.error_feedback",
                       "the CPU's error-feedback encode: the steps composed against the fused kernel"),
    "reduction": ("benchmarks.reduction",
                  "bytes per rank of QSGD's allgather and scatter_allgather reductions as n grows"),
    "torch": ("benchmarks.torch",
              "per-step time and bytes of Horovod PyTorch training: none, fp16, QSGD(b), at -np N"),
    "e2e": ("benchmarks.e2e", "step time and counted wire bytes over tbf-shaped links between network namespaces"),
    "convergence": ("benchmarks.convergence",
                    "test accuracy vs bytes sent of the PyTorch digits example, for every method, at -np N"),
    "noise": ("benchmarks.noise", "quantization noise against minibatch noise on the language model's gradients"),
    "overhead": ("benchmarks.overhead",
                 "per-tensor cost: step time of K small gradients through hvd.DistributedOptimizer"),
    "calibrate": ("benchmarks.calibrate", "fit the cost model's latency alpha and bandwidth beta to timed Horovod collectives"),
    "nodes": ("benchmarks.nodes", "PROJECTED step time of fp16 and QSGD's reductions on nodes of GPUs (no measurement)"),
}


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description="Benchmarks of the hvd_qsgd codec.")
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    return importlib.import_module(args._module).run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
