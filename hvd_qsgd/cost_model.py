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

Two links, where the ranks sit on c nodes of L consecutive ranks each (n = L c, L > 1, c > 1). The
node's link to the network (beta, the bandwidth above: ``link_gbps=`` sets it) is shared by its L
ranks; inside the node the ranks talk over a faster link (beta_i, ``HVD_QSGD_INTRA_GBITS``; by
default ``INTRA_BANDWIDTH_BPS``, 200 Gbit/s, the PCIe end of the range, for CUDA tensors, and
``HOST_INTRA_BANDWIDTH_BPS``, 10 Gbit/s, for host tensors, which Gloo and MPI move between a node's
processes through the host's memory and network stack on the cores the ranks compute on; measured
on a 2-core machine, 2 hosts x 2 ranks, that path made the hierarchical reduction slower than the
flat one, docs/reduction.md). A reduction is then
priced by its messages m, the bytes B_x that cross one node's link in each direction and the bytes
B_i a rank takes from its own node in stages of their own (before or after the cross stage):

    T = m alpha + B_x / beta + B_i / beta_i            (``node_costs``, ``seconds_in_nodes``)

    allgather (a ring):  m = n-1,            B_x = (n-1) P,                       B_i = 0
    scatter_allgather:   m = 2(n-1),         B_x = L (n-L) P / n + (n-1) P / n,   B_i = 0
    hierarchical:        m = 2(L-1) + (c-1), B_x = L (c-1) P_s,                   B_i = 2 (L-1)/L 4d
      (cross stage by scatter_allgather:  m = 2(L-1) + 2(c-1), B_x = L (c-1) (2 P_s / c + 8))

The ring allgather's edge out of a node carries every payload but the node's first rank's own;
scatter_allgather's alltoall sends each of the node's L ranks' P/n-byte chunks to the n-L ranks
elsewhere, and its allgather of the reduced chunks is a ring again. In both, what moves inside the
node moves alongside what crosses it, so the node link alone bounds them. The hierarchical
reduction's float32 node scatter and gather are stages of their own inside the node, and its cross
stage exchanges each rank's shard (P_s: the payload of ceil(d/L) elements) with its peers on the
other nodes by the flat reduction ``cross_stage`` picks for c ranks on a link shared L ways: sending
the payload to each of them (allgather), or, for c >= 3 and large shards, its c chunk payloads,
each peer re-quantizing one chunk and sending it framed to the others (scatter_allgather).
With L = 1 these are the flat rows above. ``choose_in_nodes`` picks the fastest of the three (of the
flat two where the hierarchical reduction cannot run: server error feedback, a process set).
"""
import functools
import math
import os
from typing import Optional, Tuple

from hvd_qsgd import codec

LATENCY_S = 50e-6
BANDWIDTH_BPS = 10e9 / 8
INTRA_BANDWIDTH_BPS = 200e9 / 8        # inside a node, CUDA tensors
HOST_INTRA_BANDWIDTH_BPS = 10e9 / 8    # inside a node, host tensors
REDUCTIONS = ("allgather", "scatter_allgather")
NODE_REDUCTIONS = REDUCTIONS + ("hierarchical",)


def env_number(name: str, default: float, unit: str, zero: bool = False) -> float:
    """The number of ``unit`` the environment variable ``name`` holds (``default`` where unset or
    empty): a finite number above 0 (or 0 too, with ``zero``); else ValueError naming the variable."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value > 0 or zero and value == 0)):
        raise ValueError(f"{name}={text!r}: expected a finite number of {unit} {'>= 0' if zero else '> 0'}")
    return value


def check_environment() -> None:
    """Raise the ValueError of a malformed link variable (HVD_QSGD_LATENCY_US, HVD_QSGD_BANDWIDTH_GBITS,
    HVD_QSGD_INTRA_GBITS) at once, where a compressor is made, not at the exchange that first reads it."""
    link()
    intra_link()


def link(latency_s: Optional[float] = None, bandwidth_bps: Optional[float] = None) -> Tuple[float, float]:
    """(alpha, beta): the given values, else the environment's, else the defaults."""
    if latency_s is None:
        latency_s = env_number("HVD_QSGD_LATENCY_US", LATENCY_S * 1e6, "microseconds", zero=True) * 1e-6
    if bandwidth_bps is None:
        bandwidth_bps = env_number("HVD_QSGD_BANDWIDTH_GBITS", BANDWIDTH_BPS * 8 / 1e9, "Gbit/s") * 1e9 / 8
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


