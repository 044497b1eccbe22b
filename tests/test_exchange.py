"""The framework-free exchange (hvd_qsgd.exchange) in one process: n threads stand for n ranks, over
an in-process implementation of its collectives interface. Every chain (allgather,
scatter_allgather, hierarchical at several node layouts) equals its single-process reference bit
for bit on every "rank", and counts the bytes it sent. (Under horovodrun and mpirun:
tests/test_torch_compressor.py, tests/test_hierarchical.py, tests/test_mpi_reduction.py.)"""
import sys
import threading
from collections import deque

import numpy as np
import pytest

from hvd_qsgd import codec, protocol, reduction
from hvd_qsgd.exchange.chains import CHAINS
from hvd_qsgd.exchange.collectives import BlockingCollectives
from hvd_qsgd.exchange.hierarchical import cross_reduction
from hvd_qsgd.exchange.runner import ExchangeRunner
from hvd_qsgd.policy import FixedBits
from hvd_qsgd.settings import REDUCTIONS, Settings
from hvd_qsgd.state import ExchangeNames, Route
from hvd_qsgd.unnamed_calls import UnnamedCalls
from tests import references


class ThreadGroup(BlockingCollectives):
    """n threads as the ranks of one group: each collective is a barrier on both sides of a shared
    table of what every rank put in."""

    def __init__(self, n):
        self.n = n
        self.table = [None] * n
        self.barrier = threading.Barrier(n)
        self.local = threading.local()

    def _exchange(self, value):
        r = self.local.rank
        self.table[r] = value
        self.barrier.wait()
        seen = list(self.table)
        self.barrier.wait()
        return seen

    def run_allreduce(self, array, group):
        return np.sum(self._exchange(np.asarray(array)), axis=0).astype(array.dtype)

    def run_allgather(self, array, group):
        return np.concatenate(self._exchange(np.asarray(array)))

    def run_alltoall(self, array, splits, group):
        sent = self._exchange((np.asarray(array), list(splits)))
        r = self.local.rank
        pieces, counts = [], []
        for buf, s in sent:
            offset = sum(s[:r])
            pieces.append(buf[offset: offset + s[r]])
            counts.append(s[r])
        return np.concatenate(pieces), counts


def on_threads(n, fn):
    """fn(group, rank) on n threads over one ThreadGroup; their results in rank order (the first
    thread's exception re-raised, the others released from the barrier)."""
    group = ThreadGroup(n)
    results, errors = [None] * n, []

    def body(r):
        group.local.rank = r
        try:
            results[r] = fn(group, r)
        except Exception as e:
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


def reduce_on_threads(xs, settings, per_node=None, steps=1):
    """(result, bytes sent) of every rank's exchange of xs[r] through an ExchangeRunner (alpha 1/n);
    with ``steps``, the list of every step's (result, bytes sent), one runner a rank (its residuals
    kept from step to step), occurrence i in step i."""
    n = len(xs)

    def rank(group, r):
        runner = ExchangeRunner(group, 0, settings, FixedBits(settings), owner="test")
        out = []
        for step in range(steps):
            ex = runner.open("t", xs[r].size, "float32", xs[r].shape, "cpu", None, list(range(n)), r, n,
                             route=Route("t", "t", step, 0, "t", "t", None), where="test", ranks_per_node=per_node)
            assert ex.fault is None, ex.fault
            before = runner.stats.as_dict()["bytes_sent"]
            runner.encode(ex, np.ascontiguousarray(xs[r], dtype=np.float32).reshape(-1))
            out.append((runner.run_in_order(ex, 1.0 / n), runner.stats.as_dict()["bytes_sent"] - before))
        stats[r] = runner.stats.as_dict()
        return out[0] if steps == 1 else out

    last_stats[:] = [None] * n
    stats = last_stats
    return on_threads(n, rank)


last_stats = []   # every rank's stats after the last reduce_on_threads


def inputs(n, numel):
    return [np.random.default_rng(50 + r).standard_normal(numel).astype(np.float32) for r in range(n)]


def seeds(settings, n, occurrence=0):
    return [protocol.payload_seed(settings.seed, r, "t", occurrence) for r in range(n)]


def fingerprint(x):
    return codec.tensor_fingerprint("t", x.shape, "float32")


@pytest.mark.parametrize("n, numel", [(2, 20000), (3, 1001), (4, 300)])
def test_allgather_chain_equals_decode_sum_of_every_payload(n, numel):
    s = Settings.make(bits=4, reduction="allgather", min_numel=1)
    xs = inputs(n, numel)
    got = reduce_on_threads(xs, s)
    payloads = [codec.encode(x, 4, s.bucket_size, s.norm, seed, s.coding, fingerprint(x), s.checksum)
                for x, seed in zip(xs, seeds(s, n))]
    ref = codec.decode_sum(payloads, 1.0 / n)
    for out, sent in got:
        assert np.array_equal(out, ref)
        assert sent == payloads[0].size


