"""Each reduction as its chain of stages, on one compressed tensor (``Exchange``), written once for
every framework. A chain is four steps, run by ``hvd_qsgd.exchange.runner.ExchangeRunner``:

    encode(x)    in compress: this rank's payload(s) of x (+ its error-feedback residual)
    start        once the presence allreduce showed every rank of the set took part: the first
                 payload collective; True when another stage follows
    advance      once that collective completed (scatter_allgather: the reduce step and phase 2)
    finish       in decompress, once every rank's control vector checked: the result, alpha * sum

``CHAINS`` maps each reduction to its chain; a new reduction is a new chain and a row of the table.
Arrays are the exchange's backend's (``hvd_qsgd.backends``); collectives are the runner's
(``hvd_qsgd.exchange.collectives``). The algorithms: ``hvd_qsgd.reduction`` (scatter_allgather),
docs/architecture.md.
"""
from types import SimpleNamespace

from hvd_qsgd import protocol


class Exchange:
    """One compressed tensor between compress and decompress: where it goes, how it is encoded, and
    how far its stages have come. ``origin`` is the adapter's (the tensor's shape, dtype, device).
    A field not given is None (the byte counters 0) until set: the defaults are the class's, so that
    making one costs a dictionary update, not a call per field (one is made per compressed tensor)."""

    FIELDS = ("route", "where", "settings", "expect", "reduction", "chain", "backend", "group", "set_ranks",
              "set_rank", "world", "global_rank", "step_seed", "lr", "fault", "handle", "payload", "splits",
              "own_len", "stage", "present", "stage_error", "reduce_error", "gather_handle", "started", "origin",
              "layout", "nodes", "cross", "fused", "members", "lock", "pending", "gathered", "scale", "cut", "offsets",
              "offset", "source", "per_node", "device_type", "group_key", "direct", "defer", "control_base", "alone",
              "alpha", "order", "plan")
    COUNTERS = ("sent", "received", "cross_sent", "cross_received")

    def __init__(self, **fields):
        if not fields.keys() <= _EXCHANGE_FIELDS:
            raise TypeError(f"Exchange: unknown fields {sorted(fields.keys() - _EXCHANGE_FIELDS)}")
        self.__dict__.update(fields)

    @classmethod
    def of(cls, fields, **more):
        """An exchange of ``fields`` (another exchange's, as ``__dict__`` holds them) and ``more``,
        unchecked: for fields taken from an exchange made by ``__init__``."""
        ex = cls.__new__(cls)
        ex.__dict__.update(fields)
        ex.__dict__.update(more)
        return ex

    def remote(self, j):
        """Whether set rank j is on another node than this rank (False where the layout is unknown)."""
        return self.nodes is not None and self.nodes[j] != self.nodes[self.set_rank]

    def remote_ranks(self):
        """The set ranks on other nodes than this rank's."""
        nodes = self.nodes
        if nodes is None:
            return []
        mine = nodes[self.set_rank]
        return [j for j, node in enumerate(nodes) if node != mine]

    def control_fields(self):
        """What its control vector is made of besides the route and the outcome (``ExchangeRunner.control``;
        an opening keeps them as ``control_base``)."""
        return self.world, self.global_rank, self.set_rank, len(self.set_ranks), self.settings, self.tag_reduction()

    def tag_reduction(self):
        """The reduction as the settings tag names it: with its ranks per node where it has a layout,
        so that ranks that disagree on the layout fail the check."""
        return self.reduction if self.layout is None else f"{self.reduction}/{self.layout}"


for _name in Exchange.FIELDS:
    setattr(Exchange, _name, None)
for _name in Exchange.COUNTERS:
    setattr(Exchange, _name, 0)
_EXCHANGE_FIELDS = frozenset(Exchange.FIELDS + Exchange.COUNTERS)


def expectation(settings, numel, dtype, fingerprint):
    """What every rank's header must say for an exchange of a tensor of ``numel`` elements of
    ``dtype`` with ``settings`` (``protocol.check_gathered`` compares each field)."""
    s = settings
    return SimpleNamespace(bits=s.bits, bucket_size=s.bucket_size, norm=s.norm, coding=s.coding, numel=numel,
                           dtype=dtype, fingerprint=fingerprint)


def run_stages(run, ex, alpha):
    """The exchange's stages one after another (its chain's start, advance while another stage
    follows, finish): for collectives matched by call order or built into a graph in order."""
    again = ex.chain.start(run, ex)
    while again:
        again = ex.chain.advance(run, ex)
    return ex.chain.finish(run, ex, alpha)


