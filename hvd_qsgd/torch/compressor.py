"""QSGD as a Horovod PyTorch ``Compressor``, reduced by an allgather of payloads or by
scatter_allgather (``hvd_qsgd.reduction``).

For a gradient g_r of d elements on each of the n ranks of the process set:

    compress(g_r):   p_r = encode(g_r [+ e_r])            (QSGD payload, own random stream)
                     start allgather(p_r) under an exchange name every rank derives alike
                     return the control vector (hvd_qsgd.protocol) for Horovod's allreduce
    decompress:      alpha = check(reduced control)        (1/n for Average, 1 for Sum)
                     [p_0, ..., p_{n-1}] = wait(allgather)
                     return alpha * (decode(p_0) + ... + decode(p_{n-1}))

Every rank decodes the same bytes in the same order with the same kernel, so every rank ends with a
bit-identical gradient. E[decode(p_r)] = g_r, so the result is an unbiased estimate of the average.
With error feedback, e_r <- (g_r + e_r) - decode(p_r) after each encoding (Karimireddy et al.,
2019): what quantization dropped is sent in later steps.

Exchange names: with ``named_parameters`` the gradient of parameter ``name`` travels as
``hvd_qsgd.<k>.p.<name>`` (k: the compressor's creation index), whatever order ranks hand gradients
over in. Tensors that are not a known parameter's gradient are numbered in the order they reach the
compressor: the seq-th is labelled ``hvd_qsgd.<k>.s<seq>`` (its payload seed, its messages) and
travels as ``hvd_qsgd.<k>.n<slot>``, where slot is the lowest number that no unfinished numbered
exchange of this compressor holds. A slot is free again once decompress has waited for the
exchange's collectives (after a failed control check it stays taken: they may never complete), so
a step's numbered exchanges reuse the same few collective names step after step, instead of a new
name each (which Horovod's response cache would never hit, evicting its entries instead). The
control vector proves that every rank gave the same tensor the same slot before anyone waits on
it. Error-feedback residuals are keyed by parameter name, or
without names by position within a step (the tensors compressed between two moments with no
exchange pending), which presumes a static order of gradients.

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

Every ``compress`` and ``decompress`` first advances every exchange whose alltoall has completed,
and waiting is a poll loop that keeps advancing the others, so second phases start as soon as their
first phases finish, in whatever order, and no rank waits on a phase another rank has not started.
Error feedback keeps e_r <- (g_r + e_r) - decode(this rank's chunk payloads). The chunk steps run on
the host (a CUDA tensor is copied there and back).
"""
import threading
import time
from types import SimpleNamespace

import torch
import horovod.torch as hvd
from horovod.torch.compression import Compressor

import numpy as np

from hvd_qsgd import codec, cuda, error_feedback, protocol, reduction
from hvd_qsgd.settings import Stats, init_adapter, set_ranks as process_set_ranks

_SOURCE_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class _Exchange:
    """The context of one compressed tensor between compress and decompress."""

    __slots__ = ("where", "name", "shape", "dtype", "device", "handle", "expect",
                 "own_len", "fault", "set_ranks", "world", "on_device", "reduction", "exchange",
                 "set_rank", "step_seed", "splits", "gather_handle", "reduce_error", "sent", "received",
                 "started", "settings", "residual_key", "lr")


def named_parameter_list(named_parameters, who, empty_ok=False):
    """``named_parameters`` as a list of (name, parameter) pairs with unique names (non-empty unless
    ``empty_ok``), or a ValueError naming ``who``."""
    named = list(named_parameters)
    if (not named and not empty_ok) or any(not (isinstance(t, tuple) and len(t) == 2 and isinstance(t[0], str)) for t in named):
        raise ValueError(f"{who}: named_parameters must be a {'' if empty_ok else 'non-empty '}list of (name, "
                         "parameter) pairs, as from model.named_parameters()")
    if len({n for n, _ in named}) != len(named):
        raise ValueError(f"{who}: parameter names must be unique")
    return named


