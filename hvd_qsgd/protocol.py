"""How ranks agree on a compressed exchange, and how they find out when they do not.

Horovod's ``Compressor`` interface hands ``compress(tensor)`` nothing but the tensor: no name, no
reduction op, no process set. Horovod then allreduces whatever ``compress`` returns, under the
name the caller chose, and passes the result to ``decompress``. QSGD payloads cannot be summed, so
they travel by a separate allgather, and the tensor handed to Horovod's allreduce becomes a small
**control vector** (float64, ``control_length(world_size)`` entries). Horovod reduces it under the
caller's name, so its result tells every rank, identically, what the other ranks did with that name:

    entry               rank r contributes            the reduced value, op scale c
    ONE                 1                             c * m                (m ranks took part)
    RANK                r (its rank in the set)       c * sum r
    FAULT               1 if r failed to encode       c * (#failed)
    tag t, tag^2        t, t^2 for each tag           c * sum t, c * sum t^2
    MEMBERS[j]          2^(g mod 24) in chunk g // 24 c * (bitmask of global ranks g)
    COMPLEMENT[j]       2^24 - 1 - MEMBERS[j]         c * (m (2^24 - 1) - bitmask)

Tags are small integers (< 4096) that must agree on every rank: the set size, the compressor's
creation index, its settings, and the exchange key (which allgather carries this tensor's payload).
With integers below 2^12 every sum is exact in float64, and the single rounding of a scale keeps the
relative error under 2^-50, so the checks below are exact decisions:

* the op is a sum with a positive scale: ``MEMBERS + COMPLEMENT = ONE * (2^24 - 1)`` in every
  chunk (Min, Max and Product of two or more ranks break it), and ``RANK = c * n (n - 1) / 2``
  with ``c = ONE / n`` where n is the set size;
* every member of the compressor's process set, and no other rank, took part: ``MEMBERS / c`` is the
  set's bitmask, chunk by chunk;
* nobody failed: ``FAULT == 0``;
* every tag agreed: ``mean(t^2) - mean(t)^2 == 0`` (a disagreement by at least 1 makes this at
  least (n - 1) / n^2, far above the rounding error).

The vector and the checks are implemented once, in ``kernels/qsgd_control.cc``
(``qsgd_control_vector``, ``qsgd_check_control``), for this module and the TensorFlow op alike;
this module adds the error messages. The verdict is computed from the same reduced vector on every
rank, so either every rank proceeds to wait for the payload allgather (which all ranks are then
known to have started under the same name) or every rank raises ``MismatchError``. Nothing waits on
an exchange another rank never began.

Joined ranks (``hvd.join``). Horovod's allreduce goes on with joined ranks adding zeros, its allgather
and alltoall do not. So before its payloads move, every exchange allreduces a **presence vector**
(``presence_vector``: 1 at the sender's set rank); the payload collectives start only when it shows
every rank of the set. When it does not, the control vector is the stepping ranks' alone, and
``joined_verdict`` checks it as theirs (``check_control(present=...)``, C ``qsgd_check_control_present``):
the scale is then c = ONE / m for m stepping ranks, and Average still divides by the set size n, as
Horovod does for its own joined allreduce. Average over a smaller process set (c m = 1) is not a join.

The gradient scale ``alpha`` applied to the decoded sum is ``c``: ``1/n`` for Average (also with
Horovod's ``gradient_predivide_factor``, which splits 1/n into a pre- and post-scale), 1 for Sum, and
``prescale * postscale`` (times 1/n for Average) for ``hvd.allreduce``'s explicit factors.
"""
import ctypes
import functools
import hashlib
import operator

import numpy as np

from hvd_qsgd import _native, codec
from hvd_qsgd.errors import MismatchError  # noqa: F401  (part of this module's API)

TAG_RANGE = 4096          # tags are integers in [0, TAG_RANGE)     (QSGD_CONTROL_TAG_RANGE)
MEMBER_BITS = 24          # global ranks per MEMBERS entry            (QSGD_CONTROL_MEMBER_BITS)
ONE = 0                   # the entry every rank sets to 1
TAG_NAMES = ("process set size", "compressor creation order", "compressor settings",
             "exchange key (low bits)", "exchange key (high bits)")
