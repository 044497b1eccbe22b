"""QSGD as a Horovod PyTorch ``Compressor``, reduced by an allgather of payloads or by
scatter_allgather (``hvd_qsgd.reduction``).

For a gradient g_r of d elements on each of the n ranks of the process set:

    compress(g_r):   p_r = encode(g_r [+ e_r])            (QSGD payload, own random stream)
                     start the presence allreduce under an exchange name every rank derives alike
                     (once it shows every rank took part: start allgather(p_r) under that name)
                     return the control vector (hvd_qsgd.protocol) for Horovod's allreduce
    decompress:      alpha = check(reduced control)        (1/n for Average, 1 for Sum)
                     [p_0, ..., p_{n-1}] = wait(allgather)
                     return alpha * (decode(p_0) + ... + decode(p_{n-1}))

Every rank decodes the same bytes in the same order with the same kernel, so every rank ends with a
bit-identical gradient. E[decode(p_r)] = g_r, so the result is an unbiased estimate of the average.
With error feedback, e_r <- (g_r + e_r) - decode(p_r) after each encoding (Karimireddy et al.,
2019): what quantization dropped is sent in later steps.

Exchange names, slots and residual keys: ``hvd_qsgd.state`` (``ExchangeNames``); a known
parameter's gradient travels as ``hvd_qsgd.<k>.p.<name>``, any other tensor as
``hvd_qsgd.<k>.n<slot>``.

Payload seeds: ``protocol.payload_seed(seed, set_rank, exchange_name, i)`` where i counts the
previous exchanges of that name on this rank (numbered exchanges: their ``s<seq>`` label, i = 0).

scatter_allgather (``reduction="scatter_allgather"``, or "auto" choosing it for a tensor):

    compress(g_r):   the n chunk payloads of g_r [+ e_r] (``reduction.encode_chunks``, step seed as
                     above); start alltoall(payloads, splits) under ``<exchange>.scatter``
    advance:         once the alltoall is done: check every rank's header of this rank's chunk,
                     q = ``reduction.reduce_chunk`` (decode-sum, re-quantize), start allgather of the
                     frame [8-byte little-endian length of q][q] under ``<exchange>.gather``
                     (length 0 and no payload when this rank could not reduce its chunk)
    decompress:      alpha = check(reduced control); wait for the allgather; split the frames;
                     return alpha * decode of the reduced chunks (``reduction.decode_chunks``)

The stages of many exchanges in flight are driven by ``hvd_qsgd.driver.StagedDriver``. Error
feedback keeps e_r <- (g_r + e_r) - decode(this rank's chunk payloads).

hvd.join(): every exchange's payload collectives wait for its presence allreduce
(``protocol.presence_vector``), which Horovod carries through a join (joined ranks add zeros).
When it shows that ranks have joined, no allgather or alltoall starts (Horovod cannot carry those
through a join): the stepping ranks allreduce decode(own payload(s)) instead, and decompress
returns alpha times that sum, alpha = 1/n for Average as Horovod's own joined allreduce gives
(``protocol.joined_verdict`` checks the control vector as the stepping ranks'). Counted in
``stats["joined_exchanges"]`` and logged once.

Time: encode, decode (with scatter_allgather's reduce step) and the waits for collectives are
timed into ``stats`` (``encode_s``, ``decode_s``, ``wait_s``; host time: a CUDA kernel's time is
counted where the host waits for it); ``hvd_qsgd.report`` turns them into ``summary()`` and the
slowdown warning.

Devices: ``hvd_qsgd.backends.choose`` picks each exchange's codec backend once, in ``compress``.
A CUDA tensor stays on the device (payloads handed to Horovod as CUDA tensors where Horovod was
built with NCCL) when every step has a CUDA kernel; otherwise it goes through the host, and that is
counted in ``stats["host_fallbacks"]`` and logged once per reason.
"""
import logging
import threading
import time
from types import SimpleNamespace
from typing import Optional, Tuple

import numpy as np
import torch
import horovod.torch as hvd
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from horovod.torch.compression import Compressor

from hvd_qsgd import backends, codec, cost_model, protocol, reduction, report
from hvd_qsgd.horovod_caller import exchange_process_set, horovod_caller
from hvd_qsgd.adapters.torch_params import group_learning_rate, named_parameter_list
from hvd_qsgd.driver import StagedDriver
from hvd_qsgd.policy import FixedBits
from hvd_qsgd.settings import Settings, Stats, next_creation_index, set_ranks as process_set_ranks
from hvd_qsgd.state import ExchangeNames, ResidualStore

