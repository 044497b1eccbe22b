"""The latency/bandwidth model of the reductions, and the choice ``reduction="auto"`` makes from it.

Every collective is modelled as the ring/pairwise algorithm Horovod's Gloo and MPI back ends run, on
n ranks joined by full-duplex links of bandwidth beta (bytes/s) with a per-message latency alpha (s).
For one tensor of d elements whose QSGD payload is P bytes per rank (``codec.payload_nbytes``):

    allreduce (fp32, ring):     T = 2 (n-1) alpha + 2 (n-1)/n * 4d / beta
    allgather of payloads:      T =   (n-1) alpha +   (n-1)   * P  / beta
    scatter_allgather:          T = 2 (n-1) alpha + 2 (n-1)/n * P  / beta
                                    (alltoall of P/n-byte chunks, then allgather of the reduced chunks)

and the bytes a rank receives per step are the bandwidth terms times beta: (n-1) P for allgather,
2 (n-1)/n P for scatter_allgather (flat in n), 2 (n-1)/n 4d for the fp32 allreduce.

``choose(n, numel, ...)`` picks scatter_allgather when the model says it is faster:
n >= 3 and (n-1) P (1 - 2/n) / beta > (n-1) alpha, i.e. P > alpha beta n / (n - 2). The choice depends
only on n, the tensor size and the settings, which every rank shares, so every rank makes the same one
(and the control vector checks it). The defaults, ``LATENCY_S`` = 50 us and ``BANDWIDTH_BPS`` = 10 Gbit/s,
can be overridden per job with ``HVD_QSGD_LATENCY_US`` and ``HVD_QSGD_BANDWIDTH_GBITS`` (the same on
every rank, as horovodrun passes its environment to every rank).
"""
import os
from typing import Optional, Tuple

from hvd_qsgd import codec

LATENCY_S = 50e-6
BANDWIDTH_BPS = 10e9 / 8
REDUCTIONS = ("allgather", "scatter_allgather")


def link(latency_s: Optional[float] = None, bandwidth_bps: Optional[float] = None) -> Tuple[float, float]:
    """(alpha, beta): the given values, else the environment's, else the defaults."""
    if latency_s is None:
        latency_s = float(os.environ.get("HVD_QSGD_LATENCY_US", LATENCY_S * 1e6)) * 1e-6
    if bandwidth_bps is None:
        bandwidth_bps = float(os.environ.get("HVD_QSGD_BANDWIDTH_GBITS", BANDWIDTH_BPS * 8 / 1e9)) * 1e9 / 8
    if latency_s < 0 or bandwidth_bps <= 0:
        raise ValueError(f"the link model needs latency >= 0 and bandwidth > 0, got {latency_s} s and "
                         f"{bandwidth_bps} B/s (HVD_QSGD_LATENCY_US, HVD_QSGD_BANDWIDTH_GBITS)")
    return latency_s, bandwidth_bps


def received_bytes(reduction: str, n: int, payload_bytes: float) -> float:
    """Bytes one rank receives for one tensor whose payload is ``payload_bytes`` per rank
    (for "allreduce", ``payload_bytes`` is the uncompressed tensor's size)."""
    if reduction == "allgather":
        return (n - 1) * payload_bytes
    if reduction in ("scatter_allgather", "allreduce"):
        return 2 * (n - 1) / n * payload_bytes
    raise ValueError(f"unknown reduction {reduction!r}")


def seconds(reduction: str, n: int, payload_bytes: float, latency_s: Optional[float] = None,
            bandwidth_bps: Optional[float] = None) -> float:
    """Modelled time of one exchange (see the module docstring)."""
    alpha, beta = link(latency_s, bandwidth_bps)
    if n <= 1:
        return 0.0
    messages = (n - 1) if reduction == "allgather" else 2 * (n - 1)
    return messages * alpha + received_bytes(reduction, n, payload_bytes) / beta


def choose(n: int, numel: int, bits: int, bucket_size: int, latency_s: Optional[float] = None,
           bandwidth_bps: Optional[float] = None) -> str:
    """The faster reduction by the model for a tensor of ``numel`` elements on n ranks."""
    if n < 3:
        return "allgather"
    payload = codec.payload_nbytes(int(numel), bits, bucket_size)
    t_ag = seconds("allgather", n, payload, latency_s, bandwidth_bps)
    t_sa = seconds("scatter_allgather", n, payload, latency_s, bandwidth_bps)
    return "scatter_allgather" if t_sa < t_ag else "allgather"
