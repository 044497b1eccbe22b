"""The hierarchical reduction: reduce inside each node uncompressed, compress only what crosses nodes.

With n ranks in c nodes of L consecutive ranks (node k holds set ranks kL .. kL+L-1; the layout:
``runner.node_layout``), a d-element tensor is cut into L shards of whole buckets
(``reduction.chunk_ranges(d, B, L)``), and rank kL+i:

    node scatter   sends shard j of its tensor (float32) to its node's rank j: an alltoall over the
                   set whose splits are zero outside the node (nothing crosses the node link);
    node sum       S_ki = the sum of the L shards i it received, added in local-rank order;
    cross          the compressed exchange of S_ki among the c ranks holding shard i (its "cross
                   peers", one a node), by the flat machinery the cost model picks for c ranks
                   sharing the node link L ways (``cross_reduction``; every peer of a shard picks
                   alike, since the shard's size, c and the settings are theirs alike):
      allgather    encodes S_ki (its own step seed; with error feedback, S_ki + e_ki, keeping
                   e_ki <- that minus the decoded payload: the residual of what this rank encodes,
                   a shard's worth) and sends the payload to every cross peer, itself included
                   (splits zero elsewhere: c - 1 payloads of d b/8L bytes leave the node per
                   rank, (c - 1) P per node); R_i = decode_sum of the c payloads, in node order;
      scatter_allgather (c >= 3, large shards)
                   encodes S_ki as c chunk payloads (error feedback likewise) and sends chunk q to
                   the peer on node q; that peer re-quantizes the sum of the c payloads of its chunk
                   (its own step seed, as the flat reduction's reducing rank) and sends the framed
                   result to every peer; R_i = the decoded reduced chunks back to back: about
                   2 (c - 1)/c P per node;
                   R_i is the same bytes decoded alike on the c ranks holding shard i;
    node gather    sends R_i (float32) to every rank of its node (inside the node);
    result         alpha * (R_0 .. R_{L-1}), the received shards back to back.

Unbiased: E[R_i] = sum_k S_ki = the sum over all ranks of shard i. Every rank of a node receives
the same R_i bits, and the c ranks holding shard i computed R_i from the same payloads, so every
rank ends bit-identical. A rank whose received payloads fail their checks sends its node an empty
shard; the node's ranks see it and raise, as its cross peers (which checked the same bytes) do.
"""
import os
from types import SimpleNamespace

from hvd_qsgd import cost_model, protocol, reduction


def _layout(ex):
    """(L ranks per node, c nodes, this rank's node, its local index)."""
    per_node, r = ex.layout, ex.set_rank
    return per_node, len(ex.set_ranks) // per_node, r // per_node, r % per_node


def _shard_ranges(ex):
    return reduction.chunk_ranges(ex.expect.numel, ex.settings.bucket_size, ex.layout)


def cross_reduction(settings, per_node, nodes, shard_numel):
    """The cross stage's reduction of a shard of ``shard_numel`` elements among ``nodes`` peers, each
    node's link shared by its ``per_node`` peers of other shards (``cost_model.cross_stage``); always
    allgather for the Elias coding, whose chunk steps have no device kernels."""
    if settings.coding != "fixed":
        return "allgather"
    return cost_model.cross_stage(per_node, nodes, shard_numel, settings.bits, settings.bucket_size,
                                  bandwidth_bps=settings.link_bps())


def _peers(ex):
    """The set ranks of this rank's cross peers (the ranks holding its shard), in node order."""
    per_node, nodes, _, local = _layout(ex)
    return [k * per_node + local for k in range(nodes)]


def _shard_expect(ex, m):
    return SimpleNamespace(**{**vars(ex.expect), "numel": m})


