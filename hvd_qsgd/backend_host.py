"""What the CPU and CUDA backends (``hvd_qsgd.backends``) share: sizes counted on the host, the
gathered payloads checked by their headers before they are decoded, the phase-2 frames cut on the
host. A backend supplies the array methods these are written with (``length``, ``split``,
``read_headers``, ``decode_sum``, ``split_by``, ``zeros``, ``host``, ``place_bytes``)."""
import contextlib
from typing import List

from hvd_qsgd import protocol, reduction
from hvd_qsgd.errors import MismatchError


class HostCountedBackend:
    """What the CPU and CUDA backends do alike: sizes counted on the host, in Python numbers; the
    gathered payloads checked by their headers before they are decoded; the phase-2 frames
    (``reduction.frame``, 8 bytes of length before each reduced chunk) cut on the host."""

    reduces_across_nodes = True   # the hierarchical cross stage may run scatter_allgather (frames)

    @staticmethod
    def encodes_members(settings) -> bool:
        """Whether ``encode`` takes a fusion buffer's members where they are (``codec_segments.Members``,
        without error feedback) instead of the buffer assembled in one array."""
        return False

    def total(self, lens) -> int:
        return int(sum(lens))

    @staticmethod
    def slice(x, begin: int, size: int):
        return x[begin:begin + size]

    @staticmethod
    def sizes(lens, n: int) -> List[int]:
        return [int(v) for v in lens]

    def check_size(self, x, expected: int, message) -> None:  # MismatchError(message(found)) if it differs
        if self.length(x) != expected:
            raise MismatchError(message(self.length(x)))

    def decode_report(self, buffer, lens, count: int, expect, where: str):
        """(the checked decode-sum of the ``count`` payloads in ``buffer``, None) or (nothing, why not)."""
        try:
            payloads = self.split_by(buffer, [v for v in lens if v])
            if len(payloads) != count:
                raise MismatchError(f"{where}: received {len(payloads)} payloads, expected {count}")
            return self._checked_sum(payloads, 1.0, expect, where), None
        except Exception as error:
            return self.zeros(0, buffer), error

    @staticmethod
    def checked_sizes(out, got, expected, message, error=None):
        """``out``, once the parts it is made of had the ``expected`` sizes (``got``); else
        ``MismatchError(message(the indices whose size differs))``."""
        empty = [j for j in range(len(expected)) if got[j] != expected[j]]
        if empty:
            raise MismatchError(message(empty))
        return out

    @staticmethod
    def deferred_verdicts(pending):
        """A scope whose decodes may leave their verdicts in ``pending`` for ``settle`` (a device's:
        the host's decodes check their payloads in the call, so nothing is left)."""
        return contextlib.nullcontext()

    @staticmethod
    def settle(pending) -> None:
        """Read the verdicts left in ``pending``; raise the first failure."""

    @staticmethod
    def scaled(out, alpha):
        return out if alpha == 1.0 else out * alpha

    def decode_gathered(self, gathered, count: int, own_len: int, alpha: float, expect, where: str):
        """(alpha * the decoded sum of the ``count`` payloads of an allgather's result, each checked
        against ``expect``; the payloads' lengths). The headers are read once: by the cut where it
        reads them, else for the checks, whose read the decode reuses."""
        payloads = self.split(gathered, count, own_len, where, headers := [], coding=expect.coding)
        return self._checked_sum(payloads, alpha, expect, where, headers), [self.length(p) for p in payloads]

    def _checked_sum(self, payloads, alpha, expect, where, headers=None):
        """alpha * the decoded sum of ``payloads``, their headers (given, or read) agreeing with ``expect``."""
        return self.decode_sum(payloads, alpha, where, headers or None, expect)

    def checked_headers(self, payloads, headers, expect, where):
        """``headers`` (read here where None and ``expect`` is given), checked against ``expect``
        (``protocol.check_gathered``: MismatchError naming the field and every rank's value)."""
        if expect is not None:
            headers = headers or self.read_headers(payloads, where)
            protocol.check_gathered(headers, expect, where)
        return headers

    def split_fused_by(self, gathered, count, lens, by_headers, size, walk):
        """A fused allgather's payloads cut at this rank's ``lens`` (every rank's, with the fixed coding),
        else (``by_headers``, or a ``size`` they do not add up to: the ranks' tensors differ) by ``walk()``."""
        if by_headers or size != count * int(sum(lens)):
            return walk()
        return self.split_by(gathered, [int(v) for v in lens] * count)

    def unframe(self, gathered, n: int, where: str, expect=None) -> list:
        """The n reduced chunks of an allgather of phase-2 frames, where ``gathered`` is (their
        lengths read on the host: a copy of the frames where they are on a device). ``expect``: the
        tensor's header fields (numel, bits, bucket_size, coding), which a device backend may cut by."""
        return [self.place_bytes(c, gathered) for c in reduction.unframe(self.host(gathered), n, where)]

    def part_bytes(self, parts, ranks) -> int:
        """The bytes the ``ranks``' phase-2 parts took on the wire, each in its frame."""
        return sum(8 + self.length(parts[k]) for k in ranks)

    @staticmethod
    def raise_if_failed(error, message: str) -> None:
        """Raise ``MismatchError(message: error)`` where a step of this rank failed (``error`` not None)."""
        if error is not None:
            raise MismatchError(f"{message}: {error}") from error
