"""The exchange of one compressed tensor, written once for every framework: a chain of stages per
reduction (``chains``), driven over a collectives interface (``collectives``) by a runner that owns
the compressor's names, residuals and statistics (``runner``). It imports no framework and no
Horovod; the adapters supply the collectives and turn tensors into their backend's arrays.
"""