class AllgatherChain:
    """Every rank receives every payload and decodes their sum: (n-1) P bytes received a rank."""

    name = "allgather"

    @staticmethod
    def encode(run, ex, x):
        residual, valid = run.worker_residual(ex, x)
        s = ex.settings
        ex.payload = ex.backend.encode(x, s, ex.step_seed, ex.expect.fingerprint, ex.expect.dtype, ex.where,
                                       residual=residual, residual_valid=valid)
        run.keep_residual(ex, residual)
        ex.own_len = ex.backend.length(ex.payload)

    @staticmethod
    def start(run, ex):
        ex.stage = "gather"
        payload, ex.payload = ex.payload, None
        ex.handle = run.collectives.allgather(payload, ex.route.exchange, ex.group)
        return False

    @staticmethod
    def advance(run, ex):
        raise AssertionError("the allgather chain has one collective")

    @staticmethod
    def own_dequantized(ex):
        return ex.backend.decode(ex.payload, ex.where)

    @staticmethod
    def finish(run, ex, alpha):
        """Check every rank's header, decode and sum the payloads."""
        b, n = ex.backend, len(ex.set_ranks)
        gathered = run.wait(ex.handle)
        out, lens = run.timed("decode_s", lambda: b.decode_gathered(gathered, n, ex.own_len, alpha, ex.expect,
                                                                     ex.where), gathered)
        remote = ex.remote_ranks()
        run.stats.exchanged(ex.expect.numel, ex.own_len, b.length(gathered) - ex.own_len, ex.own_len * len(remote),
                            sum(lens[j] for j in remote))
        return out


class ScatterAllgatherChain:
    """Rank j reduces chunk j: alltoall of chunk payloads, decode-sum and re-quantize the own chunk,
    allgather of the reduced chunks (``hvd_qsgd.reduction``): about 2 (n-1)/n P bytes a rank."""

    name = "scatter_allgather"

    @staticmethod
    def encode(run, ex, x):
        residual, valid = run.worker_residual(ex, x)
        s, n = ex.settings, len(ex.set_ranks)
        ex.payload, ex.splits = ex.backend.encode_chunks(x, s, ex.step_seed, n, ex.expect.fingerprint,
                                                         ex.expect.dtype, ex.where, residual=residual,
                                                         residual_valid=valid)
        run.keep_residual(ex, residual)
        ex.own_len = ex.backend.total(ex.splits)

    @staticmethod
    def start(run, ex):
        """Phase 1: each rank's payload of chunk j goes to rank j."""
        ex.stage = "scatter"
        buf, ex.payload = ex.payload, None
        ex.sent = ex.own_len - ex.splits[ex.set_rank]
        ex.cross_sent = sum(ex.splits[j] for j in ex.remote_ranks())
        ex.handle = run.collectives.alltoall(buf, ex.splits, f"{ex.route.exchange}.scatter", ex.group)
        return True

    @staticmethod
    def advance(run, ex):
        """This rank's chunk: check every rank's payload of it, re-quantize their sum, start the
        allgather of the reduced chunks' frames (an empty frame after a failure: every rank raises)."""
        j, b = ex.set_rank, ex.backend
        received, rsplits = run.collectives.wait(ex.handle)
        ex.handle = None
        ex.received = b.total(rsplits) - rsplits[j]
        ex.cross_received = sum(rsplits[k] for k in ex.remote_ranks())
        server = (lambda: run.server_residual(ex, received)) if ex.settings.server_error_feedback else None
        frame, ex.reduce_error = run.timed("decode_s", lambda: b.reduce_received(
            received, rsplits, j, ex.settings, ex.step_seed, ex.expect, ex.where, server_residual=server),
            received, rsplits)
        ex.sent += b.length(frame)
        ex.cross_sent += b.length(frame) * len(ex.remote_ranks())
        ex.gather_handle = run.collectives.allgather(frame, f"{ex.route.exchange}.gather", ex.group)
        return False

    @staticmethod
    def own_dequantized(ex):
        b = ex.backend
        return b.decode_chunks(b.split_by(ex.payload, ex.splits), 1.0, ex.expect.numel, ex.settings.bucket_size,
                               ex.where)

    @staticmethod
    def finish(run, ex, alpha):
        """Phase 2's result: alpha * the decoded reduced chunks."""
        if ex.gather_handle is None:
            raise protocol.MismatchError(f"{ex.where}: the first phase of the exchange failed on this rank")
        n, j, b = len(ex.set_ranks), ex.set_rank, ex.backend
        gathered = run.wait(ex.gather_handle)
        chunks = b.unframe(gathered, n, ex.where, ex.expect)
        b.raise_if_failed(ex.reduce_error, f"{ex.where}: this rank could not reduce chunk {j}")
        ex.received += b.part_bytes(chunks, [k for k in range(n) if k != j])
        ex.cross_received += b.part_bytes(chunks, ex.remote_ranks())
        out = run.timed("decode_s", lambda: b.decode_chunks(chunks, alpha, ex.expect.numel, ex.settings.bucket_size,
                                                            f"{ex.where}: reduced chunks", error=ex.reduce_error,
                                                            expect=ex.expect), gathered)
        run.stats.exchanged(ex.expect.numel, ex.sent, ex.received, ex.cross_sent, ex.cross_received)
        return out


from hvd_qsgd.exchange.hierarchical import HierarchicalChain  # noqa: E402  (a chain of its own module)

CHAINS = {chain.name: chain for chain in (AllgatherChain, ScatterAllgatherChain, HierarchicalChain)}