SOURCE_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
log = logging.getLogger("hvd_qsgd")
_joined_logged = threading.Event()


def _note_joined(where, joined):
    """Log, once per process, that exchanges go uncompressed while ranks have joined."""
    if not _joined_logged.is_set():
        _joined_logged.set()
        log.warning("%s: %d rank(s) of the set have joined (hvd.join); until every rank has joined, compressed "
                    "exchanges go through Horovod's allreduce of each stepping rank's dequantized payload "
                    "(fp32 on the wire; counted in stats['joined_exchanges'])", where, joined)


class _Exchange:
    """The context of one compressed tensor between compress and decompress."""

    __slots__ = ("route", "where", "shape", "dtype", "device", "handle", "expect", "own_len", "fault",
                 "set_ranks", "world", "backend", "reduction", "set_rank", "step_seed", "splits",
                 "gather_handle", "reduce_error", "sent", "received", "started", "settings", "lr", "stage",
                 "payload", "present", "stage_error", "process_set")


def _as_torch(a):
    """A backend's result as a torch tensor (NumPy arrays are wrapped, CUDA tensors kept)."""
    return torch.from_numpy(a) if isinstance(a, np.ndarray) else a


class QSGD(Compressor):
    """QSGD compression for ``horovod.torch``: the parameters of ``hvd_qsgd.QSGD`` (the settings, as
    ``hvd_qsgd.settings.Settings.make``, then ``named_parameters`` and ``process_set`` by name), or
    ``settings=`` and a bits ``policy=`` (``hvd_qsgd.policy``; default: fixed bits)."""

    def __init__(self, *args, named_parameters=None, process_set=None, settings=None, policy=None,
                 creation_index=None, **kwargs):
        self.settings = settings = Settings.given("hvd_qsgd.torch.QSGD", settings, args, kwargs)
        self.policy = policy if policy is not None else FixedBits(settings)
        self._creation_index = next_creation_index() if creation_index is None else creation_index
        self._given_process_set = process_set   # None: Horovod's call says (hvd_qsgd.horovod_caller)
        self._lock = threading.Lock()
        self._stats = Stats()
        self.names = ExchangeNames(self._creation_index, ".")
        self.residuals = ResidualStore()
        self.driver = StagedDriver(hvd.poll, hvd.synchronize, self._next_stage)
        self._slowdown = report.SlowdownWatch(settings.link_bps())
        self._learning_rate = None   # residual key -> learning rate now, or None
        self._params = None
        self._grad_names = {}
        self._positional_residuals = False  # a checkpoint's residuals keyed by position (load_state_dict)
        if named_parameters is not None:
            self.bind(named_parameters)

    def __repr__(self):
        return f"hvd_qsgd.torch.QSGD({self.settings}, {self.policy!r})"

    def bind(self, named_parameters):
        """Match payloads by parameter name (the pairs given to Horovod's optimizer)."""
        params = named_parameter_list(named_parameters, "hvd_qsgd.torch.QSGD.bind", empty_ok=True)
        with self._lock:
            self._params = params
            self._grad_names = {}
        return self

    @property
    def bits_history(self):
        """(key, bits) of every exchange, with DQSGD's policy (``hvd_qsgd.policy.ScheduledBits``)."""
        return self.policy.bits_history

    def _param_name(self, tensor):
        """The name of the parameter whose .grad is ``tensor``, or None."""
        if self._params is None:
            return None
        hit = self._grad_names.get(id(tensor))
        if hit is not None and hit[1].grad is tensor:
            return hit[0]
        self._grad_names = {id(p.grad): (n, p) for n, p in self._params if p.grad is not None}
        hit = self._grad_names.get(id(tensor))
        return hit[0] if hit is not None and hit[1].grad is tensor else None

    # -- Compressor interface -----------------------------------------------------------------

    def compress(self, tensor: torch.Tensor) -> Tuple[torch.Tensor, Optional[_Exchange]]:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"hvd_qsgd.torch.QSGD.compress: expected a torch.Tensor, got {type(tensor)}")
        if (tensor.layout != torch.strided or tensor.dtype not in SOURCE_DTYPES
                or tensor.numel() < self.settings.min_numel):
            self._stats.add(raw_elements=tensor.numel(), raw_tensors=1)
            return tensor, None
        ctx = self._open(tensor)
        try:
            if ctx.fault is not None:  # the compressor's set or names disagree with Horovod's call
                raise ctx.fault
            if tensor.device.type not in ("cpu", "cuda"):
                raise ValueError(f"the tensor is on device {str(tensor.device)!r}: hvd_qsgd encodes tensors on "
                                 "the CPU or a CUDA device (move it there, or pass it uncompressed)")
            if ctx.set_rank is None:
                raise protocol.MismatchError(
                    f"{ctx.where}: this rank (global rank {hvd.rank()}) is not in the compressor's process set "
                    f"{ctx.set_ranks}; pass the optimizer's process_set= to the compressor")
            ctx.lr = self._current_lr(ctx.route.residual_key)
            ctx.step_seed = protocol.payload_seed(ctx.settings.seed, ctx.set_rank, ctx.route.seed_name,
                                                  ctx.route.occurrence)
            t0 = time.perf_counter()
            if ctx.reduction == "scatter_allgather":
                self._encode_scatter(tensor, ctx)
            else:
                self._encode_allgather(tensor, ctx)
            self._stats.add(encode_s=time.perf_counter() - t0)
        except Exception as e:  # reported through the control vector, raised on every rank
            ctx.fault = e
        # the driver is not advanced here: a payload collective started from compress on one rank,
        # while another rank's presence allreduce had not completed, stalled Horovod's grouped
        # allreduce of the control vectors (with its response cache on). From decompress and its
        # waits, every rank has submitted its control vectors first.
        self._start_presence(ctx)
        tags = protocol.exchange_tags(len(ctx.set_ranks), self._creation_index, ctx.settings.tag(ctx.reduction),
                                      ctx.route.key)
        control = protocol.control_vector(ctx.world, hvd.rank(), ctx.set_rank, tags, failed=ctx.fault is not None)
        return torch.from_numpy(control), ctx

    def _open(self, tensor):
        """The context of a new exchange of ``tensor``: its route, settings, checks and backend."""
        ctx = _Exchange()
        caller = horovod_caller()
        ctx.process_set, set_fault = self._exchange_process_set(caller)
        set_ranks = process_set_ranks(ctx.process_set, hvd.size())
        grank = hvd.rank()
        with self._lock:
            param = self._param_name(tensor)
        name_fault = None
        if caller.name is not None:
            if param is not None and param != caller.name:
                name_fault = protocol.MismatchError(
                    f"the compressor's named_parameters call this gradient {param!r}, Horovod's "
                    f"optimizer {caller.name!r}: give both the same names, or none to the compressor (it "
                    "takes the optimizer's)")
            param = caller.name
            if self._positional_residuals:
                self._positional_residuals = False
                log.warning("hvd_qsgd: the checkpoint loaded keys its error-feedback residuals by position (a "
                            "compressor that numbered the optimizer's gradients); gradients from Horovod's "
                            "optimizer are matched by its parameter names now, so their residuals start from zero")
        ctx.route = route = self.names.route(param)
        s = ctx.settings = self.policy.settings_for(route.residual_key)
        ctx.lr, ctx.shape, ctx.dtype, ctx.device = None, tensor.shape, tensor.dtype, tensor.device
        ctx.where = (f"hvd_qsgd: tensor {route.param!r}" if route.param is not None else
                     f"hvd_qsgd: compressed tensor {route.seed_name.rsplit('.', 1)[1]} (shape {tuple(tensor.shape)})")
        ctx.set_ranks, ctx.world, ctx.handle, ctx.fault = set_ranks, hvd.size(), None, None
        ctx.set_rank = set_ranks.index(grank) if grank in set_ranks else None
        dtype = SOURCE_DTYPES[tensor.dtype]
        ctx.expect = SimpleNamespace(bits=s.bits, bucket_size=s.bucket_size, norm=s.norm, coding=s.coding,
                                     numel=tensor.numel(), dtype=dtype,
                                     fingerprint=codec.tensor_fingerprint(route.param or "", tensor.shape, dtype))
        ctx.reduction = s.exchange_reduction(len(set_ranks), tensor.numel())
        ctx.backend, fallback = backends.choose(tensor.device.type, s, ctx.reduction)
        if fallback:
            backends.note_fallback(fallback, self._stats)
        ctx.gather_handle, ctx.reduce_error, ctx.sent, ctx.received = None, None, 0, 0
        ctx.stage, ctx.payload, ctx.present, ctx.stage_error = None, None, None, None
        ctx.fault = set_fault or name_fault
        return ctx

    def _exchange_process_set(self, caller):
        """(the process set of an exchange, a fault or None: ``horovod_caller.exchange_process_set``; a
        set given that is not Horovod's is raised on every rank through the control vector)."""
        ps, disagreement = exchange_process_set(caller, self._given_process_set, hvd.global_process_set, hvd.size())
        return ps, (None if disagreement is None else protocol.MismatchError(disagreement))

    def _flat32(self, tensor, ctx):
        """The tensor flattened, in float32, where its backend reads it (+ its residual)."""
        x = tensor.detach().reshape(-1)
        if ctx.backend is backends.CPU and x.device.type != "cpu":
            x = x.cpu()
        return self._with_residual(x.float().contiguous(), ctx)

    @staticmethod
    def _backend_view(t, ctx):
        """A host tensor as its backend reads it: a NumPy view for the CPU backend, or the tensor on
        the exchange's device for the CUDA backend (a no-op for what is there already)."""
        return t.numpy() if ctx.backend is backends.CPU else t.to(ctx.device, non_blocking=True)

    def _encode_allgather(self, tensor, ctx):
        """Encode the tensor (+ residual; update the residual); its allgather starts once the
        presence allreduce has shown that no rank has joined. On the device the tensor is read in its
        own dtype and error feedback is fused into the encoder (``_encode_on_device``)."""
        s, where, b = ctx.settings, ctx.where, ctx.backend
        payload = self._encode_on_device(tensor, ctx) if b is backends.CUDA else None
        if payload is None:
            x32 = self._flat32(tensor, ctx)
            payload = b.encode(self._backend_view(x32, ctx), s, ctx.step_seed, ctx.expect.fingerprint,
                               ctx.expect.dtype, where)
            if s.error_feedback:
                self._set_residual(ctx, x32 - _as_torch(b.decode(payload, where)))
        payload = _as_torch(payload)
        if payload.is_cuda and not hvd.nccl_built():
            payload = payload.cpu()
        ctx.payload, ctx.own_len = payload, payload.numel()

    def _encode_on_device(self, tensor, ctx):
        """The payload of a CUDA tensor in one pass (``CudaBackend.encode``): read in its dtype, with
        error feedback's residual read and rewritten in place. None where the residual must first be
        rescaled for a new learning rate (then the unfused steps run, also on the device)."""
        s, x = ctx.settings, tensor.detach().reshape(-1)
        if not s.error_feedback:
            return ctx.backend.encode(x, s, ctx.step_seed, ctx.expect.fingerprint, ctx.expect.dtype, ctx.where)
        key = ctx.route.residual_key
        old = self.residuals.get(key)
        if old is None:
            buf = torch.empty(x.numel(), dtype=torch.float32, device=x.device)
        else:
            self._check_residual(old, x, ctx)
            if self.residuals.factor(key, ctx.lr) != 1.0:
                return None
            buf = old.to(device=x.device, dtype=torch.float32).contiguous()  # a copy unless it is one already
        payload = ctx.backend.encode(x, s, ctx.step_seed, ctx.expect.fingerprint, ctx.expect.dtype, ctx.where,
                                     residual=buf, residual_valid=old is not None)
        self.residuals.keep(key, buf, ctx.lr)
        return payload

    def _encode_scatter(self, tensor, ctx):
        """Phase 1's payloads: the n chunks of the tensor (+ residual; update the residual)."""
        s, n, b = ctx.settings, len(ctx.set_ranks), ctx.backend
        x32 = self._flat32(tensor, ctx)
        buf, lens = b.encode_chunks(self._backend_view(x32, ctx), s, ctx.step_seed, n, ctx.expect.fingerprint,
                                    ctx.expect.dtype, ctx.where)
        if s.error_feedback:
            own = b.decode_chunks(b.split_by(buf, lens), 1.0, x32.numel(), s.bucket_size, ctx.where)
            self._set_residual(ctx, x32 - _as_torch(own))
        ctx.splits, ctx.own_len = lens, int(sum(lens))
        ctx.payload = buf

    # -- stages (hvd_qsgd.driver): presence, then the reduction's collectives -----------------

    def _start_presence(self, ctx):
        """Start the exchange's presence allreduce (``protocol.presence_vector``), also after an
        encoding fault (the other ranks count on it; the control vector reports the fault)."""
        ctx.stage = "presence"
        if ctx.set_rank is None:  # not in the set: the control check raises on every rank
            ctx.started = threading.Event()
            ctx.started.set()
            return
        vector = torch.from_numpy(protocol.presence_vector(len(ctx.set_ranks), ctx.set_rank))
        ctx.handle = hvd.allreduce_async(vector, op=hvd.Sum, name=f"{ctx.route.exchange}.present",
                                         process_set=ctx.process_set)
        self.driver.add(ctx)

    def _next_stage(self, ctx):
        """The driver's step once ctx's collective has completed: True when another collective was
        started that ctx now waits on. Never raises (other exchanges' calls run it): an error is kept
        in ``ctx.stage_error`` for its own decompress."""
        try:
            if ctx.stage == "presence":
                return self._after_presence(ctx)
            self._second_phase(ctx)
        except Exception as e:
            ctx.stage_error = e
        return False

    def _after_presence(self, ctx):
        """Every rank of the set took part: start the reduction's collective. Some have joined:
        start the allreduce of this rank's dequantized payload (the joined ranks add zeros)."""
        ctx.present = protocol.present_ranks(hvd.synchronize(ctx.handle).numpy(), ctx.where)
        ctx.handle = None
        if ctx.fault is not None:  # the control check raises on every rank; nothing more starts
            return False
        n, exchange = len(ctx.set_ranks), ctx.route.exchange
        if len(ctx.present) < n:
            ctx.stage = "joined"
            own = self._own_dequantized(ctx)
            if own.is_cuda and not hvd.nccl_built():
                own = own.cpu()
            ctx.handle = hvd.allreduce_async(own, op=hvd.Sum, name=f"{exchange}.joined", process_set=ctx.process_set)
            return False
        if ctx.reduction == "scatter_allgather":
            ctx.stage = "scatter"
            buf, ctx.payload = _as_torch(ctx.payload), None
            if buf.is_cuda and not hvd.nccl_built():  # Horovod's collectives then take host tensors
                buf = buf.cpu()
            ctx.sent = ctx.own_len - ctx.splits[ctx.set_rank]
            ctx.handle = hvd.alltoall_async(buf, splits=torch.tensor(ctx.splits, dtype=torch.int32),
                                            name=f"{exchange}.scatter", process_set=ctx.process_set)
            return True
        ctx.stage = "gather"
        payload, ctx.payload = ctx.payload, None
        ctx.handle = hvd.allgather_async(payload, name=exchange, process_set=ctx.process_set)
        return False

    def _own_dequantized(self, ctx):
        """decode(this rank's payload(s)) as a float32 torch tensor: what it contributes when ranks
        have joined, the same values error feedback took as sent."""
        b, where = ctx.backend, ctx.where
        if ctx.reduction == "scatter_allgather":
            own = b.decode_chunks(b.split_by(ctx.payload, ctx.splits), 1.0, ctx.expect.numel,
                                  ctx.settings.bucket_size, where)
        else:
            own = b.decode(self._backend_view(ctx.payload, ctx), where)
        ctx.payload = None
        return _as_torch(own)

    def _second_phase(self, ctx):
        """This rank's chunk: check every rank's payload of it, re-quantize their sum, start the
        allgather of the reduced chunks' frames (an empty frame after a failure: every rank raises)."""
        j = ctx.set_rank
        received, rsplits = hvd.synchronize(ctx.handle)
        rsplits = [int(v) for v in rsplits]
        ctx.received = int(sum(rsplits)) - rsplits[j]
        t0 = time.perf_counter()
        frame, ctx.reduce_error = ctx.backend.reduce_received(
            self._backend_view(received, ctx), rsplits, j, ctx.settings, ctx.step_seed, ctx.expect, ctx.where,
            server_residual=(lambda: self._server_residual(ctx)) if ctx.settings.server_error_feedback else None)
        self._stats.add(decode_s=time.perf_counter() - t0)
        frame = _as_torch(frame)
        ctx.sent += frame.numel()
        if frame.is_cuda and not hvd.nccl_built():
            frame = frame.cpu()
        ctx.gather_handle = hvd.allgather_async(frame, name=f"{ctx.route.exchange}.gather",
                                                process_set=ctx.process_set)

    def _finish_scatter(self, ctx, alpha):
        """Phase 2's result on this rank (its stages have run: ``decompress``)."""
        if ctx.gather_handle is None:
            raise protocol.MismatchError(f"{ctx.where}: the first phase of the exchange failed on this rank")
        n, j = len(ctx.set_ranks), ctx.set_rank
        gathered = self._wait(ctx.gather_handle)
        # the frames' lengths are read on the host (a copy of the frames where they are CUDA tensors)
        chunks = reduction.unframe((gathered.cpu() if gathered.is_cuda else gathered).numpy(), n, ctx.where)
        t0 = time.perf_counter()
        if ctx.reduce_error is not None:
            raise protocol.MismatchError(f"{ctx.where}: this rank could not reduce chunk {j}: "
                                         f"{ctx.reduce_error}") from ctx.reduce_error
        ctx.received += sum(8 + c.size for c in chunks) - (8 + chunks[j].size)
        chunks = [self._backend_view(torch.from_numpy(c), ctx) for c in chunks]
        out = ctx.backend.decode_chunks(chunks, alpha, ctx.expect.numel, ctx.settings.bucket_size,
                                        f"{ctx.where}: reduced chunks")
        self._stats.add(decode_s=time.perf_counter() - t0)
        return _as_torch(out)

    def _finish_allgather(self, ctx, alpha):
        """Wait for the payloads, check their headers, decode and sum them (on the exchange's backend)."""
        b, where, n = ctx.backend, ctx.where, len(ctx.set_ranks)
        gathered = self._backend_view(self._wait(ctx.handle), ctx)
        t0 = time.perf_counter()
        payloads = b.split(gathered, n, ctx.own_len, where)
        protocol.check_gathered(b.read_headers(payloads, where), ctx.expect, where)
        out = _as_torch(b.decode_sum(payloads, alpha, where))
        self._stats.add(elements=out.numel(), bytes_sent=ctx.own_len, tensors=1, decode_s=time.perf_counter() - t0,
                        bytes_received=len(gathered) - ctx.own_len)
        return out

    def _wait(self, handle):
        """The result of a collective, the time blocked on it counted in ``wait_s``."""
        t0 = time.perf_counter()
        try:
            return self.driver.wait(handle)
        finally:
            self._stats.add(wait_s=time.perf_counter() - t0)

    def decompress(self, tensor: torch.Tensor, ctx: Optional[_Exchange]) -> torch.Tensor:
        if ctx is None:
            return tensor
        try:
            alpha = self._check_control(tensor, ctx)
        except protocol.MismatchError as e:
            self.driver.forget(ctx)
            raise e from ctx.fault  # a numbered slot stays taken: its collectives may never complete
        finally:
            self.names.finish(ctx.route)
        try:
            t0 = time.perf_counter()
            self.driver.finish(ctx)  # every rank started its stages (the control check passed)
            self._stats.add(wait_s=time.perf_counter() - t0)
            if isinstance(ctx.stage_error, (HorovodInternalError, HostsUpdatedInterrupt)):
                # a collective failed or the hosts changed: Horovod's own error, unchanged, so that
                # elastic training (hvd.elastic.run) resets and restores instead of stopping
                raise ctx.stage_error
            if ctx.stage_error is not None:
                raise protocol.MismatchError(f"{ctx.where}: {ctx.stage_error}") from ctx.stage_error
            if ctx.stage == "joined":
                out = self._finish_joined(ctx, alpha)
            elif ctx.reduction == "scatter_allgather":
                out = self._finish_scatter(ctx, alpha)
                self._stats.add(elements=out.numel(), bytes_sent=ctx.sent, tensors=1, bytes_received=ctx.received)
            else:
                out = self._finish_allgather(ctx, alpha)
        finally:  # every rank waited for this exchange's collectives: its slot may be used again
            self.names.release_slot(ctx.route.slot)
        if ctx.stage != "joined":
            self._stats.add(allreduce_bytes=cost_model.received_bytes("allreduce", len(ctx.set_ranks),
                                                                      4 * ctx.expect.numel))
            self._slowdown.check(self._stats.as_dict(), repr(self))
        if self.policy.observes:
            self.policy.observe(ctx.route.residual_key, out.detach().reshape(-1).cpu().numpy())
        out = out.view(ctx.shape)
        if out.dtype != ctx.dtype or out.device != ctx.device:
            out = out.to(device=ctx.device, dtype=ctx.dtype)
        return out

    def _check_control(self, tensor, ctx):
        """The control vector's verdict (``protocol.check_control``), where ranks of the set may have
        joined (``hvd.join``): then the vector is that of the ranks still stepping, and the exchange's
        presence allreduce must say the same (``protocol.joined_verdict`` tells a join from a
        reduction over a smaller process set)."""
        reduced = tensor.detach().cpu().numpy()
        fault = None if ctx.fault is None else f"{ctx.where}: {ctx.fault}"
        try:
            return protocol.check_control(reduced, ctx.world, ctx.set_ranks, ctx.where, fault_message=fault)
        except protocol.MismatchError as e:
            verdict = protocol.joined_verdict(reduced, ctx.world, ctx.set_ranks, ctx.where)
            if verdict is None or ctx.set_rank is None:
                raise
            present, alpha, certain = verdict
            if not self._presence_known(ctx, None if certain else protocol.JOIN_WAIT_S):
                raise protocol.MismatchError(f"{e} (or ranks {sorted(set(range(len(ctx.set_ranks))) - set(present))} "
                                             "of the set joined (hvd.join) but never took part in this "
                                             "exchange's presence allreduce)") from None
            if ctx.present != present:
                raise protocol.MismatchError(
                    f"{ctx.where}: the control vector was reduced over set ranks {present}, but the ranks "
                    f"still stepping (not joined with hvd.join) are {ctx.present}") from None
            return alpha

    def _presence_known(self, ctx, timeout):
        """Wait until the exchange's presence allreduce has completed (``timeout`` seconds at most,
        None: no limit); whether it has."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while ctx.present is None and ctx.stage_error is None:
            if deadline is None:
                self.driver.finish(ctx)
                break
            if time.monotonic() > deadline:
                return False
            self.driver.advance()
            time.sleep(1e-3)
        return ctx.present is not None

    def _finish_joined(self, ctx, alpha):
        """With ranks joined: alpha * the sum Horovod's allreduce made of the stepping ranks'
        dequantized payloads (the joined ranks added zeros), counted as an uncompressed exchange."""
        out = self._wait(ctx.handle)
        if alpha != 1.0:
            out = out * alpha
        self._stats.add(raw_elements=ctx.expect.numel, raw_tensors=1, joined_exchanges=1)
        _note_joined(ctx.where, len(ctx.set_ranks) - len(ctx.present))
        return out

    # -- error feedback (hvd_qsgd.error_feedback; the store: hvd_qsgd.state.ResidualStore) ------

    def _set_residual(self, ctx, new):
        """Keep ``new`` as the residual, except where it is not finite (a bucket that held a NaN or an
        Inf decodes to NaN): there the previous residual stays (0 if none), so one overflowing step
        (skipped by loss scaling) does not make every later gradient non-finite. The learning rate
        it was made at is kept with it."""
        key = ctx.route.residual_key
        old = self.residuals.get(key)
        keep = torch.zeros((), dtype=new.dtype, device=new.device) if old is None else old.to(new.device)
        self.residuals.keep(key, torch.where(torch.isfinite(new), new, keep), ctx.lr)

    @staticmethod
    def _check_residual(residual, x, ctx):
        if residual.numel() != x.numel():
            raise protocol.MismatchError(
                f"{ctx.where}: its error-feedback residual (position {ctx.route.residual_key!r}) has "
                f"{residual.numel()} elements, the tensor {x.numel()}: the tensors handed to the "
                "compressor changed order between steps; pass named_parameters= to the compressor")

    def _with_residual(self, x32, ctx):
        """x32 + the tensor's residual, rescaled by lr_made / lr_now."""
        key = ctx.route.residual_key
        residual = self.residuals.get(key) if ctx.settings.error_feedback else None
        if residual is None:
            return x32
        self._check_residual(residual, x32, ctx)
        factor = self.residuals.factor(key, ctx.lr)
        residual = residual.to(x32.device)
        return x32 + (residual if factor == 1.0 else residual * factor)

    def _server_residual(self, ctx):
        """This rank's residual of the tensor's chunk, where its backend reduces the chunk: a float32
        NumPy array (CPU backend) or a float32 tensor on the exchange's CUDA device (CUDA backend).
        The reduce step updates it in place."""
        begin, end = reduction.chunk_ranges(ctx.expect.numel, ctx.settings.bucket_size,
                                            len(ctx.set_ranks))[ctx.set_rank]
        on_host = ctx.backend is backends.CPU

        def make(size):
            return (np.zeros(size, dtype=np.float32) if on_host
                    else torch.zeros(size, dtype=torch.float32, device=ctx.device))

        def place(r):  # a residual loaded from a checkpoint (a NumPy array) moves to the device once
            if on_host:
                return r if isinstance(r, np.ndarray) else r.detach().float().cpu().numpy()
            return torch.as_tensor(r).to(device=ctx.device, dtype=torch.float32).contiguous()

        with self._lock:
            return self.residuals.server_residual(ctx.route.residual_key, end - begin, make, ctx.where, place)

    def follow_learning_rate(self, optimizer):
        """See ``hvd_qsgd.QSGD.follow_learning_rate``."""
        if optimizer is None or callable(optimizer) and not hasattr(optimizer, "param_groups"):
            source = optimizer
        elif hasattr(optimizer, "param_groups"):
            source = group_learning_rate(optimizer, lambda: self._params)
        else:
            raise TypeError(f"follow_learning_rate: expected a torch.optim.Optimizer or a function of the "
                            f"residual key, got {type(optimizer).__name__}")
        with self._lock:
            self._learning_rate = source
        return self

    def _current_lr(self, residual_key):
        source = self._learning_rate
        return None if source is None else source(residual_key)

    def rescale_residuals(self, factor):
        """Multiply every error-feedback residual by ``factor``."""
        factor = float(factor)
        with self._lock:
            self.residuals.rescale(factor, lambda v, f: v * f)

    # -- state --------------------------------------------------------------------------------

    @property
    def stats(self):
        return self._stats.as_dict()

    def state_dict(self):
        """Error-feedback residuals (by parameter name or step position), statistics, settings, and
        the bits policy's state (DQSGD: ``schedules``)."""
        with self._lock:
            state = self.residuals.state_dict(residual=lambda v: v.clone(),
                                              server=lambda v: torch.from_numpy(v.copy()) if isinstance(v, np.ndarray)
                                              else v.detach().clone())
        state.update(stats=self._stats.as_dict(), settings=self.settings.as_dict(), **self.policy.state_dict())
        return state

    def load_state_dict(self, state):
        mine = self.settings.as_dict()
        theirs = state.get("settings", mine)
        changed = [k for k in ("bits", "bucket_size", "norm", "coding") if theirs.get(k) != mine[k]]
        if changed:
            raise ValueError(f"hvd_qsgd.torch.QSGD.load_state_dict: the checkpoint was made with different "
                             f"settings ({', '.join(f'{k}={theirs.get(k)!r}' for k in changed)})")
        with self._lock:
            r = self.residuals
            r.residuals = {k: v.detach().float().cpu().clone() for k, v in state.get("residuals", {}).items()}
            self._positional_residuals = any(isinstance(k, int) for k in r.residuals)
            r.rates = {k: float(v) for k, v in state.get("residual_lr", {}).items()}
            r.server = {k: np.array(torch.as_tensor(v).float().cpu().numpy(), dtype=np.float32)
                        for k, v in state.get("server_residuals", {}).items()}
        self._stats.load(state.get("stats", {}))
        self.policy.load_state_dict(state)

    # -- elastic training (hvd_qsgd.torch.elastic) --------------------------------------------

    def reset(self, residuals=True):
        """Forget every exchange in progress, and with ``residuals`` the error-feedback residuals
        (and the bits policy's state).

        For when no exchange this compressor started will be waited on: after Horovod was shut down
        and re-initialised (an elastic reset). A step interrupted by a failure leaves exchanges
        between compress and decompress, in different numbers on different ranks; left in place,
        they would route the next gradients of those parameters to numbered exchanges and shift the
        residual positions. The exchange counters (``exchange_counters``) are kept."""
        self.names.reset()
        self.driver.reset()
        with self._lock:
            self._grad_names = {}
            if residuals:
                self.residuals.clear()
        if residuals:
            self.policy.reset()

    def exchange_counters(self):
        """What names and seeds the next exchanges: the numbered exchanges started so far and the
        exchanges started per parameter name (the payload seeds' occurrence)."""
        return self.names.counters()

    def load_exchange_counters(self, counters):
        """Set the counters of ``exchange_counters()`` (e.g. those of another rank)."""
        self.names.load_counters(counters)


QSGD.__signature__ = Settings.signature(named_parameters=None, process_set=None, settings=None, policy=None,
                                        creation_index=None)
