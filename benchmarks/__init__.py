"""Benchmarks of hvd_qsgd, run from the repository root as ``python -m benchmarks <subcommand>``.

They live beside the library, not in it: installing hvd_qsgd does not install them. They use only
the library's public modules (``hvd_qsgd``, ``codec``, ``protocol``, ``cost_model``, ``cuda``,
``_native``, ``settings``, ``reduction``). Each subcommand is one module here exposing
``add_arguments(parser)`` and ``run(args)``, registered in ``__main__.SUBCOMMANDS``; what each
measures is in ``benchmarks/README.md``.
"""
