"""The framework adapters: one Horovod ``Compressor`` per framework (``torch``, ``tensorflow``),
configured by a ``Settings`` object and a bits policy, gluing compress/decompress to the shared state
objects below them. Users reach them as ``hvd_qsgd.torch.QSGD`` and ``hvd_qsgd.tensorflow.QSGD``, or
through ``hvd_qsgd.QSGD``, which creates the adapter of the framework it is handed. Nothing here
imports the front objects (``hvd_qsgd.compressor``) or the optimizers."""
