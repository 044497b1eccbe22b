"""The TensorFlow adapter, in one package:

    compressor.py   TensorFlowCompressor (``hvd_qsgd.tensorflow.QSGD``): Horovod's TensorFlow
                    ``Compressor``, the glue between Horovod's calls and the exchange's chains
    graph.py        the chains' backend, collectives and runner as TensorFlow ops
    state.py        its variables: counters, residuals, occurrences, checkpoints, elastic state
    schedule.py     DQSGD's bits schedule as graph ops
"""
