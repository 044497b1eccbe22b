"""The control-vector protocol (hvd_qsgd.protocol), by simulating n ranks' contributions and the
reductions Horovod applies (Sum, Average, pre/post-scaling, Min, Max, Product)."""
import itertools
import re

import numpy as np
import pytest

from hvd_qsgd import protocol
from hvd_qsgd.protocol import MismatchError


def contributions(world, members, tags_of):
    """Control vectors of every member of the set (global rank = set rank here)."""
    return [protocol.control_vector(world, g, members.index(g), tags_of(g)) for g in members]


def reduce(vectors, op="average", pre=1.0, post=1.0):
    """Horovod's reduction in float64: x * pre on each rank, combine, * post (and / n for Average)."""
    xs = [v * pre for v in vectors]
    if op in ("sum", "average"):
        out = np.zeros_like(xs[0])
        for x in xs:
            out = out + x
        return out * (post / len(xs) if op == "average" else post)
    return {"min": np.minimum, "max": np.maximum, "product": np.multiply}[op].reduce(xs)


class Tags:
    def __init__(self, base, overrides=None):
        self.base, self.overrides = base, overrides or {}

    def __call__(self, g):
        return self.overrides.get(g, self.base)


TAGS = protocol.exchange_tags(4, 0, 1234, 42)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 16, 25, 64])
@pytest.mark.parametrize("op,pre,post,alpha", [("average", 1.0, 1.0, "1/n"), ("sum", 1.0, 1.0, 1.0),
                                               ("average", 0.5, 2.0, "1/n"), ("average", 1 / 3, 3.0, "1/n"),
                                               ("sum", 0.25, 1.0, 0.25)])
def test_agreeing_ranks_pass_with_the_ops_scale(n, op, pre, post, alpha):
    members = list(range(n))
    tags = protocol.exchange_tags(n, 0, 77, 123456)
    r = reduce(contributions(n, members, Tags(tags)), op, pre, post)
    got = protocol.check_control(r, n, members, "t")
    assert got == (1.0 / n if alpha == "1/n" else alpha)


@pytest.mark.parametrize("n", [2, 3, 4, 16, 30])
@pytest.mark.parametrize("op", ["average", "sum"])
def test_every_single_tag_disagreement_is_caught(n, op):
    members = list(range(n))
    base = protocol.exchange_tags(n, 5, 300, 2 * 17)
    for i, name in enumerate(protocol.TAG_NAMES):
        for delta in (1, -1, 2047):
            bad = list(base)
            bad[i] = (bad[i] + delta) % protocol.TAG_RANGE
            for odd in (0, n - 1):
                r = reduce(contributions(n, members, Tags(base, {odd: tuple(bad)})), op)
                with pytest.raises(MismatchError, match=re.escape(f"disagree on the {name}")):
                    protocol.check_control(r, n, members, "t")


def test_tag_sums_stay_exact_at_the_largest_tags():
    n = 64
    members = list(range(n))
    top = (protocol.TAG_RANGE - 1,) * len(protocol.TAG_NAMES)
    r = reduce(contributions(n, members, Tags(top)), "average", 1 / 3, 3.0)
    assert protocol.check_control(r, n, members, "t") == 1 / n
    low = tuple(t - 1 for t in top)
    r = reduce(contributions(n, members, Tags(top, {5: low})), "average", 1 / 3, 3.0)
    with pytest.raises(MismatchError):
        protocol.check_control(r, n, members, "t")


@pytest.mark.parametrize("op", ["min", "max", "product"])
@pytest.mark.parametrize("n", [2, 3, 5, 30])
def test_other_ops_are_refused(op, n):
    members = list(range(n))
    r = reduce(contributions(n, members, Tags(protocol.exchange_tags(n, 0, 1, 2))), op)
    with pytest.raises(MismatchError, match="not a sum or an average"):
        protocol.check_control(r, n, members, "t")


@pytest.mark.parametrize("world,participants", [(4, [0, 1]), (4, [1, 2]), (4, [0, 1, 2]), (30, list(range(29))),
                                                (30, [0, 25]), (8, [3])])
def test_a_reduction_over_other_ranks_than_the_compressors_set_is_named(world, participants):
    members = list(range(world))  # the compressor's set: everyone
    tags = protocol.exchange_tags(world, 0, 1, 2)
    vectors = [protocol.control_vector(world, g, g, tags) for g in participants]
    for op in ("average", "sum"):
        with pytest.raises(MismatchError, match=rf"reduced over global ranks \[{', '.join(map(str, participants))}\]"):
            protocol.check_control(reduce(vectors, op), world, members, "t")


def test_a_vector_that_passed_passes_again_only_for_its_world_and_set():
    """check_control keeps the alpha of a vector that passed: the same vector passes again with the
    same alpha; against another set or world it is checked anew, and raises."""
    world, members = 4, [0, 1, 2, 3]
    tags = protocol.exchange_tags(world, 3, 999, 2 * 4099)
    r = reduce(contributions(world, members, Tags(tags)), "average")
    assert protocol.check_control(r, world, members, "t") == 0.25
    assert protocol.check_control(r.copy(), world, members, "t") == 0.25   # (kept)
    with pytest.raises(MismatchError, match=r"reduced over global ranks \[0, 1, 2, 3\]"):
        protocol.check_control(r, world, [0, 1], "t")
    with pytest.raises(MismatchError, match="entries instead of"):
        protocol.check_control(r, 40, list(range(40)), "t")
    bad = list(tags)
    bad[2] += 1
    r_bad = reduce(contributions(world, members, Tags(tags, {2: tuple(bad)})), "average")
    with pytest.raises(MismatchError, match="disagree on the compressor settings"):
        protocol.check_control(r_bad, world, members, "t")


