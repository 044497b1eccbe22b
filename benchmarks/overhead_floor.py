"""The ``floor-buffered`` and ``floor-allgather`` modes of ``python -m benchmarks overhead``: the least
a step's fusion buffer, or a gradient's own allgather exchange, can cost with this codec and
Horovod's operations, to read the compressor's own cost against.

``FloorBuffered`` is a Horovod PyTorch compression that does a buffered QSGD(4) exchange with
nothing else: ``compress`` keeps the gradient (a NumPy view) and hands Horovod's optimizer a zero
vector of the control vector's length, so Horovod makes the same one allreduce a gradient as for
``hvd_qsgd.QSGD(4, fusion_mb=...)``; the step's first ``decompress`` encodes the members where they
are (``codec_segments``, at the same bucket-aligned offsets, the same kernel), allgathers the payload
and decodes the gathered payloads in one native call (``codec.decode_gathered``, scaled by 1/size:
Horovod's Average); each ``decompress`` returns its member's slice. No names, seeds from the
parameters, control checks, statistics, joins or error handling: what it does not pay is what the
compressor adds for those. For CPU float32 gradients only, and every rank must hand the same
gradients over in the same order (as fusion buffers ask too). Not a compressor for training.

``FloorAllgather`` is the same for QSGD(4) by allgather a gradient (what "auto" sends gradients of
this size by): ``compress`` encodes the gradient and hands over the zero vector; the step's first
``decompress`` starts every pending gradient's allgather, in the order compressed (as the
compressor starts its deferred exchanges there); each ``decompress`` waits for its own and decodes
the gathered payloads in one native call.
"""
import numpy as np

CONTROL_LENGTH = 8   # about the length of hvd_qsgd's control vector of one tensor (float64 entries)


class _Floor:
    """What both floors share: Horovod, the codec's settings, the zero vector handed over for each
    gradient, the kernels' threads as the compressor sets them, and ``codec.prepare`` once a size."""

    def __init__(self, hvd, bits=4, bucket_size=512):
        import torch
        from hvd_qsgd import threads
        self._hvd, self._torch, self.bits, self.bucket = hvd, torch, bits, bucket_size
        self._prepared = {}
        self._control = torch.zeros(CONTROL_LENGTH, dtype=torch.float64)
        threads.share_cores(hvd.local_size)   # the ranks on a node share its cores, as hvd_qsgd's do

    def _host(self, tensor):
        """The gradient as the flat float32 NumPy view the codec reads."""
        if tensor.device.type != "cpu" or tensor.dtype != self._torch.float32:
            raise ValueError("benchmarks.overhead_floor: CPU float32 gradients only")
        return tensor.detach().reshape(-1).numpy()

    def _prepare(self, numel):
        from hvd_qsgd import codec
        prepared = self._prepared.get(numel)
        if prepared is None:
            prepared = self._prepared[numel] = codec.prepare(numel, self.bits, self.bucket)
        return prepared


class FloorBuffered(_Floor):
    """A fusion buffer of QSGD(4) with buckets of ``bucket_size``, and nothing else (the module
    docstring). ``hvd``: ``horovod.torch``."""

    def __init__(self, hvd, bits=4, bucket_size=512):
        super().__init__(hvd, bits, bucket_size)
        self._members, self._result, self._left, self._step = [], None, 0, 0

    def compress(self, tensor):
        self._members.append(self._host(tensor))
        return self._control.clone(), len(self._members) - 1

    def decompress(self, tensor, index):
        if self._result is None:
            self._result = self._exchange()
        out, offsets = self._result
        member = self._members[index]
        result = self._torch.from_numpy(out[offsets[index]:offsets[index] + member.size])
        self._left -= 1
        if self._left == 0:   # the step's last member: the next compress opens the next buffer
            self._members, self._result = [], None
        return result

    def _exchange(self):
        """The buffer's members encoded where they are, one allgather, one decode of the gathered."""
        from hvd_qsgd import codec, codec_segments
        members = self._members
        offsets, numel = bucket_offsets([m.size for m in members], self.bucket)
        payload = codec_segments.encode(self._prepare(numel), codec_segments.Members(members, offsets, numel),
                                        self._step)
        gathered = self._hvd.allgather(self._torch.from_numpy(payload), name=f"floor_buffered.{self._step}")
        size = self._hvd.size()
        out, _ = codec.decode_gathered(gathered.numpy(), size, codec.read_header(payload), 1.0 / size)
        self._step += 1
        self._left = len(members)
        return out, offsets


class FloorAllgather(_Floor):
    """QSGD(4) by allgather a gradient, and nothing else (the module docstring)."""

    def __init__(self, hvd, bits=4, bucket_size=512):
        super().__init__(hvd, bits, bucket_size)
        self._pending, self._handles, self._count = [], {}, 0

    def compress(self, tensor):
        from hvd_qsgd import codec
        x = self._host(tensor)
        key, self._count = self._count, self._count + 1
        self._pending.append((key, codec.encode_prepared(self._prepare(x.size), x, key)))
        return self._control.clone(), key

    def decompress(self, tensor, key):
        from hvd_qsgd import codec
        for k, payload in self._pending:   # the step's first decompress: every pending allgather
            self._handles[k] = (self._hvd.allgather_async(self._torch.from_numpy(payload), name=f"floor_ag.{k}"),
                                codec.read_header(payload))
        self._pending = []
        handle, header = self._handles.pop(key)
        size = self._hvd.size()
        out, _ = codec.decode_gathered(self._hvd.synchronize(handle).numpy(), size, header, 1.0 / size)
        return self._torch.from_numpy(out)


def bucket_offsets(sizes, bucket_size):
    """(each tensor's offset in a buffer, at the next multiple of ``bucket_size`` after the one before
    it, as a fusion buffer places them; the buffer's numel)."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(-(-end // bucket_size) * bucket_size)
        end = offsets[-1] + n
    return offsets, end


def reference(bits, bucket_size, tensors, seed):
    """What ``FloorBuffered`` returns on one rank at step ``seed``: the assembled buffer (each tensor at
    its bucket-aligned offset, zeros between) encoded and decoded, cut at the offsets."""
    from hvd_qsgd import codec
    offsets, numel = bucket_offsets([t.size for t in tensors], bucket_size)
    assembled = np.zeros(numel, dtype=np.float32)
    for t, o in zip(tensors, offsets):
        assembled[o:o + t.size] = t
    out = codec.decode(codec.encode(assembled, bits, bucket_size, seed=seed))
    return [out[o:o + t.size] for t, o in zip(tensors, offsets)]
