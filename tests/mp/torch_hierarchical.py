"""Worker for tests/test_hierarchical.py under horovodrun with HVD_QSGD_RANKS_PER_NODE=2: the
hierarchical reduction through Horovod's PyTorch allreduce equals the single-process reference of
its three stages (``tests.references.hierarchical``) bit for bit on every rank, counts what it sent,
and ranks that disagree on the layout raise on every rank. Prints ``OK <scenario>`` or
``RAISED <type>: <message>``."""
import os
import sys

import numpy as np
import torch
import horovod.torch as hvd

import hvd_qsgd
from hvd_qsgd import codec, protocol, reduction
from tests import references

SEED = 5
PER_NODE = 2


def gather(t, tag):
    return [x for x in hvd.allgather(t.detach().float().unsqueeze(0), name=f"test.gather.{tag}").unbind(0)]


def exact():
    rank, n = hvd.rank(), hvd.size()
    c = hvd_qsgd.QSGD(4, seed=SEED, reduction="hierarchical", min_numel=1)
    seq = 0
    # odd lengths, shards of unequal size, one bucket (fewer buckets than the node has ranks: an empty
    # shard), half precision, Sum and Average
    for numel, dtype, op in ((20000, torch.float32, hvd.Average), (1001, torch.float32, hvd.Sum),
                             (300, torch.float32, hvd.Average), (30001, torch.float16, hvd.Average),
                             (1 << 20, torch.float32, hvd.Average)):
        t = torch.randn(numel, generator=torch.Generator().manual_seed(100 * rank + seq)).to(dtype)
        before = c.stats
        out = hvd.allreduce(t, compression=c, op=op, name=f"h{seq}")
        adapter = c._adapter("torch")
        exchange = f"hvd_qsgd.{adapter._creation_index}.s{seq}"
        seeds = [protocol.payload_seed(SEED, r, exchange, 0) for r in range(n)]
        dname = {torch.float32: "float32", torch.float16: "float16"}[dtype]
        fp = codec.tensor_fingerprint("", t.shape, dname)
        xs = [x.numpy() for x in gather(t, seq)]
        ref, sent = references.hierarchical(xs, c.settings, seeds, PER_NODE, 1.0 / n if op == hvd.Average else 1.0,
                                            fp, dname)
        assert out.dtype == dtype and out.shape == t.shape
        assert np.array_equal(out.numpy(), ref.astype(out.numpy().dtype)), \
            f"{numel} {dtype}: max diff {np.abs(out.float().numpy() - ref).max()}"
        copies = gather(out, f"out{seq}")
        assert all(torch.equal(x, copies[0]) for x in copies), "ranks differ"
        # this rank's bytes: its tensor's other shards inside the node (float32), its shard's payload
        # to each other node, its shard result to the node's other rank (float32)
        b, e = reduction.chunk_ranges(numel, c.settings.bucket_size, PER_NODE)[rank % PER_NODE]
        cross = sent[rank % PER_NODE][rank // PER_NODE]
        expected = 4 * (numel - (e - b)) + cross + 4 * (e - b) * (PER_NODE - 1)
        got = c.stats["bytes_sent"] - before["bytes_sent"]
        assert got == expected, (numel, got, expected)
        assert c.stats["cross_bytes_sent"] - before["cross_bytes_sent"] == cross, (numel, c.stats, cross)
        if numel == 1 << 20:  # what leaves a node, counted by stats: about 2 (c - 1)/c P, P the tensor's
            # payload (the cross stage's allgather at 2 nodes, its scatter_allgather at 3)
            payload = codec.payload_nbytes(numel, 4, c.settings.bucket_size)
            mine = float(c.stats["cross_bytes_sent"] - before["cross_bytes_sent"])
            node_cross = hvd.allreduce(torch.tensor([mine]), op=hvd.Sum, name="test.cross")[0] / (n // PER_NODE)
            nodes = n // PER_NODE
            assert node_cross <= 1.2 * 2 * (nodes - 1) / nodes * payload, (float(node_cross), payload)
        seq += 1


def error_feedback():
    """Two bits and error feedback over three steps: each rank keeps the residual of the shard it
    encodes (kept by the call's name, the same at every step), equal to the reference's on every step."""
    rank, n = hvd.rank(), hvd.size()
    c = hvd_qsgd.QSGD(2, seed=SEED, reduction="hierarchical", min_numel=1, error_feedback=True)
    t = torch.randn(5001, generator=torch.Generator().manual_seed(rank))
    xs = [x.numpy() for x in gather(t, "ef")]
    residuals = {}
    for step in range(3):
        out = hvd.allreduce(t, compression=c, name="ef")
        exchange = f"hvd_qsgd.{c._adapter('torch')._creation_index}.s{step}"
        seeds = [protocol.payload_seed(SEED, r, exchange, 0) for r in range(n)]
        ref, _ = references.hierarchical(xs, c.settings, seeds, PER_NODE, 1.0 / n,
                                         codec.tensor_fingerprint("", t.shape, "float32"), residuals=residuals)
        assert np.array_equal(out.numpy(), ref), f"step {step}: max diff {np.abs(out.numpy() - ref).max()}"
    mine = np.asarray(c._adapter("torch").residuals.residuals["ef"])
    assert np.array_equal(mine, residuals[(rank // PER_NODE, rank % PER_NODE)]), "residual"


def uneven_hosts():
    """Horovod's hosts of 2 and 4 ranks (``-H localhost:2,127.0.0.1:4``, no HVD_QSGD_RANKS_PER_NODE):
    "auto" resolves alike on every rank (flat: the hosts differ, Horovod's is_homogeneous), where
    ranks 0-1 found nodes of 2 in their own local_size, resolved a 10,000-element tensor to the
    hierarchical reduction and the others to allgather, and every step failed ("ranks disagree on the
    compressor settings"); the hierarchical reduction is refused on every rank, naming unequal nodes."""
    rank, n = hvd.rank(), hvd.size()
    assert (hvd.local_size(), n) == ((2 if rank < 2 else 4), 6), (hvd.local_size(), n)
    t = torch.randn(10000, generator=torch.Generator().manual_seed(rank))
    out = hvd.allreduce(t, compression=hvd_qsgd.QSGD(4, seed=SEED), name="uneven.auto")
    copies = hvd.allgather(out.reshape(1, -1), name="uneven.copies")
    assert all(torch.equal(copies[0], row) for row in copies), "results differ between ranks"
    try:
        hvd.allreduce(t, compression=hvd_qsgd.QSGD(4, seed=SEED, reduction="hierarchical"), name="uneven.hier")
    except protocol.MismatchError as e:
        assert "needs nodes of equal size" in str(e) and "hosts hold different numbers of ranks" in str(e), str(e)
    else:
        raise AssertionError("the hierarchical reduction ran on hosts of 2 and 4 ranks")


def auto():
    """reduction="auto" (the default) on nodes of 2 ranks: for host tensors the link inside a node is
    10 Gbit/s by default, as fast as the node link's default, and a 1M-element tensor stays flat; told
    the inside link is 200 Gbit/s (HVD_QSGD_INTRA_GBITS, alike on every rank) it resolves to the
    hierarchical reduction by the two-link cost model, and equals its three-stage reference."""
    rank, n = hvd.rank(), hvd.size()
    c = hvd_qsgd.QSGD(4, seed=SEED)
    numel = 1 << 20
    assert c.settings.reduction == "auto" and c.settings.exchange_reduction(n, numel, PER_NODE, "cpu") == \
        "scatter_allgather"
    os.environ["HVD_QSGD_INTRA_GBITS"] = "200"
    try:
        assert c.settings.exchange_reduction(n, numel, PER_NODE, "cpu") == "hierarchical"
        t = torch.randn(numel, generator=torch.Generator().manual_seed(7 + rank))
        out = hvd.allreduce(t, compression=c, name="auto")
    finally:
        del os.environ["HVD_QSGD_INTRA_GBITS"]
    exchange = f"hvd_qsgd.{c._adapter('torch')._creation_index}.s0"
    seeds = [protocol.payload_seed(SEED, r, exchange, 0) for r in range(n)]
    xs = [x.numpy() for x in gather(t, "auto")]
    ref, _ = references.hierarchical(xs, c.settings, seeds, PER_NODE, 1.0 / n,
                                     codec.tensor_fingerprint("", t.shape, "float32"), "float32")
    assert np.array_equal(out.numpy(), ref), f"auto: max diff {np.abs(out.numpy() - ref).max()}"
    payload = codec.payload_nbytes(numel, 4, c.settings.bucket_size)
    nodes = n // PER_NODE
    assert c.stats["cross_bytes_sent"] <= 1.2 * 2 * (nodes - 1) / nodes * payload / PER_NODE, c.stats


def malformed_layout():
    """A malformed HVD_QSGD_RANKS_PER_NODE is an error naming it on every rank, not a hang."""
    os.environ["HVD_QSGD_RANKS_PER_NODE"] = "two"
    try:
        hvd.allreduce(torch.randn(20000), compression=hvd_qsgd.QSGD(4), name="malformed")
    except protocol.MismatchError as e:
        assert "HVD_QSGD_RANKS_PER_NODE" in str(e), str(e)
        print(f"RAISED {type(e).__name__}: {' '.join(str(e).split())[:300]}", flush=True)
        return False
    finally:
        os.environ["HVD_QSGD_RANKS_PER_NODE"] = str(PER_NODE)
    raise AssertionError("a malformed layout did not raise")


def malformed_link():
    """A link variable malformed on one rank after its compressor was made (where "auto" reads it:
    here the layout's choice, 4 ranks on nodes of 2): that exchange's fault, raised on every rank
    (rank 0 naming the variable, the others that it could not encode), not on rank 0 alone while the
    others wait for its control vector; the next exchange runs."""
    c = hvd_qsgd.QSGD(4)
    if hvd.rank() == 0:
        os.environ["HVD_QSGD_BANDWIDTH_GBITS"] = "fast"
    try:
        hvd.allreduce(torch.randn(20000), compression=c, name="malformed_link")
        raise AssertionError("a malformed link variable did not raise")
    except protocol.MismatchError as e:
        assert ("HVD_QSGD_BANDWIDTH_GBITS='fast'" if hvd.rank() == 0 else "1 rank(s) could not encode") in str(e), e
    finally:
        os.environ.pop("HVD_QSGD_BANDWIDTH_GBITS", None)
    x = torch.full((20000,), float(hvd.rank()))
    assert torch.allclose(hvd.allreduce(x, compression=c, name="malformed_link"), torch.full_like(x, 1.5)), "next exchange"


def layouts_differ():
    os.environ["HVD_QSGD_RANKS_PER_NODE"] = "1" if hvd.rank() == 0 else str(PER_NODE)
    c = hvd_qsgd.QSGD(4, reduction="hierarchical")
    try:
        hvd.allreduce(torch.randn(20000), compression=c, name="differ")
    except protocol.MismatchError as e:
        print(f"RAISED {type(e).__name__}: {' '.join(str(e).split())[:600]}", flush=True)
        return False
    raise AssertionError("ranks with different layouts did not raise")


def main():
    hvd.init()
    torch.set_num_threads(1)
    for name in sys.argv[1:]:
        if {"exact": exact, "error-feedback": error_feedback, "auto": auto, "layouts-differ": layouts_differ,
                "uneven-hosts": uneven_hosts, "malformed-layout": malformed_layout,
                "malformed-link": malformed_link}[name]() is not False:
            print(f"OK {name}", flush=True)


if __name__ == "__main__":
    main()