@functools.lru_cache(maxsize=4096)
def fp32_allreduce_bytes(n: int, numel: int) -> int:
    """Bytes a ring allreduce of ``numel`` float32 elements over n ranks makes one rank receive, as a
    whole number (``Stats.allreduce_bytes``, counted per exchange; worked out once per size)."""
    return int(received_bytes("allreduce", n, 4 * numel))


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


def intra_link(bandwidth_bps: Optional[float] = None, device: str = "cuda") -> float:
    """beta_i, the link inside a node (bytes/s): the given value, else ``HVD_QSGD_INTRA_GBITS``, else
    the default for tensors on ``device`` ("cuda", or "cpu": host tensors)."""
    if bandwidth_bps is None:
        default = INTRA_BANDWIDTH_BPS if device == "cuda" else HOST_INTRA_BANDWIDTH_BPS
        bandwidth_bps = env_number("HVD_QSGD_INTRA_GBITS", default * 8 / 1e9, "Gbit/s") * 1e9 / 8
    if not bandwidth_bps > 0:
        raise ValueError(f"the link inside a node needs a bandwidth > 0, got {bandwidth_bps} B/s (HVD_QSGD_INTRA_GBITS)")
    return bandwidth_bps


def cross_stage(per_node: int, nodes: int, shard_numel: int, bits: int, bucket_size: int,
                latency_s: Optional[float] = None, bandwidth_bps: Optional[float] = None) -> str:
    """The hierarchical reduction's cross stage for a shard of ``shard_numel`` elements: the flat
    choice among the ``nodes`` ranks holding it, each node's link shared by its ``per_node`` ranks."""
    alpha, beta = link(latency_s, bandwidth_bps)
    return choose(nodes, shard_numel, bits, bucket_size, alpha, beta / per_node)


def node_costs(reduction: str, per_node: int, nodes: int, numel: int, bits: int, bucket_size: int,
               latency_s: Optional[float] = None, bandwidth_bps: Optional[float] = None) -> Tuple[int, float, float]:
    """(messages, bytes crossing one node's link in each direction, bytes a rank takes from its own
    node) of one exchange on ``nodes`` nodes of ``per_node`` ranks (the module docstring); the link's
    latency and bandwidth decide the hierarchical reduction's cross stage."""
    L, n = per_node, per_node * nodes
    payload = codec.payload_nbytes(int(numel), bits, bucket_size)
    if reduction == "allgather":
        return n - 1, (n - 1) * payload, 0.0
    if reduction == "scatter_allgather":
        return 2 * (n - 1), (L * (n - L) + n - 1) * payload / n, 0.0
    if reduction == "hierarchical":
        shard_numel = -(-int(numel) // L)
        shard = codec.payload_nbytes(shard_numel, bits, bucket_size)
        inside = 2 * (L - 1) / L * 4 * numel
        if cross_stage(L, nodes, shard_numel, bits, bucket_size, latency_s, bandwidth_bps) == "allgather":
            return 2 * (L - 1) + nodes - 1, L * (nodes - 1) * shard, inside
        return 2 * (L - 1) + 2 * (nodes - 1), L * (nodes - 1) * (2 * shard / nodes + 8), inside
    raise ValueError(f"unknown reduction {reduction!r}")


def seconds_in_nodes(reduction: str, per_node: int, nodes: int, numel: int, bits: int, bucket_size: int,
                     latency_s: Optional[float] = None, bandwidth_bps: Optional[float] = None,
                     intra_bps: Optional[float] = None) -> float:
    """Modelled time of one exchange on two links: m alpha + B_x / beta + B_i / beta_i."""
    alpha, beta = link(latency_s, bandwidth_bps)
    messages, cross, inside = node_costs(reduction, per_node, nodes, numel, bits, bucket_size, alpha, beta)
    return messages * alpha + cross / beta + inside / intra_link(intra_bps)


def choose_in_nodes(per_node: int, nodes: int, numel: int, bits: int, bucket_size: int, hierarchical: bool = True,
                    latency_s: Optional[float] = None, bandwidth_bps: Optional[float] = None,
                    intra_bps: Optional[float] = None) -> str:
    """The fastest reduction by the two-link model on ``nodes`` nodes of ``per_node`` ranks (on one
    node, or nodes of one rank, ``choose``'s flat answer); ``hierarchical=False`` where it cannot run."""
    if per_node <= 1 or nodes <= 1:
        return choose(per_node * nodes, numel, bits, bucket_size, latency_s, bandwidth_bps)
    candidates = NODE_REDUCTIONS if hierarchical else REDUCTIONS
    return min(candidates, key=lambda r: seconds_in_nodes(r, per_node, nodes, numel, bits, bucket_size,
                                                          latency_s, bandwidth_bps, intra_bps))