def test_ranks_outside_the_set_and_failed_ranks_are_reported():
    world, members = 4, [0, 1]
    tags = protocol.exchange_tags(2, 0, 1, 2)
    # rank 2 joins a reduction the compressor's set (0, 1) does not include
    vectors = [protocol.control_vector(world, g, members.index(g) if g in members else None, tags)
               for g in (0, 1, 2)]
    with pytest.raises(MismatchError):
        protocol.check_control(reduce(vectors), world, members, "t")
    vectors = [protocol.control_vector(world, g, g, tags, failed=(g == 1)) for g in (0, 1)]
    with pytest.raises(MismatchError, match="1 rank\\(s\\) could not encode"):
        protocol.check_control(reduce(vectors), world, members, "t")
    with pytest.raises(MismatchError, match="my own reason"):
        protocol.check_control(reduce(vectors), world, members, "t", fault_message="my own reason")


def test_reducescatter_shaped_results_are_refused():
    v = protocol.control_vector(4, 0, 0, TAGS)
    with pytest.raises(MismatchError, match="reducescatter"):
        protocol.check_control(v[:5], 4, [0, 1, 2, 3], "t")


def test_payload_seeds_differ_per_rank_and_exchange():
    seeds = {protocol.payload_seed(0, r, f"hvd_qsgd.0.s{k}", i)
             for r, k, i in itertools.product(range(16), range(64), range(4))}
    assert len(seeds) == 16 * 64 * 4
    assert protocol.payload_seed(1, 0, "x") != protocol.payload_seed(0, 0, "x")
    assert all(0 <= s < 2**64 for s in seeds)


def joined_reduce(vectors_of_present, n, op):
    """Horovod's allreduce while some ranks have joined: they add zeros; Average divides by n."""
    total = np.zeros_like(vectors_of_present[0])
    for v in vectors_of_present:
        total = total + v
    return total * (1.0 / n if op == "average" else 1.0)


@pytest.mark.parametrize("world,present", [(2, [0]), (2, [1]), (3, [0, 1]), (3, [0, 2]), (4, [3]), (30, [0, 25, 29]),
                                           (30, list(range(29)))])
@pytest.mark.parametrize("op", ["average", "sum"])
def test_a_vector_with_joined_ranks_passes_as_the_stepping_ranks(world, present, op):
    """Joined ranks add zeros: check_control fails as is, and passes given the ranks that took part,
    with Horovod's scale (Average: 1/n of the whole set, as for its own allreduce with joined ranks)."""
    members = list(range(world))
    tags = protocol.exchange_tags(world, 0, 1, 2)
    r = joined_reduce([protocol.control_vector(world, g, g, tags) for g in present], world, op)
    with pytest.raises(MismatchError):
        protocol.check_control(r, world, members, "t")
    want = 1.0 / world if op == "average" else 1.0
    assert protocol.check_control(r, world, members, "t", present=present) == want
    got_present, alpha, certain = protocol.joined_verdict(r, world, members, "t")
    assert got_present == present and alpha == want and certain == (op == "average")
    # a presence vector of the same ranks reads back as them
    pv = sum(protocol.presence_vector(world, j) for j in present)
    assert protocol.present_ranks(pv, "t") == present


def test_a_reduction_over_a_smaller_set_with_average_is_not_taken_for_a_join():
    world, participants = 4, [0, 1]
    tags = protocol.exchange_tags(world, 0, 1, 2)
    r = reduce([protocol.control_vector(world, g, g, tags) for g in participants], "average")
    assert protocol.joined_verdict(r, world, list(range(world)), "t") is None


def test_joined_checks_still_catch_faults_tags_and_bad_presence():
    world, present = 3, [0, 2]
    tags = protocol.exchange_tags(world, 0, 1, 2)
    bad = list(tags)
    bad[2] += 1
    r = joined_reduce([protocol.control_vector(world, 0, 0, tags), protocol.control_vector(world, 2, 2, tuple(bad))],
                      world, "average")
    with pytest.raises(MismatchError, match="disagree on the compressor settings"):
        protocol.joined_verdict(r, world, list(range(world)), "t")
    r = joined_reduce([protocol.control_vector(world, 0, 0, tags), protocol.control_vector(world, 2, 2, tags, True)],
                      world, "average")
    with pytest.raises(MismatchError, match="could not encode"):
        protocol.joined_verdict(r, world, list(range(world)), "t")
    ok = joined_reduce([protocol.control_vector(world, g, g, tags) for g in present], world, "average")
    with pytest.raises(MismatchError):  # participants the vector does not show
        protocol.check_control(ok, world, list(range(world)), "t", present=[0, 1])
    for v in ([0.0, 0.0, 0.0], [1.0, 2.0, 0.0], [0.5, 1.0, 1.0]):
        with pytest.raises(MismatchError, match="presence vector"):
            protocol.present_ranks(np.array(v), "t")
