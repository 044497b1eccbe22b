"""Reference implementations of the codec's quantizer, written the way a user would by hand.

Both implement the same QSGD(b), b >= 2, as ``hvd_qsgd.codec`` with ``norm="max"`` and
``coding="fixed"``: the flattened tensor is cut into buckets of B elements (the last one
zero-padded), each bucket gets an fp32 scale = max |x|, s = 2^(b-1) - 1,

    t = min(|x| * (s / scale), s),   level = floor(t) + [u < t - floor(t)],  u ~ U[0, 1),
    code = (sign bit, top bit, 1 = negative, set only when level > 0) | level,

and the codes are packed at b bits per element, code i at bit offset i * b of a little-endian bit
stream (8 codes of b bits fill b bytes), which is the codec's own packing. Decoding unpacks the
codes and returns sign * level * (scale / s) in fp32.

* ``numpy_encode`` / ``numpy_decode``: vectorised NumPy, draws from ``np.random.Generator``.
* ``torch_encode`` / ``torch_decode``: PyTorch tensor ops on CPU, draws from ``torch.rand`` (in the
  spirit of torch.distributed's ``quantization_hooks``, but bucketed and bit-packed).

A result is a ``Quantized``: the per-bucket scales, the packed bytes (exactly ceil(n * b / 8) of
them) and what is needed to undo the packing. They are baselines for ``python -m benchmarks
kernels``; finite inputs are assumed (no special handling of NaN or Inf scales).
"""
from typing import Any, NamedTuple

import numpy as np

try:
    import torch
except ImportError:  # the NumPy baseline does not need torch
    torch = None


class Quantized(NamedTuple):
    """A quantized tensor: fp32 ``scales`` (one per bucket) and ``packed`` codes (uint8)."""

    scales: Any
    packed: Any
    numel: int
    bits: int
    bucket_size: int


def levels(bits):
    """s = 2^(bits-1) - 1, the number of nonzero levels of QSGD(bits) for bits in 2..8."""
    if not 2 <= bits <= 8:
        raise ValueError(f"the baselines implement bits in 2..8, got {bits}")
    return (1 << (bits - 1)) - 1


def packed_nbytes(numel, bits):
    """ceil(numel * bits / 8): the size of the packed codes."""
    return (numel * bits + 7) // 8


# ---- NumPy ------------------------------------------------------------------------------------
def _np_pad(a, multiple):
    pad = (-a.size) % multiple
    return np.concatenate([a, np.zeros(pad, a.dtype)]) if pad else a


def _np_pack(codes, bits):
    """Pack uint8 codes (< 2^bits) at ``bits`` bits each, little-endian bit order."""
    n = codes.size
    if 8 % bits == 0:  # whole codes per byte: k = 8 / bits codes in each byte
        k = 8 // bits
        c = _np_pad(codes, k).reshape(-1, k)
        out = c[:, 0].copy()
        for j in range(1, k):
            out |= c[:, j] << np.uint8(bits * j)
        return out
    c = _np_pad(codes, 8).reshape(-1, 8).astype("<u8")  # 8 codes -> one 64-bit word -> b bytes
    word = c[:, 0].copy()
    for j in range(1, 8):
        word |= c[:, j] << np.uint64(bits * j)
    return word.view(np.uint8).reshape(-1, 8)[:, :bits].reshape(-1)[: packed_nbytes(n, bits)]