TAGS = 3                  # first tag entry
MEMBERS = TAGS + 2 * len(TAG_NAMES)


def _hash64(text):
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def small_hash(text, modulus=TAG_RANGE):
    """A stable hash of ``text`` in [0, modulus)."""
    return _hash64(text) % modulus


def control_length(world_size):
    """Entries of the control vector for a job of ``world_size`` ranks (the same on every rank)."""
    return int(_native.load().qsgd_control_length(int(world_size)))


def exchange_tags(set_size, creation_index, settings_tag, key):
    """The tags of one exchange; ``key`` is a non-negative integer identifying the allgather."""
    return (int(set_size) % TAG_RANGE, int(creation_index) % TAG_RANGE, int(settings_tag) % TAG_RANGE,
            int(key) % TAG_RANGE, (int(key) // TAG_RANGE) % TAG_RANGE)


def control_vector(world_size, global_rank, set_rank, tags, failed=False):
    """This rank's contribution (a float64 NumPy array). A rank outside the set passes
    ``set_rank=None``: it contributes no membership bit, which every rank then sees."""
    v = np.empty(control_length(world_size), dtype=np.float64)
    t = np.ascontiguousarray(tags, dtype=np.int32)
    st = _native.load().qsgd_control_vector(int(world_size), int(global_rank),
                                            -1 if set_rank is None else int(set_rank), _native.address(t),
                                            int(bool(failed)), _native.address(v), v.size)
    if st != _native.OK:
        raise ValueError(f"control_vector: {_native.status_string(st)} (world {world_size}, rank "
                         f"{global_rank}, tags {tuple(tags)})")
    return v


@functools.lru_cache(maxsize=4096)
def _native_verdict(vector, world_size, set_ranks, present):
    """(status, alpha, detail) of the native check of a reduced control vector (its float64 bytes)
    over the set's global ranks and, where ranks have joined, the set ranks ``present`` (tuples). A
    function of its arguments alone, so a tensor's vector, the same step after step, is checked once."""
    r = np.frombuffer(vector, dtype=np.float64)
    ranks = np.ascontiguousarray(set_ranks, dtype=np.int32)
    alpha, detail = ctypes.c_double(0.0), ctypes.c_int32(0)
    if present is None:
        st = _native.load().qsgd_check_control(_native.address(r), r.size, world_size, _native.address(ranks),
                                               ranks.size, ctypes.byref(alpha), ctypes.byref(detail))
    else:
        who = np.ascontiguousarray(present, dtype=np.int32)
        st = _native.load().qsgd_check_control_present(_native.address(r), r.size, world_size, _native.address(ranks),
                                                       ranks.size, _native.address(who), who.size, ctypes.byref(alpha),
                                                       ctypes.byref(detail))
    return st, alpha.value, detail.value


def _verdict(reduced, world_size, set_ranks, present=None):
    """(the reduced control vector as a flat float64 array, status, alpha, detail): the native check's."""
    r = np.ascontiguousarray(reduced, dtype=np.float64).reshape(-1)
    return (r, *_native_verdict(r.tobytes(), int(world_size), tuple(set_ranks),
                                None if present is None else tuple(present)))


def control_passes(reduced, world_size, set_ranks):
    """Whether the reduced control vector passes ``check_control`` as it is: every rank of the set
    took part (none has joined with ``hvd.join``) with the same settings, names and layout, and none
    failed; the same answer on every rank."""
    return _verdict(reduced, world_size, set_ranks)[1] == _native.OK


def check_control(reduced, world_size, set_ranks, where, fault_message=None, present=None):
    """Check the reduced control vector; return the gradient scale ``alpha`` or raise MismatchError.

    ``set_ranks``: the global ranks of the compressor's process set; ``fault_message``: this rank's
    own encoding error, if it had one; ``present``: the set ranks (ascending) that took part when the
    others have joined (``hvd.join``, see ``presence_vector``), None for all. Only the reduced vector
    (and the presence every rank reduced alike) decides, so the verdict is the same on every rank.
    """
    r, st, alpha, detail = _verdict(reduced, world_size, set_ranks, present)
    if st == _native.OK:
        return alpha
    if st == _native.E_CTRL_LENGTH:
        raise MismatchError(f"{where}: the control tensor came back with {r.size} entries instead of "
                            f"{control_length(world_size)}: QSGD compression works with allreduce (Sum or "
                            "Average), not with reducescatter or other collectives")
    if st == _native.E_CTRL_FAULT:
        raise MismatchError(fault_message or f"{where}: {detail} rank(s) could not encode this tensor "
                                             "(their error says why)")
    if st == _native.E_CTRL_OP:
        raise MismatchError(_op_message(where))
    if st == _native.E_CTRL_MEMBERS:
        raise MismatchError(_membership_message(r, world_size, set_ranks, where))
    if st == _native.E_CTRL_TAG:
        raise MismatchError(f"{where}: ranks disagree on the {tag_explanation(TAG_NAMES[detail])}")
    raise MismatchError(f"{where}: {_native.status_string(st)}")


def presence_vector(set_size, set_rank):
    """This rank's contribution to an exchange's presence allreduce (float64, one entry per rank of
    the set: 1 at its own). Summed by Horovod, entry j is 1 where set rank j took part and 0 where it
    has joined (``hvd.join``: Horovod adds zeros for joined ranks; allgather and alltoall it cannot
    carry through a join at all)."""
    v = np.zeros(int(set_size), dtype=np.float64)
    v[int(set_rank)] = 1.0
    return v


def present_ranks(reduced, where):
    """The set ranks that took part, from a reduced presence vector; MismatchError if it is not a
    0/1 vector (the presence allreduce is a plain sum, so anything else is a broken collective)."""
    v = np.asarray(reduced, dtype=np.float64).reshape(-1)
    if not np.all((v == 0.0) | (v == 1.0)) or not v.any():
        raise MismatchError(f"{where}: the presence vector came back as {v.tolist()[:16]}: expected 0 or 1 "
                            "per rank (a sum over the ranks still stepping)")
    return [int(j) for j in np.flatnonzero(v)]


JOIN_WAIT_S = 10.0  # how long a rank waits for a presence allreduce the control vector cannot vouch for


def _implied_participants(r, world_size):
    """The global ranks whose contributions a reduced control vector is the sum of (found from
    MEMBERS / ONE = mask / m for m participants; C ``qsgd_control_participants``), or None when no
    participant set fits."""
    r = np.ascontiguousarray(r, dtype=np.float64).reshape(-1)
    ranks, m = np.zeros(max(int(world_size), 1), dtype=np.int32), ctypes.c_int32(0)
    st = _native.load().qsgd_control_participants(_native.address(r), r.size, int(world_size), _native.address(ranks),
                                                 ctypes.byref(m))
    return [int(g) for g in ranks[:m.value]] if st == _native.OK else None


def joined_verdict(reduced, world_size, set_ranks, where, fault_message=None):
    """For a control vector that failed ``check_control``: whether it is that of the set's ranks
    still stepping while the others have joined (``hvd.join``: Horovod's allreduce adds zeros for
    them). None when it is not; else (present, alpha, certain): the set ranks that took part, the
    gradient scale (Average still divides by the set size n, as Horovod does), and whether the op
    proves a join. A reduction over a smaller process set looks the same except for Average, which
    then divides by the smaller set's size m: c m = 1 rules a join out and c n = 1 proves it; for
    Sum (c = 1) only the exchange's presence allreduce can tell, which completes after a join and
    never after a reduction over a smaller set, so the caller waits for it ``JOIN_WAIT_S`` at most.
    Raises MismatchError when the participants' own vector fails a check (a fault, a tag).
    (C ``qsgd_control_joined``, which the TensorFlow op uses too.)"""
    r = np.ascontiguousarray(reduced, dtype=np.float64).reshape(-1)
    ranks = np.ascontiguousarray(set_ranks, dtype=np.int32)
    present, m, certain = np.zeros(ranks.size, dtype=np.int32), ctypes.c_int32(0), ctypes.c_int32(0)
    st = _native.load().qsgd_control_joined(_native.address(r), r.size, int(world_size), _native.address(ranks),
                                           ranks.size, _native.address(present), ctypes.byref(m), ctypes.byref(certain))
    if st != _native.OK:
        return None
    present = [int(j) for j in present[:m.value]]
    alpha = check_control(r, world_size, set_ranks, where, fault_message, present=present)
    return present, alpha, bool(certain.value)


def _membership_message(r, world_size, set_ranks, where):
    """Explain a failed membership or op check: find the participants a sum would imply."""
    ranks = _implied_participants(r, world_size)  # mask(M) / |M| for a sum over ranks M
    if ranks is not None and ranks != list(set_ranks):
        return (f"{where}: the tensor was reduced over global ranks {ranks}, but the compressor's "
                f"process set is {list(set_ranks)}: pass the optimizer's (or allreduce's) process_set= "
                "to the compressor, and use the compressor on every rank of that set")
    return _op_message(where)


def _op_message(where):
    return (f"{where}: the reduction op is not a sum or an average; QSGD payloads are averaged "
            "(op=Average) or summed (op=Sum), other ops (Min, Max, Product, Adasum) are not supported")


def join_off_message(where, joined):
    """The error of an exchange that ``joined`` ranks of the set have gone to ``hvd.join()`` from,
    made by a compressor with ``join=False`` (QsgdCheckControl says the same)."""
    return (f"{where}: {joined} rank(s) of the set have joined (hvd.join), and the compressor was made with "
            "join=False, which gives hvd.join() up for a faster step: pass join=True (the default) to use "
            "hvd.join()")


def tag_explanation(name):
    """What a disagreement on the control vector's tag ``name`` means, and what to do: "<name>: <hint>"
    (the TensorFlow control op says it too)."""
    hint = {
        "process set size": "the compressor's process set differs between ranks",
        "compressor creation order": "ranks created their compressors in different orders or used "
                                     "different compressor objects for this tensor (compressors are "
                                     "numbered in the order each rank makes them: one for a process set is "
                                     "made on every rank, in the same order, members of the set or not, as "
                                     "Horovod's process sets are added)",
        "compressor settings": "ranks use different compressor settings (bits, bucket_size, norm, "
                               "coding, min_numel, reduction, fusion, fusion_mb, overlap, encoder or join), "
                               "or their environment resolves them differently (HVD_QSGD_RANKS_PER_NODE: the "
                               "node layout; HVD_QSGD_BANDWIDTH_GBITS, HVD_QSGD_INTRA_GBITS, "
                               "HVD_QSGD_LATENCY_US: the links reduction=\"auto\" weighs); with fusion_mb, a "
                               "tensor in a fusion buffer on some ranks and alone on others: a parameter of no "
                               "buffer plan (DynamicQSGD's) that gets a gradient on some ranks only at a step "
                               "(Horovod's synchronize() hands it over late on the others; train such a model "
                               "with fusion_mb=0)",
    }.get(name, "ranks handed tensors to the compressor in different orders (a dynamic graph, or "
                "parameters without gradients on some ranks); pass named_parameters= to the "
                "compressor so payloads are matched by name (with fusion=True, and fusion_mb for tensors of "
                "no buffer plan, the order places tensors in fused exchanges and fusion buffers, and must be "
                "the same on every rank, and every parameter must get a gradient on every rank or on none: "
                "train a model whose ranks use different parameters with fusion=False, or fusion_mb with "
                "Horovod's optimizer, which plans the buffers); with reduction=\"hierarchical\", whose node stage "
                "sums the tensors uncompressed, the key holds the tensor's shape and dtype too: the same tensor "
                "must have the same shape and dtype on every rank")
    return f"{name}: {hint}"


def exchange_seed(seed, set_rank, exchange):
    """The 64-bit base seed of this rank's payloads for one exchange name (not kept: a numbered
    exchange's name is new at every step, and a store of them would grow with the job)."""
    return _hash64(f"{int(seed)}|{int(set_rank)}|{exchange}")


def payload_seed(seed, set_rank, exchange, occurrence=0):
    """The seed of the payload this rank encodes for the ``occurrence``-th use of ``exchange``:
    ``qsgd_step_seed(exchange_seed(seed, rank, exchange), occurrence)`` (a SplitMix64 step, the same
    function the TensorFlow op applies in-graph), so ranks quantize independently and steps never
    reuse randomness."""
    return step_seed(exchange_seed(seed, set_rank, exchange), occurrence)


def step_seed(base, occurrence):
    """``qsgd_step_seed(base, occurrence)``: the payload seed of an exchange whose base seed
    (``exchange_seed``) a caller keeps."""
    return int(_native.load().qsgd_step_seed(base, int(occurrence)))


_GOLDEN = 0x9E3779B97F4A7C15   # the increment of qsgd_step_seed (kernels/qsgd_control.cc)


def occurrence_seeding(base):
    """The occurrence o with qsgd_step_seed(0, o) == qsgd_step_seed(base, 0), as an unsigned 64-bit
    number: the step seed mixes base + (o + 1) * GOLDEN, so o = base / GOLDEN (mod 2^64; GOLDEN is
    odd). A caller that cannot pass ``base`` as the seed passes 0 and this occurrence instead."""
    return base * pow(_GOLDEN, -1, 2 ** 64) % 2 ** 64


# what every rank's payload of an exchange must say as this rank expects
GATHERED_FIELDS = ("bits", "bucket_size", "norm", "coding", "numel", "dtype", "fingerprint")
_SETTINGS_HINT = "every rank must use the same compressor settings for the same tensor"
# a payload of another tensor: the same name on another shape or dtype, or, where payloads are
# placed by order, tensors handed over in different orders
_TENSOR_HINT = ("the ranks handed different tensors to this exchange: the same tensor must have the same shape and "
                "dtype on every rank, and with fusion=True (and fusion_mb for tensors of no buffer plan), where "
                "tensors take their places in the order they reach the compressor, every rank must hand them "
                "over in the same order and every parameter must get a gradient in the backward pass on every "
                "rank or on none (one used on some ranks only at a step is handed over by Horovod's "
                "synchronize() on the others, where it goes alone: train such a model with fusion=False, or "
                "fusion_mb with Horovod's optimizer, which plans the buffers)")
FUSED_HINT = _TENSOR_HINT.replace("this exchange", "this fused exchange")
# (checked after numel and dtype: those agree, and the tensors' shapes do not)
_SHAPE_HINT = ("the ranks' tensors have the same number of elements and dtype but not the same shape (the "
               "fingerprint hashes a tensor's name, shape and dtype; a fusion buffer's, its members' layout): "
               + _TENSOR_HINT)
_GATHERED_HINTS = {"numel": _TENSOR_HINT, "dtype": _TENSOR_HINT, "fingerprint": _SHAPE_HINT}
_gathered_fields = operator.attrgetter(*GATHERED_FIELDS)


def check_gathered(headers, expect, where):
    """Check the headers of every rank's payload (``codec.Header``, in rank order) against each other
    and against this rank's own (``expect``); raise MismatchError naming the field and the ranks."""
    want = _gathered_fields(expect)
    if all(_gathered_fields(h) == want for h in headers):
        return
    for field in GATHERED_FIELDS:
        values = [getattr(h, field) for h in headers]
        if any(v != getattr(expect, field) for v in values):
            by_rank = ", ".join(f"rank {i}: {v}" for i, v in enumerate(values))
            raise MismatchError(f"{where}: the ranks' payloads disagree on {field} ({by_rank}); "
                                + _GATHERED_HINTS.get(field, _SETTINGS_HINT))


def check_payloads(payloads, expect, where):
    """``check_gathered`` on the headers of every rank's payload (in rank order), read with
    ``codec.read_header`` (a malformed header is a ``PayloadError`` naming the rank)."""
    check_gathered([codec.read_header(p, f"{where} from rank {r}") for r, p in enumerate(payloads)], expect, where)


def ratio(elements, bytes_sent):
    """fp32 bytes over bytes sent (0.0 before anything was sent)."""
    return 4.0 * elements / bytes_sent if bytes_sent else 0.0