@pytest.mark.parametrize("n, numel", [(3, 20011), (4, 1001), (5, 300)])
def test_scatter_allgather_chain_equals_the_two_phase_simulation(n, numel):
    s = Settings.make(bits=4, bucket_size=128, reduction="scatter_allgather", min_numel=1)
    xs = inputs(n, numel)
    got = reduce_on_threads(xs, s)
    ref, _, _ = reduction.simulate(xs, s, seeds(s, n), 1.0 / n, fingerprint(xs[0]))
    for out, _ in got:
        assert np.array_equal(out, ref)


@pytest.mark.parametrize("n, per_node, numel", [(4, 2, 20000), (6, 2, 1001), (6, 3, 30001), (4, 4, 5000),
                                                (4, 1, 5000), (4, 2, 300), (6, 2, 600_001), (8, 2, 400_000),
                                                (8, 1, 1_000_000)])
def test_hierarchical_chain_equals_the_three_stage_reference(n, per_node, numel):
    """Every layout, the cross stage by allgather and (the last three: 3, 4 and 8 nodes, shards large
    enough for the cost model) by scatter_allgather."""
    s = Settings.make(bits=4, reduction="hierarchical", min_numel=1)
    xs = inputs(n, numel)
    shard = reduction.chunk_ranges(numel, s.bucket_size, per_node)[0]
    assert (cross_reduction(s, per_node, n // per_node, shard[1] - shard[0]) == "scatter_allgather") == (
        numel > 300_000), "the parameters no longer exercise both cross stages"
    got = reduce_on_threads(xs, s, per_node=per_node)
    ref, sent = references.hierarchical(xs, s, seeds(s, n), per_node, 1.0 / n, fingerprint(xs[0]))
    nodes = n // per_node
    for r, (out, bytes_sent) in enumerate(got):
        assert np.array_equal(out, ref), f"rank {r}"
        b, e = reduction.chunk_ranges(numel, s.bucket_size, per_node)[r % per_node]
        cross = sent[r % per_node][r // per_node]
        assert bytes_sent == 4 * (numel - (e - b)) + cross + 4 * (e - b) * (per_node - 1)


@pytest.mark.parametrize("n, per_node, numel", [(4, 2, 5001), (6, 3, 5001), (6, 2, 1_000_001)])
def test_hierarchical_error_feedback_keeps_the_residual_of_the_shard_each_rank_encodes(n, per_node, numel):
    """Three steps; the last case's cross stage is scatter_allgather (the residual is that of the
    rank's chunk payloads of its shard)."""
    s = Settings.make(bits=2, reduction="hierarchical", min_numel=1, error_feedback=True)
    xs = inputs(n, numel)
    shard = reduction.chunk_ranges(numel, s.bucket_size, per_node)[0]
    assert (cross_reduction(s, per_node, n // per_node, shard[1] - shard[0]) == "scatter_allgather") == (
        numel > 100_000)
    got = reduce_on_threads(xs, s, per_node=per_node, steps=3)
    residuals = {}
    for step in range(3):
        ref, _ = references.hierarchical(xs, s, seeds(s, n, step), per_node, 1.0 / n, fingerprint(xs[0]),
                                         residuals=residuals)
        for r in range(n):
            assert np.array_equal(got[r][step][0], ref), f"step {step}, rank {r}"
    assert len(residuals) == n  # one residual per (node, shard): per rank


def test_bytes_to_other_nodes_are_counted_for_every_reduction():
    """Nodes of 2 at 4 ranks: allgather sends its payload to the 2 ranks of the other node;
    scatter_allgather its chunks for them and its frame twice; hierarchical its shard's payload once;
    and each rank receives what the others addressed to it."""
    n, numel = 4, 20000
    xs = inputs(n, numel)
    for red in ("allgather", "scatter_allgather", "hierarchical"):
        s = Settings.make(bits=4, reduction=red, min_numel=1)
        reduce_on_threads(xs, s, per_node=2)
        sent = [st["cross_bytes_sent"] for st in last_stats]
        received = [st["cross_bytes_received"] for st in last_stats]
        assert sum(sent) == sum(received) > 0, (red, sent, received)
        if red == "allgather":
            p = codec.payload_nbytes(numel, 4, s.bucket_size)
            assert sent == [2 * p] * n, (sent, p)
        if red == "hierarchical":
            _, payloads = references.hierarchical(xs, s, seeds(s, n), 2, 1.0 / n, fingerprint(xs[0]))
            assert sent == [payloads[r % 2][r // 2] for r in range(n)], sent
            # what leaves a node: (c - 1) P with P the whole tensor's payload, against 2 (c - 1) P
            # for the allgather at 2 ranks a node
            assert sent[0] + sent[1] <= 1.01 * codec.payload_nbytes(numel, 4, s.bucket_size)


@pytest.mark.parametrize("red", ["allgather", "scatter_allgather", "hierarchical"])
def test_every_chain_encodes_with_the_encoder_setting(red):
    """encoder=1 and the default, 2: each chain equals its reference made with that encoder bit for
    bit on every rank (scatter_allgather's reduce step and the hierarchical cross stage included), and
    the two encoders' results differ (the random streams differ), so no step kept the default."""
    n, per_node = 4, (2 if red == "hierarchical" else None)
    xs = inputs(n, 20011)
    results = {}
    for encoder in (1, 2):
        s = Settings.make(bits=4, bucket_size=128, reduction=red, min_numel=1, encoder=encoder)
        if red == "allgather":
            ref = codec.decode_sum([codec.encode(x, 4, 128, s.norm, seed, s.coding, fingerprint(x), s.checksum,
                                                 encoder=encoder) for x, seed in zip(xs, seeds(s, n))], 1.0 / n)
        elif red == "scatter_allgather":
            ref = reduction.simulate(xs, s, seeds(s, n), 1.0 / n, fingerprint(xs[0]))[0]
        else:
            ref = references.hierarchical(xs, s, seeds(s, n), per_node, 1.0 / n, fingerprint(xs[0]))[0]
        for r, (out, _) in enumerate(reduce_on_threads(xs, s, per_node=per_node)):
            assert np.array_equal(out, ref), f"encoder {encoder}, rank {r}"
        results[encoder] = ref
    assert not np.array_equal(results[1], results[2])


def test_every_reduction_has_a_chain():
    assert set(CHAINS) == set(REDUCTIONS) - {"auto"}


def test_a_layout_that_does_not_split_the_ranks_is_a_fault_on_every_rank():
    s = Settings.make(bits=4, reduction="hierarchical", min_numel=1)

    def rank(group, r):
        runner = ExchangeRunner(group, 0, s, FixedBits(s), owner="test")
        return runner.open("t", 100, "float32", (100,), "cpu", None, list(range(4)), r, 4,
                           route=Route("t", "t", 0, 0, "t", "t", None), where="test", ranks_per_node=3).fault

    faults = on_threads(4, rank)
    assert all(isinstance(f, ValueError) and "do not split into nodes of 3" in str(f) for f in faults), faults
    faults = on_threads(4, rank)  # (an opening that found a fault is not kept: each exchange raises it)
    assert all(isinstance(f, ValueError) and "do not split into nodes of 3" in str(f) for f in faults), faults


def test_each_exchange_of_a_tensor_starts_from_its_opening_and_owns_its_fields():
    """A tensor's opening (hvd_qsgd.exchange.openings) is made once and copied: each exchange has its
    own route and fields (one's fault is not the next one's), the same expectation and resolved
    reduction, and a backend's fallback is counted for every exchange."""
    s = Settings.make(bits=4, min_numel=1)
    runner = ExchangeRunner(ThreadGroup(1), 0, s, FixedBits(s), owner="test")
    a = runner.open("w", 5000, "float32", (50, 100), "cpu", None, [0, 1], 0, 2)
    runner.names.finish(a.route)   # (its decompress: the next exchange of "w" is its next occurrence)
    b = runner.open("w", 5000, "float32", (50, 100), "cpu", None, [0, 1], 0, 2)
    assert a.route.occurrence == 0 and b.route.occurrence == 1 and a.where == b.where == "hvd_qsgd: tensor 'w'"
    assert a.reduction == b.reduction in ("allgather", "scatter_allgather") and a.chain is b.chain
    assert vars(a.expect) == vars(b.expect) and a.expect.numel == 5000
    a.fault, a.payload = ValueError("a's own"), "a's own"
    assert b.fault is None and b.payload is None
    runner.open("w", 5000, "float32", (5000,), "cpu", None, [0, 1], 0, 2)  # another shape: its own opening
    assert len(runner.openings._kept) == 2
    cuda = [runner.open("c", 5000, "float32", (5000,), "cuda", None, [0, 1], 0, 2) for _ in range(3)]
    if all(ex.backend.name == "cpu" for ex in cuda):  # no CUDA backend here: each exchange a counted fallback
        assert runner.stats.as_dict()["host_fallbacks"] == 3


def test_tensors_of_one_group_share_its_open_buffer_whichever_group_object_they_hold():
    """A fusion buffer's group is one object per key (``BufferGroup.of``), equal by key to one made
    after the kept groups were dropped: tensors of the same set, settings and dtype fill one buffer,
    each at the next multiple of the bucket size, and the buffer closes once no compressed tensor
    fits (its room: capacity less ``min_numel``)."""
    from hvd_qsgd.exchange import buffers
    s = Settings.make(bits=4, bucket_size=512, min_numel=1000, fusion_mb=0.02)   # 5,242 elements a buffer
    group = ThreadGroup(1)
    group.local.rank = 0
    runner = ExchangeRunner(group, 0, s, FixedBits(s), owner="test")
    opened = [runner.open(f"w{i}", 1500, "float32", (1500,), "cpu", None, [0], 0, 1) for i in range(3)]
    first = opened[0].group_key
    assert opened[1].group_key is first and (first.bucket, first.cap, first.room) == (512, 5242, 4242)
    buffers._GROUPS.clear()   # (an equal group made after: the same buffers)
    opened.append(runner.open("w3", 600, "float32", (600,), "cpu", None, [0], 0, 1))   # (it would fit the third's)
    assert opened[3].group_key is not first and opened[3].group_key == first and hash(opened[3].group_key) == hash(first)
    for i, ex in enumerate(opened):
        runner.encode(ex, np.full(ex.expect.numel, float(i), dtype=np.float32))
        runner.start(ex)
    assert [ex.offset for ex in opened] == [0, 1536, 3072, 0]   # (the third left no room: a new buffer)
    assert opened[0].fused is opened[2].fused is not opened[3].fused
    assert [(name, [o for _, o, _ in members]) for name, _, members in runner.buffers.recent] == \
        [(opened[0].fused.route.exchange, [0, 1536, 3072])]


def test_a_residual_of_another_size_names_a_checkpoint_of_another_model_among_the_causes():
    """A kept residual whose size is not what this rank encodes (a checkpoint of a model of other
    widths, loaded by name) fails the encode, naming the parameter and the checkpoint."""
    s = Settings.make(bits=4, reduction="allgather", min_numel=1, error_feedback=True)
    x = np.ones(300, np.float32)

    def rank(group, r):
        runner = ExchangeRunner(group, 0, s, FixedBits(s), owner="test")
        runner.residuals.residuals["fc.weight"] = np.zeros(7, np.float32)
        ex = runner.open("fc.weight", x.size, "float32", x.shape, "cpu", None, [0], 0, 1,
                         route=Route("t", "t", 0, 0, "fc.weight", "fc.weight", None), where="test", ranks_per_node=None)
        with pytest.raises(protocol.MismatchError, match=r"residual \(parameter 'fc.weight'\) has 7 elements, what "
                                                         r"this rank encodes 300: load_state_dict loaded a checkpoint"):
            runner.encode(ex, x)
    on_threads(1, rank)


def test_a_new_unnamed_call_on_a_thread_is_handed_what_the_earlier_one_left():
    """``UnnamedCalls``: the exchanges of one call (one frame) stay together; what a call left at its
    decompress-less end (its collective raised) goes to the next call of that thread only, and a call
    that ended every exchange leaves nothing; ``take_call_slot`` frees the slots so left, so the next
    call's names are what the other ranks, which held none, give theirs."""
    first, second, third = object(), object(), object()   # (stand-ins for Horovod's frames)
    calls = UnnamedCalls()
    calls.hold(first, "a")
    calls.hold(first, "b")
    assert calls.begin(first) == []               # the same call: nothing to hand over
    calls.end("a")
    assert calls.begin(second) == ["b"]           # "b" never reached its decompress
    assert calls.begin(third) == []               # handed over once
    calls.hold(third, "c")
    calls.end("c")
    assert calls.begin(first) == []               # every exchange of "third" ended
    seen = []
    other = threading.Thread(target=lambda: seen.append(calls.begin(second)))
    calls.hold(first, "d")
    other.start()
    other.join()
    assert seen == [[]] and calls.begin(second) == ["d"]   # another thread's calls are its own
    ended = UnnamedCalls()

    def call_running():   # (a Horovod call, its frame on the stack while it runs)
        ended.hold(sys._getframe(), "e")
        assert ended.ended() == [] and ended   # still running: nothing ended

    call_running()
    assert ended.ended() == ["e"] and not ended   # returned (raised) without ending "e"
    names = ExchangeNames(0)
    assert names.take_call_slot(first) == 0 and names.take_call_slot(first) == 1
    names.release_slot(1)                         # slot 0's exchange raised before its decompress
    assert names.take_call_slot(second) == 0 and names.slots == {0}
    names.release_slot(0)
    assert names.take_call_slot(third) == 0 and names.take_slot() == 1


def test_a_planned_buffer_places_its_members_by_the_optimizers_order_whatever_order_they_come_in():
    """Fusion buffers planned from the optimizer's parameters (hvd_qsgd.exchange.buffer_plan): the
    plan packs the gradients that would go in a buffer (of the group's dtype and device, between
    min_numel and a buffer's capacity) in the order given, each at the next multiple of the bucket
    size, a new buffer where one does not fit or where no compressed tensor fits any more; members
    that come in another order land at their planned offsets, and a buffer closes once its last
    member is there, named after its plan, its layout in offset order."""
    from hvd_qsgd.exchange.buffer_plan import ParameterOrder, plan_of
    s = Settings.make(bits=4, bucket_size=512, min_numel=1000, fusion_mb=0.02)   # 5,242 elements a buffer
    group = ThreadGroup(1)
    group.local.rank = 0
    runner = ExchangeRunner(group, 0, s, FixedBits(s), owner="test")
    entries = [("a", 1500, "float32", "cpu"), ("small", 999, "float32", "cpu"), ("b", 1500, "float32", "cpu"),
               ("half", 1500, "float16", "cpu"), ("c", 2000, "float32", "cpu"), ("big", 6000, "float32", "cpu"),
               ("d", 1200, "float32", "cpu"), ("e", 4500, "float32", "cpu"), ("gpu", 1500, "float32", "cuda")]
    order = ParameterOrder(entries)
    sizes = {n: k for n, k, _, _ in entries}
    came = ["c", "a", "e", "d", "b"]   # (another order than the plan's)
    opened = [runner.open(n, sizes[n], "float32", (sizes[n],), "cpu", None, [0], 0, 1, order=order) for n in came]
    plan = plan_of(order, opened[0].group_key)
    # a at 0, b at 1536, c at 3072 (ends 5072 <= 5,242, past the room of 4,242: the buffer is full);
    # d at 0 (ends 1200); e at 1536 would end past 5,242: a buffer of its own, full (the last buffer
    # closes as it fills only where full, or with overlap: else at the first decompress)
    assert plan.places == {"a": (0, 0), "b": (0, 1536), "c": (0, 3072), "d": (1, 0), "e": (2, 0)}
    assert (plan.numels, plan.counts, plan.open_last) == ([5072, 1200, 4500], [3, 1, 1], False)
    assert plan_of(ParameterOrder(entries[:1]), opened[0].group_key).open_last
    for i, ex in enumerate(opened):
        runner.encode(ex, np.full(ex.expect.numel, float(i), dtype=np.float32))
        runner.start(ex)
    assert {ex.route.param: ex.offset for ex in opened} == {n: o for n, (_, o) in plan.places.items()}
    names = [name for name, _, _ in runner.buffers.recent]
    assert names == [f"hvd_qsgd.0.b{order.tag}.{i}" for i in (2, 1, 0)], names   # (closed as each filled)
    assert [[(m.rsplit(".", 1)[1], o) for m, o, _ in members] for _, _, members in runner.buffers.recent] == \
        [[("e", 0)], [("d", 0)], [("a", 0), ("b", 1536), ("c", 3072)]]
    # a planned member that never comes (a sparse gradient, reduced without the compressor) takes no
    # room: the buffer, closed at the first decompress of a member, packs those there
    other = ExchangeRunner(group, 1, s, FixedBits(s), owner="test")
    there = [other.open(n, sizes[n], "float32", (sizes[n],), "cpu", None, [0], 0, 1, order=order) for n in ("c", "a")]
    for ex in there:
        other.encode(ex, np.ones(ex.expect.numel, dtype=np.float32))
        other.start(ex)
    assert other.buffers.recent == deque()   # (b has not come: open)
    other.buffers.close(other, there[0], lambda: "presence")
    assert [(m.rsplit(".", 1)[1], o, k) for m, o, k in other.buffers.recent[-1][2]] == [("a", 0, 1500), ("c", 1536, 2000)]
    assert [ex.offset for ex in there] == [1536, 0] and there[0].fused.expect.numel == 3536
    late = runner.open("x", 1500, "float32", (1500,), "cpu", None, [0], 0, 1, order=order)   # (not in the plan)
    runner.encode(late, np.zeros(1500, dtype=np.float32))
    runner.start(late)
    assert late.fused.plan is None and late.offset == 0