def _np_unpack(packed, numel, bits):
    """Inverse of ``_np_pack``: the first ``numel`` codes as uint8."""
    mask = np.uint8((1 << bits) - 1)
    if 8 % bits == 0:
        k = 8 // bits
        codes = np.empty((packed.size, k), np.uint8)
        for j in range(k):
            np.bitwise_and(packed >> np.uint8(bits * j), mask, out=codes[:, j])
        return codes.reshape(-1)[:numel]
    groups = -(-numel // 8)
    buf = np.zeros((groups, 8), np.uint8)
    buf[:, :bits] = _np_pad(packed, groups * bits).reshape(groups, bits)
    word = buf.view("<u8").reshape(-1)
    codes = np.empty((groups, 8), np.uint8)
    for j in range(8):
        codes[:, j] = (word >> np.uint64(bits * j)) & np.uint64(mask)
    return codes.reshape(-1)[:numel]


def numpy_encode(x, bits=4, bucket_size=512, rng=None):
    """Quantize ``x`` (any shape, cast to float32) with NumPy; returns a ``Quantized``."""
    s = levels(bits)
    rng = np.random.default_rng() if rng is None else rng
    flat = np.asarray(x, dtype=np.float32).reshape(-1)
    n = flat.size
    xb = _np_pad(flat, bucket_size).reshape(-1, bucket_size)
    t = np.abs(xb)
    scales = t.max(axis=1)
    mult = np.divide(np.float32(s), scales, out=np.zeros_like(scales), where=scales > 0)
    t *= mult[:, None]
    np.minimum(t, np.float32(s), out=t)
    level = np.floor(t)
    t -= level  # the fractional part: the probability of rounding up
    level += rng.random(t.shape, dtype=np.float32) < t
    codes = level.astype(np.uint8)
    codes |= ((xb < 0) & (codes > 0)).view(np.uint8) << np.uint8(bits - 1)
    return Quantized(scales, _np_pack(codes.reshape(-1)[:n], bits), n, bits, bucket_size)


def numpy_decode(q):
    """Dequantize a ``numpy_encode`` result to a 1-D float32 array."""
    s, sign_bit = levels(q.bits), np.uint8(1 << (q.bits - 1))
    codes = _np_pad(_np_unpack(q.packed, q.numel, q.bits), q.bucket_size)
    cb = codes.reshape(-1, q.bucket_size)
    step = q.scales / np.float32(s)
    val = (cb & (sign_bit - np.uint8(1))).astype(np.float32)
    val *= step[:, None]
    np.negative(val, out=val, where=cb >= sign_bit)
    return val.reshape(-1)[: q.numel]


# ---- PyTorch ----------------------------------------------------------------------------------
def _t_pad(a, multiple):
    pad = (-a.numel()) % multiple
    return torch.cat([a, a.new_zeros(pad)]) if pad else a


def _t_pack(codes, bits):
    n = codes.numel()
    if 8 % bits == 0:
        k = 8 // bits
        c = _t_pad(codes, k).view(-1, k)
        out = c[:, 0].clone()
        for j in range(1, k):
            out |= c[:, j] << (bits * j)
        return out
    c = _t_pad(codes, 8).view(-1, 8).to(torch.int64)  # at most 7 * 8 = 56 bits used: no sign issue
    word = c[:, 0].clone()
    for j in range(1, 8):
        word |= c[:, j] << (bits * j)
    # int64 -> bytes in memory order (little-endian on every platform torch supports)
    return word.view(torch.uint8).view(-1, 8)[:, :bits].reshape(-1)[: packed_nbytes(n, bits)]


def _t_unpack(packed, numel, bits):
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        k = 8 // bits
        codes = torch.stack([(packed >> (bits * j)) & mask for j in range(k)], dim=1)
        return codes.reshape(-1)[:numel]
    groups = -(-numel // 8)
    buf = packed.new_zeros((groups, 8))
    buf[:, :bits] = _t_pad(packed, groups * bits).view(groups, bits)
    word = buf.view(-1).view(torch.int64)
    codes = torch.stack([((word >> (bits * j)) & mask) for j in range(8)], dim=1)
    return codes.to(torch.uint8).reshape(-1)[:numel]


def torch_encode(x, bits=4, bucket_size=512, generator=None):
    """Quantize a tensor (or array) with PyTorch ops; returns a ``Quantized`` of tensors."""
    s = levels(bits)
    flat = torch.as_tensor(x).reshape(-1).to(torch.float32)
    n = flat.numel()
    xb = _t_pad(flat, bucket_size).view(-1, bucket_size)
    t = xb.abs()
    scales = t.amax(dim=1)
    mult = torch.where(scales > 0, s / scales, torch.zeros_like(scales))
    t.mul_(mult[:, None]).clamp_(max=s)
    level = t.floor()
    t.sub_(level)  # the fractional part: the probability of rounding up
    level.add_(torch.rand(t.shape, generator=generator) < t)
    codes = level.to(torch.uint8)
    codes |= ((xb < 0) & (codes > 0)).to(torch.uint8) << (bits - 1)
    return Quantized(scales, _t_pack(codes.view(-1)[:n], bits), n, bits, bucket_size)


def torch_decode(q):
    """Dequantize a ``torch_encode`` result to a 1-D float32 tensor."""
    s, sign_bit = levels(q.bits), 1 << (q.bits - 1)
    codes = _t_pad(_t_unpack(q.packed, q.numel, q.bits), q.bucket_size)
    cb = codes.view(-1, q.bucket_size)
    step = q.scales / s
    val = (cb & (sign_bit - 1)).to(torch.float32).mul_(step[:, None])
    val = torch.where(cb >= sign_bit, -val, val)
    return val.view(-1)[: q.numel]
