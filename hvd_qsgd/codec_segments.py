"""A tensor given as its nonzero parts, encoded without assembling it: a fusion buffer's members
where they are (``hvd_qsgd.exchange.buffers``).

``Members(parts, offsets, numel)`` is the tensor of ``numel`` elements that is ``parts[i]`` from
``offsets[i]`` on (contiguous 1-D float32 arrays, sorted by offset and apart) and 0 elsewhere;
``encode`` gives the bytes ``codec.encode_prepared`` gives for that tensor assembled (kernel
``qsgd_encode_segments_cpu``: each bucket read from the member that holds it, a bucket that holds
a member's end padded with zeros in the kernel's scratch), without the copy into one array;
``error_feedback.encode_members`` does so with error feedback, each part's residual read and
updated where it is.
"""
import ctypes
import operator
from typing import NamedTuple, Sequence

import numpy as np

from hvd_qsgd import _native, codec

_NDARRAY, _FLOAT32, _ONE = {np.ndarray}, {np.dtype(np.float32)}, {1}
_DTYPE, _NDIM, _SIZE = operator.attrgetter("dtype"), operator.attrgetter("ndim"), operator.attrgetter("size")
_CONTIGUOUS = operator.attrgetter("flags.c_contiguous")
BUCKET_MAX = 1 << 16   # the largest bucket the kernel pads (kernels/qsgd_cpu.cc: kSegmentBucketMax)


class Members(NamedTuple):
    """A tensor of ``numel`` elements: ``parts[i]`` from ``offsets[i]`` on, 0 elsewhere."""

    parts: Sequence[np.ndarray]
    offsets: Sequence[int]
    numel: int


def takes(settings) -> bool:
    """Whether ``encode`` encodes a tensor with these settings (fixed coding, buckets it pads)."""
    return settings.coding == "fixed" and settings.bucket_size <= BUCKET_MAX


def encode(prepared: tuple, members: Members, seed: int, name: str = "tensor", out: np.ndarray = None) -> np.ndarray:
    """``codec.encode_prepared(prepared, assembled, seed)`` of the tensor ``members`` is, without
    assembling it: the same bytes (``out``: a uint8 array it writes into, a view of whose first
    bytes is returned)."""
    return codec._encode_into(source(prepared, members, name), codec.seeded(prepared[0], seed), prepared[2], out,
                              name, "qsgd_encode_segments_cpu")


def source(prepared: tuple, members: Members, name: str = "tensor", residuals: Sequence[np.ndarray] = None) -> tuple:
    """The segmented kernels' arguments before the config for ``members``, checked to be what the
    prepared encode reads: the parts' addresses, the ``residuals``' (one per part, when given:
    ``error_feedback.encode_members`` checks them), the offsets, the counts, their number, numel."""
    parts = members.parts
    if members.numel != prepared[1]:
        raise ValueError(f"{name}: encode was prepared for {prepared[1]} elements, got {members.numel}")
    # (each test over every part in one call: a buffer has many)
    if parts and not (set(map(type, parts)) == _NDARRAY and set(map(_DTYPE, parts)) == _FLOAT32
                      and set(map(_NDIM, parts)) == _ONE and all(map(_CONTIGUOUS, parts))):
        raise ValueError(f"{name}: a segmented encode reads contiguous 1-D float32 arrays")
    k = len(parts)
    both = (_addresses(parts),) if residuals is None else (_addresses(parts), _addresses(residuals))
    return (*both, (ctypes.c_uint64 * k)(*members.offsets), (ctypes.c_uint64 * k)(*map(_SIZE, parts)), k,
            members.numel)


def _addresses(arrays):
    return (ctypes.c_void_p * len(arrays))(*map(_native.address, arrays))
