"""Error feedback: what compression dropped is sent later, for every compressor of the package.

Worker side (Seide et al., 2014; Karimireddy et al., 2019; dist-EF-SGDM's worker): rank r keeps a
residual e_r per tensor and sends C(v) for v = g_r + e_r, then keeps

    e_r <- v - C(v).

Summed over steps, sum_t C(v_t) = sum_t g_t - e_T: what was sent tracks what was computed, off by
one residual, which stays bounded (each element of e is at most one quantization step of its bucket
for QSGD: |e_i| <= scale / s; at most |v_i| + mean |v| for the blockwise sign).

Server side (dist-EF-SGDM's server, with ``reduction="scatter_allgather"``): the rank that reduces
chunk j re-quantizes the sum of the ranks' chunk payloads; with ``server_error_feedback`` it keeps
that re-quantization's residual e~_j too: v = sum_r decode(p_rj) + e~_j, q_j = C(v), e~_j <- v - q_j.
It is kept in sum units (alpha is applied after decoding): for Average this is the paper's
e~ = n e~_sum / n, exact for the blockwise sign (C(a v) = a C(v) for a > 0) and for QSGD in
distribution.

Learning-rate changes. A compressor of gradients sits before the optimizer, which applies
-lr_t * (the reduced gradient). The residual made at step t is gradient owed at rate lr_t; paid at
step t+1 it is applied at lr_{t+1}. So that the applied updates sum to sum_t lr_t g_t, the residual is
rescaled when used,

    e <- e * lr_made / lr_now,

where lr_made is the learning rate in force when e was made and lr_now the one in force when it is
added (``rescale_factor``). ``follow_learning_rate(optimizer)`` reads lr_now from the optimizer's
parameter groups at every compression (a scheduler has set it by then) and stores lr_made with each
residual, so the state checkpoints with it. Optimizers that compress updates already scaled by the
learning rate (``hvd_qsgd.torch.EFSGDM``) need no rescaling: their residual is in update units.
A learning rate of 0 (or one that is not a finite positive number) rescales nothing and is not
recorded: the residual keeps the last positive rate it was made at.
"""
import math
from typing import Any, Sequence

import numpy as np

from hvd_qsgd import _native, codec, codec_segments

_FLOAT32 = np.dtype(np.float32)


def usable_rate(lr: Any) -> bool:
    """Whether ``lr`` can rescale a residual (a finite positive number)."""
    try:
        lr = float(lr)
    except (TypeError, ValueError):
        return False
    return math.isfinite(lr) and lr > 0


def check_learning_rate_source(source: Any) -> None:
    """Refuse, when it is given, what ``follow_learning_rate`` cannot read a learning rate from (it
    would fail at the first exchange, inside Horovod's hook, or call a model with a parameter name)."""
    if source is None or hasattr(source, "param_groups") or hasattr(source, "learning_rate"):
        return
    model = hasattr(source, "parameters") or hasattr(source, "trainable_variables")
    if callable(source) and not model:
        return
    hint = (": pass the optimizer it schedules" if hasattr(source, "optimizer") else
            ": pass its optimizer" if model else "")
    raise TypeError(f"follow_learning_rate: expected the optimizer (a torch.optim.Optimizer or a Keras optimizer) "
                    f"or a function of the residual's key returning the learning rate, got "
                    f"{type(source).__module__}.{type(source).__name__}{hint}")


def rescale_factor(lr_made: Any, lr_now: Any) -> float:
    """The factor a residual made at ``lr_made`` is multiplied by when used at ``lr_now`` (1 when
    either is unknown or unusable)."""
    if not (usable_rate(lr_made) and usable_rate(lr_now)):
        return 1.0
    return float(lr_made) / float(lr_now)


def keep_where_finite(residual: np.ndarray, d: np.ndarray, valid: bool = True) -> None:
    """``residual`` = ``d`` where that is finite, in place; elsewhere the residual keeps its value
    (0 where it was not ``valid``): what an encode's residual update does with an overflow or a
    non-finite gradient. The last of the steps composed in NumPy, which the native calls (``encode``,
    ``reduction.encode_chunks``) equal bit for bit: the reference of their tests and benchmark."""
    if not valid:
        residual.fill(0)
    np.copyto(residual, d, where=np.isfinite(d))


def encode(prepared: tuple, x: np.ndarray, seed: int, residual: np.ndarray, valid: bool = True,
           name: str = "tensor") -> np.ndarray:
    """The worker's step on the CPU in one native call (kernel ``qsgd_encode_ef_cpu``): the payload
    ``codec.encode_prepared(prepared, v, seed)`` of v = x + residual (x alone when the residual is
    not ``valid``), and ``residual`` (float32, x's size) = v - decode(payload) where that is finite,
    in place (elsewhere it keeps its value; 0 when it was not valid). The same payload and residual
    bits as those steps composed (``keep_where_finite``), without staging v: the fixed coding's
    encode does them per chunk, in cache."""
    template, numel, cap = prepared
    x = codec.prepared_input(prepared, x, name)
    check_residual(residual, x, name)
    return codec._encode_into((_native.address(x), numel), codec.seeded(template, seed), cap, None, name,
                              "qsgd_encode_ef_cpu", (_native.address(residual), 1 if valid else 0))


def encode_members(prepared: tuple, members: "codec_segments.Members", residuals: Sequence[np.ndarray], seed: int,
                   valid: bool = True, name: str = "tensor", out: np.ndarray = None) -> np.ndarray:
    """``encode`` of the tensor ``members`` is (a fusion buffer's members where they are) with the
    residual that is ``residuals[i]`` over ``parts[i]`` (each checked as ``check_residual`` checks it
    against its part) and 0 elsewhere, without assembling either (kernel
    ``qsgd_encode_segments_ef_cpu``): the same payload bytes, and each ``residuals[i]`` updated in
    place to what ``encode`` leaves over its part (nothing is kept between the parts). ``out``: as
    ``codec_segments.encode`` takes it."""
    parts = members.parts
    if len(residuals) != len(parts):
        raise ValueError(f"{name}: {len(residuals)} error-feedback residuals for {len(parts)} parts")
    for p, r in zip(parts, residuals):
        check_residual(r, p, name)
    return codec._encode_into(codec_segments.source(prepared, members, name, residuals), codec.seeded(prepared[0], seed),
                              prepared[2], out, name, "qsgd_encode_segments_ef_cpu", (1 if valid else 0,))


def check_residual(residual: Any, x: np.ndarray, name: str) -> None:
    """ValueError naming ``name`` unless ``residual`` is what a native error-feedback encode of the
    float32 array ``x`` updates: a writeable contiguous float32 array of x's size, apart from x."""
    if not (type(residual) is np.ndarray and residual.dtype is _FLOAT32 and residual.flags.c_contiguous
            and residual.flags.writeable and residual.size == x.size):
        raise ValueError(f"{name}: the error-feedback residual must be a writeable contiguous float32 array of "
                         f"{x.size} elements, got {getattr(residual, 'dtype', type(residual).__name__)} "
                         f"{getattr(residual, 'shape', '')}")
    if x.size and np.may_share_memory(x, residual):
        raise ValueError(f"{name}: the error-feedback residual shares memory with the tensor it is added to")
