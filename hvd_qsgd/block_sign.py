"""``hvd_qsgd.BlockSign``: the blockwise scaled-sign compressor of dist-EF-SGDM (Zheng, Huang &
Kwok, NeurIPS 2019, section 4), with worker and server error feedback.

The flattened tensor is cut into blocks G of ``block_size`` consecutive elements (the last may be
shorter) and each block is sent as one fp32 scale and one bit per element:

    C(v)_G = (||v_G||_1 / |G|) * sign(v_G),        sign(0) = +1,

the codec's ``norm="sign"`` with ``bits=1`` (docs/wire-format.md): 1 + 32/block_size bits per
coordinate. C is deterministic and biased (it keeps the block's l1 mass, not its direction), which
is why the algorithm needs error feedback on both sides (``hvd_qsgd.error_feedback``):

    worker:  e <- v - C(v) for v = the tensor + e               (error_feedback=True)
    server:  with reduction="scatter_allgather", the rank that reduces chunk j re-compresses the
             sum of the ranks' chunk-j payloads plus its residual and keeps the new residual
             (server_error_feedback=True): two-way compression, 1 bit per coordinate each way.

Blocks never straddle a scatter_allgather chunk (chunks are whole blocks). The paper's experiments
use one block per layer: ``block_size=BlockSign.PER_TENSOR`` does that (a tensor is then a single
block, which scatter_allgather cannot split across ranks: that tensor's reduction falls on one
rank). The default, 512, keeps the wire near 1.06 bits per coordinate and spreads the reduction.

As a Horovod compressor (``hvd.DistributedOptimizer(opt, compression=hvd_qsgd.BlockSign())``) it
compresses gradients with error feedback; the full dist-EF-SGDM update (momentum before
compression) is ``hvd_qsgd.torch.EFSGDM`` (PyTorch) or ``hvd_qsgd.tensorflow.keras.EFSGDM`` (Keras 3);
``efsgdm_compression`` checks the arguments both share.
"""
from typing import Any, Dict, Iterable, Optional, Tuple

from hvd_qsgd import codec
from hvd_qsgd.compressor import QSGD, _own_signature


def efsgdm_compression(who: str, numbers: Dict[str, Any], compression: Optional[QSGD]) -> QSGD:
    """The compressor of a dist-EF-SGDM optimizer (``BlockSign()`` if None), after checking its
    arguments: each of ``numbers`` (name: value; ``momentum`` among them) a number >= 0, momentum < 1,
    and a compressor of the package with worker error feedback. ValueError/TypeError naming ``who``."""
    for name, value in numbers.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
            raise ValueError(f"{who}: {name} must be a number >= 0, got {value!r}")
    if not numbers["momentum"] < 1:
        raise ValueError(f"{who}: momentum must be < 1, got {numbers['momentum']!r}")
    compression = BlockSign() if compression is None else compression
    if not isinstance(compression, QSGD):
        raise TypeError(f"{who}: compression must be a hvd_qsgd compressor (hvd_qsgd.BlockSign), "
                        f"got {compression!r}")
    if not compression.settings.error_feedback:
        raise ValueError(f"{who}: the compressor must keep worker error feedback (error_feedback=True): "
                         "dist-EF-SGDM's e_{t,i}")
    return compression


class BlockSign(QSGD):
    """Blockwise scaled sign (see the module docstring).

    block_size:        elements per block (default 512; ``BlockSign.PER_TENSOR``: one per tensor)
    error_feedback:    worker-side residuals (default True)
    server_error_feedback: residuals of the reducing rank (default: True, but under "allgather",
                       where no rank reduces)
    reduction:         "scatter_allgather" (default: two-way compression), "allgather" (one-way:
                       every rank decodes every rank's payload) or "auto"
    min_numel, checksum, encoder, named_parameters, process_set: as for ``hvd_qsgd.QSGD``
    """

    PER_TENSOR = 0x7FFFFFFF

    def __init__(self, block_size: int = 512, min_numel: int = 10000, error_feedback: bool = True,
                 server_error_feedback: Optional[bool] = None, reduction: str = "scatter_allgather",
                 checksum: bool = True,
                 named_parameters: Optional[Iterable[Tuple[str, Any]]] = None, process_set: Any = None,
                 encoder: int = codec.DEFAULT_ENCODER):
        if server_error_feedback is None:
            server_error_feedback = reduction != "allgather"
        super().__init__(bits=1, bucket_size=block_size, norm="sign", coding="fixed", min_numel=min_numel, seed=0,
                         error_feedback=error_feedback, checksum=checksum, reduction=reduction,
                         named_parameters=named_parameters, process_set=process_set,
                         server_error_feedback=server_error_feedback, encoder=encoder)

    def __repr__(self) -> str:
        s = self.settings
        return (f"hvd_qsgd.BlockSign(block_size={s.bucket_size}, " + s.described(
            ("min_numel", "error_feedback", "server_error_feedback", "reduction"),
            hidden=("bits", "bucket_size", "norm", "coding", "seed")) + ")")


BlockSign.__signature__ = _own_signature(BlockSign)
