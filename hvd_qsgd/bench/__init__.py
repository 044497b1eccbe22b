"""Benchmarks of hvd_qsgd, run as ``python -m hvd_qsgd.bench <subcommand>``.

``kernels``: codec encode/decode throughput against memcpy and hand-written NumPy and PyTorch
baselines of the same quantizer (``hvd_qsgd.bench.baselines``). ``torch``: per-step time and bytes
of Horovod PyTorch training with none, fp16 and QSGD(2/4/8) at several rank counts. Each subcommand is one module here
exposing ``add_arguments(parser)`` and ``run(args)``, registered in ``__main__.SUBCOMMANDS``.
"""