def average_named(compression, named_tensors, prefix, process_set):
    """[(name, average over the process set of that tensor)] in the order given: each tensor goes
    through ``compression`` (compress, ``hvd.allreduce_async_`` with op Average as ``<prefix>.<name>``,
    decompress), all exchanges started before the first is waited on; each average has its tensor's
    shape and dtype. What the optimizers that average their own updates share (``EFSGDM``,
    ``PeriodicQuantizedAveraging``)."""
    pending = []
    for name, t in named_tensors:
        compressed, ctx = compression.compress(t)
        handle = hvd.allreduce_async_(compressed, op=hvd.Average, name=f"{prefix}.{name}", process_set=process_set)
        pending.append((name, t, handle, ctx))
    return [(name, compression.decompress(hvd.synchronize(handle), ctx).view_as(t).to(t.dtype))
            for name, t, handle, ctx in pending]


class QSGD(Compressor):
    """QSGD compression for ``horovod.torch`` (see ``hvd_qsgd.QSGD`` for the parameters)."""

    def __init__(self, bits=4, bucket_size=None, norm="max", coding="fixed", min_numel=10000, seed=0,
                 error_feedback=False, checksum=True, reduction="allgather", named_parameters=None,
                 process_set=None, server_error_feedback=False, *, settings=None, creation_index=None):
        init_adapter(self, settings, (bits, bucket_size, norm, coding, min_numel, seed, error_feedback, checksum,
                                      reduction, server_error_feedback), creation_index, process_set,
                     hvd.global_process_set)
        self._stats = Stats()
        self._seq = 0              # numbered exchanges started
        self._numbered = set()     # collective names of numbered exchanges not yet finished
        self._occurrences = {}     # exchanges started per parameter name
        self._in_flight = set()    # parameter names with an exchange pending
        self._pending = 0          # exchanges between compress and decompress
        self._position = 0         # position within the current step (residual key without names)
        self._residuals = {}
        self._residual_lr = {}     # the learning rate each residual was made at (follow_learning_rate)
        self._server_residuals = {}  # residual key -> this rank's chunk residual (server_error_feedback)
        self._learning_rate = None   # residual key -> learning rate now, or None
        self._scattering = []      # scatter_allgather exchanges whose alltoall is not yet handled
        self._params = None
        self._grad_names = {}
        if named_parameters is not None:
            self.bind(named_parameters)

    def __repr__(self):
        return f"hvd_qsgd.torch.QSGD({self.settings})"

    def bind(self, named_parameters):
        """Match payloads by parameter name (the pairs given to Horovod's optimizer)."""
        params = named_parameter_list(named_parameters, "hvd_qsgd.torch.QSGD.bind", empty_ok=True)
        with self._lock:
            self._params = params
            self._grad_names = {}
        return self

    # -- routing ----------------------------------------------------------------------------

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

    def _route(self, tensor):
        """(collective name, seed name, occurrence, protocol key, residual key, parameter name); under
        the lock."""
        prefix = f"hvd_qsgd.{self._creation_index}"
        name = self._param_name(tensor)
        if self._pending == 0:
            self._position = 0
        position = self._position
        self._position += 1
        self._pending += 1
        if name is not None and name not in self._in_flight:
            self._in_flight.add(name)
            occurrence = self._occurrences.get(name, 0)
            self._occurrences[name] = occurrence + 1
            exchange = f"{prefix}.p.{name}"
            key = 2 * protocol.small_hash(name, protocol.TAG_RANGE ** 2 // 2) + 1
            return exchange, exchange, occurrence, key, name, name
        seq, slot = self._seq, 0
        self._seq += 1
        while f"{prefix}.n{slot}" in self._numbered:  # the lowest slot no unfinished exchange holds
            slot += 1
        exchange = f"{prefix}.n{slot}"
        self._numbered.add(exchange)
        return exchange, f"{prefix}.s{seq}", 0, (2 * slot) % protocol.TAG_RANGE ** 2, position, None

    # -- Compressor interface -----------------------------------------------------------------

    def compress(self, tensor):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"hvd_qsgd.torch.QSGD.compress: expected a torch.Tensor, got {type(tensor)}")
        if (tensor.layout != torch.strided or tensor.dtype not in _SOURCE_DTYPES
                or tensor.numel() < self.settings.min_numel):
            self._stats.add(raw_elements=tensor.numel(), raw_tensors=1)
            return tensor, None
        ps = self._process_set
        set_ranks = process_set_ranks(ps, hvd.size())
        world, grank = hvd.size(), hvd.rank()
        set_rank = set_ranks.index(grank) if grank in set_ranks else None
        with self._lock:
            exchange, seed_name, occurrence, key, residual_key, param = self._route(tensor)
        ctx = _Exchange()
        s = ctx.settings = self._exchange_settings(residual_key, tensor)
        ctx.residual_key, ctx.lr = residual_key, None
        ctx.name, ctx.shape, ctx.dtype, ctx.device = param, tensor.shape, tensor.dtype, tensor.device
        ctx.where = (f"hvd_qsgd: tensor {param!r}" if param is not None else
                     f"hvd_qsgd: compressed tensor {seed_name.rsplit('.', 1)[1]} (shape {tuple(tensor.shape)})")
        ctx.set_ranks, ctx.world, ctx.handle, ctx.fault = set_ranks, world, None, None
        fingerprint = codec.tensor_fingerprint(param or "", tensor.shape, _SOURCE_DTYPES[tensor.dtype])
        ctx.expect = SimpleNamespace(bits=s.bits, bucket_size=s.bucket_size, norm=s.norm, coding=s.coding,
                                     numel=tensor.numel(), dtype=_SOURCE_DTYPES[tensor.dtype],
                                     fingerprint=fingerprint)
        ctx.reduction = s.exchange_reduction(len(set_ranks), tensor.numel())
        ctx.on_device = (tensor.is_cuda and s.coding == "fixed" and ctx.reduction == "allgather"
                         and cuda.available())
        ctx.exchange, ctx.set_rank, ctx.gather_handle, ctx.reduce_error = exchange, set_rank, None, None
        ctx.sent = ctx.received = 0
        ctx.started = threading.Event()   # set once the second phase of a scatter_allgather started
        try:
            if tensor.device.type not in ("cpu", "cuda"):
                raise ValueError(f"the tensor is on device {str(tensor.device)!r}: hvd_qsgd encodes tensors on "
                                 "the CPU or a CUDA device (move it there, or pass it uncompressed)")
            if set_rank is None:
                raise protocol.MismatchError(
                    f"{ctx.where}: this rank (global rank {grank}) is not in the compressor's process set "
                    f"{set_ranks}; pass the optimizer's process_set= to the compressor")
            ctx.lr = self._current_lr(residual_key)
            ctx.step_seed = protocol.payload_seed(s.seed, set_rank, seed_name, occurrence)
            if ctx.reduction == "scatter_allgather":
                self._start_scatter(tensor, ctx)
            else:
                if ctx.on_device:
                    payload = self._encode_cuda(tensor, ctx)
                    if not hvd.nccl_built():
                        payload = payload.cpu()
                else:
                    payload = torch.from_numpy(self._encode(tensor, ctx))
                ctx.own_len = payload.numel()
                ctx.handle = hvd.allgather_async(payload, name=exchange, process_set=ps)
        except Exception as e:  # reported through the control vector, raised on every rank
            ctx.fault = e
        self._advance()
        tags = protocol.exchange_tags(len(set_ranks), self._creation_index, s.tag(ctx.reduction), key)
        control = protocol.control_vector(world, grank, set_rank, tags, failed=ctx.fault is not None)
        return torch.from_numpy(control), ctx

    # -- scatter_allgather ----------------------------------------------------------------------

    def _start_scatter(self, tensor, ctx):
        """Phase 1: encode the n chunks of the tensor (+ residual) and start their alltoall."""
        s, n = ctx.settings, len(ctx.set_ranks)
        x = tensor.detach().reshape(-1)
        if x.device.type != "cpu":
            x = x.cpu()
        x32 = self._with_residual(x.float().contiguous(), ctx)
        buf, lens = reduction.encode_chunks(x32.numpy(), s, ctx.step_seed, n, ctx.expect.fingerprint,
                                            ctx.expect.dtype, where=ctx.where)
        if s.error_feedback:
            own = reduction.decode_chunks(reduction.split_by(buf, lens), 1.0, x32.numel(), s.bucket_size,
                                          where=ctx.where)
            self._set_residual(ctx, x32 - torch.from_numpy(own))
        ctx.splits, ctx.own_len = lens, int(sum(lens))
        ctx.sent = ctx.own_len - lens[ctx.set_rank]
        ctx.handle = hvd.alltoall_async(torch.from_numpy(buf), splits=torch.tensor(lens, dtype=torch.int32),
                                        name=f"{ctx.exchange}.scatter", process_set=self._process_set)
        with self._lock:
            self._scattering.append(ctx)

    def _advance(self, block_on=None):
        """Start the second phase of every exchange whose alltoall has completed (and of ``block_on``,
        waiting for it)."""
        with self._lock:
            ready = [c for c in self._scattering if c is block_on or hvd.poll(c.handle)]
            self._scattering = [c for c in self._scattering if c not in ready]
        for c in ready:
            self._reduce(c)

    def _reduce(self, ctx):
        """This rank's chunk: check every rank's payload of it, re-quantize their sum, start the
        allgather of the reduced chunks. A failure sends an empty frame (every rank then raises)."""
        try:
            self._reduce_and_gather(ctx)
        finally:
            ctx.started.set()

    def _reduce_and_gather(self, ctx):
        s, j = ctx.settings, ctx.set_rank
        received, rsplits = hvd.synchronize(ctx.handle)
        rsplits = [int(v) for v in rsplits]
        ctx.received = int(sum(rsplits)) - rsplits[j]
        try:
            payloads = reduction.split_by(received.numpy(), rsplits)
            reduction.check_chunk(payloads, j, ctx.expect, ctx.where)
            q = reduction.reduce_chunk(payloads, j, s, ctx.step_seed, ctx.expect.fingerprint, ctx.expect.dtype,
                                       where=f"{ctx.where}: chunk {j}", residual=self._server_residual(ctx))
        except Exception as e:  # raised on this rank in decompress; the others see the empty frame
            ctx.reduce_error, q = e, np.zeros(0, dtype=np.uint8)
        frame = np.empty(8 + q.size, dtype=np.uint8)
        frame[:8] = np.frombuffer(int(q.size).to_bytes(8, "little"), dtype=np.uint8)
        frame[8:] = q
        ctx.sent += frame.size
        ctx.gather_handle = hvd.allgather_async(torch.from_numpy(frame), name=f"{ctx.exchange}.gather",
                                                process_set=self._process_set)

    def _wait(self, handle):
        """Wait for ``handle``, advancing the other exchanges meanwhile (see the module docstring)."""
        delay = 2e-5
        while True:
            with self._lock:
                others = bool(self._scattering)
            if not others:
                return hvd.synchronize(handle)
            self._advance()
            if hvd.poll(handle):
                return hvd.synchronize(handle)
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)

    def _finish_scatter(self, ctx, alpha):
        """Phase 2's result on this rank."""
        self._advance(block_on=ctx)  # its alltoall: all ranks started it (the control check passed)
        ctx.started.wait()           # (another thread may be starting it)
        if ctx.gather_handle is None:
            raise protocol.MismatchError(f"{ctx.where}: the first phase of the exchange failed on this rank")
        gathered = self._wait(ctx.gather_handle).numpy()
        n, j = len(ctx.set_ranks), ctx.set_rank
        chunks, off = [], 0
        for r in range(n):
            if off + 8 > gathered.size:
                raise protocol.MismatchError(f"{ctx.where}: the reduced chunks' frames end after {r} of {n} ranks")
            size = int.from_bytes(gathered[off: off + 8].tobytes(), "little")
            chunks.append(gathered[off + 8: off + 8 + size])
            off += 8 + size
        if ctx.reduce_error is not None:
            raise protocol.MismatchError(f"{ctx.where}: this rank could not reduce chunk {j}: "
                                         f"{ctx.reduce_error}") from ctx.reduce_error
        ctx.received += off - (8 + chunks[j].size)
        out = reduction.decode_chunks(chunks, alpha, ctx.expect.numel, ctx.settings.bucket_size,
                                      where=f"{ctx.where}: reduced chunks")
        return torch.from_numpy(out)

    def _set_residual(self, ctx, new):
        """Keep ``new`` as the residual, except where it is not finite (a bucket that held a NaN or an
        Inf decodes to NaN): there the previous residual stays (0 if none), so one overflowing step
        (skipped by loss scaling) does not make every later gradient non-finite. The learning rate
        it was made at is kept with it (``hvd_qsgd.error_feedback``)."""
        key = ctx.residual_key
        old = self._residuals.get(key)
        keep = torch.zeros((), dtype=new.dtype, device=new.device) if old is None else old.to(new.device)
        self._residuals[key] = torch.where(torch.isfinite(new), new, keep)
        if error_feedback.usable_rate(ctx.lr):
            self._residual_lr[key] = float(ctx.lr)

    def _with_residual(self, x32, ctx):
        """x32 + the tensor's residual, rescaled by lr_made / lr_now (``hvd_qsgd.error_feedback``)."""
        residual = self._residuals.get(ctx.residual_key) if ctx.settings.error_feedback else None
        if residual is None:
            return x32
        if residual.shape != x32.shape:
            raise protocol.MismatchError(
                f"{ctx.where}: its error-feedback residual (position {ctx.residual_key!r}) has "
                f"{residual.numel()} elements, the tensor {x32.numel()}: the tensors handed to the "
                "compressor changed order between steps; pass named_parameters= to the compressor")
        factor = error_feedback.rescale_factor(self._residual_lr.get(ctx.residual_key), ctx.lr)
        residual = residual.to(x32.device)
        return x32 + (residual if factor == 1.0 else residual * factor)

    def _server_residual(self, ctx):
        """This rank's residual of the tensor's chunk (a float32 array the reduce step updates in
        place), or None without ``server_error_feedback``."""
        if not ctx.settings.server_error_feedback:
            return None
        begin, end = reduction.chunk_ranges(ctx.expect.numel, ctx.settings.bucket_size,
                                            len(ctx.set_ranks))[ctx.set_rank]
        with self._lock:
            residual = self._server_residuals.get(ctx.residual_key)
            if residual is None:
                residual = self._server_residuals[ctx.residual_key] = np.zeros(end - begin, dtype=np.float32)
        if residual.size != end - begin:
            raise protocol.MismatchError(
                f"{ctx.where}: its server error-feedback residual has {residual.size} elements, this "
                f"rank's chunk {end - begin}: the tensor or the number of ranks changed")
        return residual

    def _encode(self, tensor, ctx):
        """Encode ``tensor`` (+ its residual) on the host with the CPU kernels; update the residual."""
        s, where = ctx.settings, ctx.where
        x = tensor.detach().reshape(-1)
        if x.device.type != "cpu":
            x = x.cpu()
        x32 = self._with_residual(x.float().contiguous(), ctx)
        payload = codec.encode(x32.numpy(), s.bits, s.bucket_size, s.norm, ctx.step_seed, s.coding,
                               ctx.expect.fingerprint, s.checksum, name=where,
                               source_dtype=_SOURCE_DTYPES[tensor.dtype])
        if s.error_feedback:
            self._set_residual(ctx, x32 - torch.from_numpy(codec.decode(payload, where)))
        return payload

    def _encode_cuda(self, tensor, ctx):
        """Encode a CUDA tensor (+ its residual) with the CUDA kernels on the current stream."""
        s, where = ctx.settings, ctx.where
        x32 = self._with_residual(tensor.detach().reshape(-1).float().contiguous(), ctx)
        payload = cuda.encode(x32, s.bits, s.bucket_size, s.norm, ctx.step_seed, ctx.expect.fingerprint,
                              s.checksum, name=where, source_dtype=_SOURCE_DTYPES[tensor.dtype])
        if s.error_feedback:
            self._set_residual(ctx, x32 - cuda.decode_sum([payload], where=where))
        return payload

    # -- hooks of subclasses and learning-rate following ---------------------------------------

    def _exchange_settings(self, residual_key, tensor):
        """The settings of one exchange (``hvd_qsgd.torch.DynamicQSGD`` picks its bits here)."""
        return self.settings

    def _decoded(self, ctx, out):
        """Called with every exchange's result (the same on every rank)."""

    def follow_learning_rate(self, optimizer):
        """See ``hvd_qsgd.QSGD.follow_learning_rate``."""
        if optimizer is None or callable(optimizer) and not hasattr(optimizer, "param_groups"):
            source = optimizer
        elif hasattr(optimizer, "param_groups"):
            source = self._group_learning_rate(optimizer)
        else:
            raise TypeError(f"follow_learning_rate: expected a torch.optim.Optimizer or a function of the "
                            f"residual key, got {type(optimizer).__name__}")
        with self._lock:
            self._learning_rate = source
        return self

    def _group_learning_rate(self, optimizer):
        """key -> the lr of the parameter group holding that parameter (by name), or for position
        keys the lr every group shares. Which group holds which name is worked out once, again only
        when the groups or the bound parameters change."""
        cache = {"of": None, "by_name": {}}

        def lr(key):
            groups = optimizer.param_groups
            if isinstance(key, str) and self._params is not None:
                of = (id(groups), tuple(len(g["params"]) for g in groups), id(self._params))
                if cache["of"] != of:
                    holder = {id(p): g for g in groups for p in g["params"]}
                    cache["by_name"] = {n: holder.get(id(p)) for n, p in self._params}
                    cache["of"] = of
                group = cache["by_name"].get(key)
                if group is not None:
                    return float(group["lr"])
            rates = {float(g["lr"]) for g in groups}
            if len(rates) == 1:
                return rates.pop()
            raise ValueError(f"follow_learning_rate: the optimizer's parameter groups have learning rates "
                             f"{sorted(rates)}, and the tensor {key!r} is not a named parameter: pass "
                             "named_parameters= to the compressor")
        return lr

    def _current_lr(self, residual_key):
        source = self._learning_rate
        return None if source is None else source(residual_key)

    def rescale_residuals(self, factor):
        """Multiply every error-feedback residual by ``factor``."""
        factor = float(factor)
        with self._lock:
            self._residuals = {k: v * factor for k, v in self._residuals.items()}

    def decompress(self, tensor, ctx):
        if ctx is None:
            return tensor
        try:
            alpha = protocol.check_control(tensor.detach().cpu().numpy(), ctx.world, ctx.set_ranks, ctx.where,
                                           fault_message=None if ctx.fault is None else
                                           f"{ctx.where}: {ctx.fault}")
        except protocol.MismatchError as e:
            with self._lock:
                self._scattering = [c for c in self._scattering if c is not ctx]
            raise e from ctx.fault  # a numbered name stays taken: its collectives may never complete
        finally:
            self._finish(ctx)
        try:
            if ctx.reduction == "scatter_allgather":
                out = self._finish_scatter(ctx, alpha)
                self._stats.add(elements=out.numel(), bytes_sent=ctx.sent, tensors=1, bytes_received=ctx.received)
            else:
                gathered = self._wait(ctx.handle)
                out = (self._decode_cuda if ctx.on_device else self._decode)(gathered, alpha, ctx)
                self._stats.add(elements=out.numel(), bytes_sent=ctx.own_len, tensors=1,
                                bytes_received=gathered.numel() - ctx.own_len)
        finally:  # every rank waited for this exchange's collectives: its name may be used again
            with self._lock:
                self._numbered.discard(ctx.exchange)
        self._decoded(ctx, out)
        out = out.view(ctx.shape)
        if out.dtype != ctx.dtype or out.device != ctx.device:
            out = out.to(device=ctx.device, dtype=ctx.dtype)
        return out

    def _decode(self, gathered, alpha, ctx):
        """Split the gathered bytes by their headers, check them, decode and sum on the host."""
        payloads = codec.split_payloads(gathered.numpy(), count=len(ctx.set_ranks),
                                        where=f"{ctx.where}: gathered payloads")
        protocol.check_payloads(payloads, ctx.expect, ctx.where)
        out = torch.empty(ctx.expect.numel, dtype=torch.float32)
        codec.decode_sum(payloads, alpha, out=out.numpy(), where=ctx.where)
        return out

    def _decode_cuda(self, gathered, alpha, ctx):
        """The same on the device (fixed coding: every payload has the length of this rank's)."""
        gathered = gathered.to(ctx.device, non_blocking=True)
        n = len(ctx.set_ranks)
        if gathered.numel() != n * ctx.own_len:
            raise protocol.MismatchError(f"{ctx.where}: gathered {gathered.numel()} bytes from {n} ranks, "
                                         f"expected {n} payloads of {ctx.own_len} bytes")
        payloads = list(gathered.split(ctx.own_len))
        protocol.check_gathered(cuda.read_headers(payloads, ctx.where), ctx.expect, ctx.where)
        return cuda.decode_sum(payloads, alpha, where=ctx.where)

    def _finish(self, ctx):
        with self._lock:
            self._pending = max(0, self._pending - 1)
            if ctx.name is not None:
                self._in_flight.discard(ctx.name)

    # -- state --------------------------------------------------------------------------------

    @property
    def stats(self):
        return self._stats.as_dict()

    def state_dict(self):
        """Error-feedback residuals (by parameter name or step position) and statistics."""
        with self._lock:
            return {"residuals": {k: v.clone() for k, v in self._residuals.items()},
                    "residual_lr": dict(self._residual_lr),
                    "server_residuals": {k: torch.from_numpy(v.copy()) for k, v in self._server_residuals.items()},
                    "stats": self._stats.as_dict(), "settings": self.settings.as_dict()}

    def load_state_dict(self, state):
        mine = self.settings.as_dict()
        theirs = state.get("settings", mine)
        changed = [k for k in ("bits", "bucket_size", "norm", "coding") if theirs.get(k) != mine[k]]
        if changed:
            raise ValueError(f"hvd_qsgd.torch.QSGD.load_state_dict: the checkpoint was made with different "
                             f"settings ({', '.join(f'{k}={theirs.get(k)!r}' for k in changed)})")
        with self._lock:
            self._residuals = {k: v.detach().float().cpu().clone() for k, v in state.get("residuals", {}).items()}
            self._residual_lr = {k: float(v) for k, v in state.get("residual_lr", {}).items()}
            self._server_residuals = {k: np.array(torch.as_tensor(v).float().cpu().numpy(), dtype=np.float32)
                                      for k, v in state.get("server_residuals", {}).items()}
        self._stats.load(state.get("stats", {}))

    # -- elastic training (hvd_qsgd.torch.elastic) --------------------------------------------

    def reset(self, residuals=True):
        """Forget every exchange in progress, and with ``residuals`` the error-feedback residuals.

        For when no exchange this compressor started will be waited on: after Horovod was shut down
        and re-initialised (an elastic reset). A step interrupted by a failure leaves exchanges
        between compress and decompress, in different numbers on different ranks; left in place,
        they would route the next gradients of those parameters to numbered exchanges and shift the
        residual positions. The exchange counters (``exchange_counters``) are kept."""
        with self._lock:
            self._pending = 0
            self._position = 0
            self._in_flight = set()
            self._numbered = set()
            self._scattering = []
            self._grad_names = {}
            if residuals:
                self._residuals = {}
                self._residual_lr = {}
                self._server_residuals = {}

    def exchange_counters(self):
        """What names and seeds the next exchanges: the numbered exchanges started so far and the
        exchanges started per parameter name (the payload seeds' occurrence)."""
        with self._lock:
            return {"seq": self._seq, "occurrences": dict(self._occurrences)}

    def load_exchange_counters(self, counters):
        """Set the counters of ``exchange_counters()`` (e.g. those of another rank)."""
        seq, occurrences = int(counters["seq"]), {str(k): int(v) for k, v in counters["occurrences"].items()}
        with self._lock:
            self._seq, self._occurrences = seq, occurrences