def ranks_per_node_override():
    """``HVD_QSGD_RANKS_PER_NODE`` (consecutive ranks form a node; the same on every rank), or None."""
    text = os.environ.get("HVD_QSGD_RANKS_PER_NODE", "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"HVD_QSGD_RANKS_PER_NODE must be a positive integer, got {text!r}")
    return int(text)


def horovod_ranks_per_node(hvd):
    """The hierarchical reduction's node size under Horovod (``hvd``: its framework module):
    ``HVD_QSGD_RANKS_PER_NODE``, else Horovod's local_size where its hosts all hold that many ranks
    (Horovod's ``is_homogeneous``, alike on every rank) and its ranks fill them one after another;
    else 0 (an error for the hierarchical reduction, and "auto" stays flat). Each rank's own
    local_size alone said a node size on some ranks of uneven hosts (2 + 6: ranks 0-1 found nodes of
    2, the others none), and "auto" resolved differently there: every step failed."""
    override = ranks_per_node_override()
    if override is not None:
        return override
    size, rank = hvd.local_size(), hvd.rank()
    homogeneous = hvd.mpi_ops._basics.is_homogeneous()
    return size if homogeneous and hvd.local_rank() == rank % size and hvd.cross_rank() == rank // size else 0


def node_layout(ranks_per_node, set_ranks, world, where):
    """(L, None): the hierarchical reduction's ranks per node, or (L as given, the fault) where it
    cannot run (kept in the settings tag: ranks that were given different layouts still differ there)."""
    n = len(set_ranks)
    if n != world:
        return ranks_per_node or 0, ValueError(f"{where}: the hierarchical reduction runs over the global process set (this one "
                             f"holds {n} of {world} ranks); pass another reduction for process sets")
    if not ranks_per_node:
        return 0, ValueError(f"{where}: the hierarchical reduction needs nodes of equal size, each holding "
                             "consecutive ranks, and Horovod's are not (its hosts hold different numbers of "
                             "ranks, or its ranks do not fill them one after another): pass another "
                             "reduction (or, where the nodes are alike, set HVD_QSGD_RANKS_PER_NODE on every rank)")
    if n % ranks_per_node:
        return ranks_per_node, ValueError(f"{where}: the hierarchical reduction needs nodes of equal size: {n} ranks do not "
                             f"split into nodes of {ranks_per_node} (HVD_QSGD_RANKS_PER_NODE, else Horovod's "
                             "local_size)")
    return ranks_per_node, None


class HierarchicalChain:
    """Inside the node uncompressed, across nodes compressed (see the module docstring)."""

    name = "hierarchical"

    @staticmethod
    def encode(run, ex, x):
        """Nothing is quantized before the node's sum: the tensor waits in float32."""
        if ex.settings.server_error_feedback:
            raise ValueError("the hierarchical reduction quantizes each shard once (no re-quantization for a "
                             "server residual to feed back): pass server_error_feedback=False (error_feedback=True "
                             "keeps the residual of the shard this rank encodes)")
        b, e = _shard_ranges(ex)[_layout(ex)[3]]
        run.check_residual(ex, e - b)  # a residual of another size fails here, on every rank
        ex.payload = ex.backend.float32(x)
        ex.own_len = 0

    @staticmethod
    def start(run, ex):
        """Node scatter: shard j of this rank's tensor to its node's rank j."""
        per_node, _, node, local = _layout(ex)
        splits = [0] * len(ex.set_ranks)
        for j, (b, e) in enumerate(_shard_ranges(ex)):
            splits[node * per_node + j] = e - b
        ex.stage = "node scatter"
        buf, ex.payload = ex.payload, None
        ex.sent += 4 * (sum(splits) - splits[ex.set_rank])
        ex.handle = run.collectives.alltoall(buf, splits, f"{ex.route.exchange}.node_scatter", ex.group)
        return True

    @staticmethod
    def advance(run, ex):
        if ex.stage == "node scatter":
            return HierarchicalChain._cross(run, ex)
        if ex.stage == "cross scatter":
            return HierarchicalChain._cross_reduce(run, ex)
        return HierarchicalChain._node_gather(run, ex)

    @staticmethod
    def _cross(run, ex):
        """Node sum of this rank's shard, encoded, sent to the ranks holding the shard on every node."""
        per_node, nodes, node, local = _layout(ex)
        received, rsplits = run.collectives.wait(ex.handle)
        b = ex.backend
        ex.received += 4 * (b.total(rsplits) - rsplits[ex.set_rank])
        begin, end = _shard_ranges(ex)[local]
        ex.cross = cross_reduction(ex.settings, per_node, nodes, end - begin) if b.reduces_across_nodes else "allgather"
        payload, lens = run.timed("encode_s", lambda: HierarchicalChain._node_sum_encoded(run, ex, received, end - begin),
                                  received)
        splits = [0] * len(ex.set_ranks)
        for k, peer in enumerate(_peers(ex)):
            splits[peer] = lens[k]
        ex.sent += sum(lens) - lens[node]
        ex.cross_sent = sum(lens) - lens[node]
        ex.stage = "cross" if ex.cross == "allgather" else "cross scatter"
        ex.handle = run.collectives.alltoall(payload, splits, f"{ex.route.exchange}.cross", ex.group)
        return True

    @staticmethod
    def _node_sum_encoded(run, ex, received, m):
        """(what this rank sends its cross peers, the bytes for each): the payload(s) of the node's sum
        of its shard of m elements, summed in local-rank order (the same bits wherever it is summed);
        nothing after a failure (kept in ``reduce_error``: the cross peers miss this payload, and they
        and this node raise)."""
        per_node, nodes, _, local = _layout(ex)
        b = ex.backend
        try:
            b.check_size(received, per_node * m, lambda found: f"{ex.where}: received {found} elements of shard "
                                                               f"{local}, expected {per_node} x {m}")
            if not m:
                return b.empty_bytes(received), [0] * nodes
            total = b.float32(b.slice(received, 0, m))   # (a copy: added to in place, in local-rank order)
            for k in range(1, per_node):
                total += b.slice(received, k * m, m)
            return HierarchicalChain._encode_shard(run, ex, total, m, nodes, local)
        except Exception as error:
            ex.reduce_error = error
            return b.empty_bytes(received), [0] * nodes

    @staticmethod
    def _encode_shard(run, ex, total, m, nodes, local):
        """(what this rank sends its cross peers back to back, the bytes for each peer): the shard's
        payload once for each node (allgather), or its c chunk payloads (scatter_allgather)."""
        residual, valid = run.worker_residual(ex, total, size=m)
        where = f"{ex.where}: shard {local}"
        b = ex.backend
        if ex.cross == "allgather":
            one = b.encode(total, ex.settings, ex.step_seed, ex.expect.fingerprint, ex.expect.dtype, where,
                           residual=residual, residual_valid=valid)
            out, lens = b.repeat(one, nodes), [b.length(one)] * nodes
        else:
            out, lens = b.encode_chunks(total, ex.settings, ex.step_seed, nodes, ex.expect.fingerprint,
                                        ex.expect.dtype, where, residual=residual, residual_valid=valid)
        run.keep_residual(ex, residual)
        return out, b.sizes(lens, nodes)

    @staticmethod
    def _cross_reduce(run, ex):
        """scatter_allgather across nodes: re-quantize the sum of the peers' payloads of this node's
        chunk of the shard; its frame to every peer (an empty frame after a failure: they raise)."""
        per_node, nodes, node, local = _layout(ex)
        received, rsplits = run.collectives.wait(ex.handle)
        peers = _peers(ex)
        lens = [rsplits[p] for p in peers]
        ex.received += sum(lens) - lens[node]
        ex.cross_received = sum(lens) - lens[node]
        b, e = _shard_ranges(ex)[local]
        frame, error = run.timed("decode_s", lambda: ex.backend.reduce_received(
            received, lens, node, ex.settings, ex.step_seed, _shard_expect(ex, e - b), f"{ex.where}: shard {local}"),
            received)
        ex.reduce_error = ex.reduce_error or error
        splits = [0] * len(ex.set_ranks)
        for peer in peers:
            splits[peer] = len(frame)
        ex.sent += len(frame) * (nodes - 1)
        ex.cross_sent += len(frame) * (nodes - 1)
        ex.stage = "cross"
        ex.handle = run.collectives.alltoall(ex.backend.repeat(frame, nodes), splits,
                                             f"{ex.route.exchange}.cross_gather", ex.group)
        return True

    @staticmethod
    def _node_gather(run, ex):
        """Shard result: decode the c payloads of this rank's shard; send it to the node's ranks (an
        empty shard where this rank could not encode or decode it: the node's ranks raise)."""
        per_node, nodes, node, local = _layout(ex)
        received, rsplits = run.collectives.wait(ex.handle)
        ex.handle = None
        b = ex.backend
        lens = [rsplits[p] for p in _peers(ex)]
        ex.received += sum(lens) - lens[node]
        ex.cross_received += sum(lens) - lens[node]
        begin, end = _shard_ranges(ex)[local]
        shard, error = run.timed("decode_s", lambda: HierarchicalChain._shard_result(ex, received, lens, end - begin),
                                 received)
        ex.reduce_error = error
        splits = [0] * len(ex.set_ranks)
        for j in range(per_node):
            splits[node * per_node + j] = b.length(shard)
        ex.sent += 4 * b.length(shard) * (per_node - 1)
        ex.stage = "node gather"
        ex.gather_handle = run.collectives.alltoall(b.repeat(shard, per_node), splits,
                                                    f"{ex.route.exchange}.node_gather", ex.group)
        return False

    @staticmethod
    def _shard_result(ex, received, lens, m):
        """(R_i, None), or (nothing, why) where this rank could not encode (or reduce) its shard or
        decode what the cross stage brought: R_i is the decode-sum of the c payloads (allgather), or
        the c reduced chunks decoded back to back (scatter_allgather)."""
        b, nodes, where = ex.backend, len(lens), f"{ex.where}: shard {_layout(ex)[3]}"
        if ex.reduce_error is not None:
            return b.zeros(0, received), ex.reduce_error
        if not m:  # an empty shard (a tensor of fewer buckets than the node has ranks)
            return b.zeros(0, received), None
        expect = _shard_expect(ex, m)
        if ex.cross == "allgather":
            return b.decode_report(received, lens, nodes, expect, where)
        try:
            chunks = b.unframe(received, nodes, where, expect)
            return b.decode_chunks(chunks, 1.0, m, ex.settings.bucket_size, f"{where}: reduced chunks",
                                   expect=expect), None
        except Exception as error:
            return b.zeros(0, received), error

    @staticmethod
    def own_dequantized(ex):
        return ex.backend.float32(ex.payload)

    @staticmethod
    def finish(run, ex, alpha):
        """The node's shard results back to back, times alpha."""
        if ex.gather_handle is None:
            raise protocol.MismatchError(f"{ex.where}: the first stages of the exchange failed on this rank")
        out, rsplits = run.wait(ex.gather_handle)
        per_node, _, node, local = _layout(ex)
        b = ex.backend
        b.raise_if_failed(ex.reduce_error, f"{ex.where}: this rank could not reduce shard {local}")
        got = [rsplits[node * per_node + j] for j in range(per_node)]
        def no_shard(empty):  # empty: the local indices of the ranks that sent none (None: not known here)
            who = "ranks of this node" if empty is None else f"ranks {[node * per_node + j for j in empty]} of this node"
            return f"{ex.where}: {who} sent no reduced shard: they could not reduce it (see the error on those ranks)"
        out = b.checked_sizes(out, got, [e - s for s, e in _shard_ranges(ex)], no_shard, ex.reduce_error)
        ex.received += 4 * (sum(got) - got[local])
        run.stats.exchanged(ex.expect.numel, ex.sent, ex.received, ex.cross_sent, ex.cross_received)
        return b.scaled(out, alpha)
