"""The self-test of ``python -m hvd_qsgd --self-test``: one encode/decode round trip per codec backend
(``hvd_qsgd.backends``: ``CPU``, and ``CUDA`` where its kernels and a device are there), each checked
against a reference made by the CPU library with its baseline variant:

* the payload bytes are identical to the reference's (same input, settings and seed: the codec's
  promise across variants and devices);
* the decode equals the reference's decode, element for element;
* the decode is within QSGD's bound of the input (each element off by at most its bucket's scale
  over the levels), so a reference that is itself wrong does not pass unnoticed.

``run()`` returns one ``Result`` per backend; nothing here prints.
"""
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from hvd_qsgd import backends, codec
from hvd_qsgd.settings import Settings

NUMEL = 10_007          # not a multiple of the bucket size: the last bucket is partial
SEED = 20240611
WHERE = "hvd_qsgd self-test"


@dataclass
class Result:
    backend: str
    ok: Optional[bool]      # None: skipped
    detail: str
    fix: str = ""


def _input() -> np.ndarray:
    rng = np.random.default_rng(7)
    x = rng.standard_normal(NUMEL).astype(np.float32)
    x[::97] *= 40.0     # a few large values, so buckets' scales differ
    return x


def _reference(x, settings, fingerprint):
    """(payload, decode) by the CPU library's baseline variant (the widest on CPUs without it)."""
    before = codec.cpu_isa()
    variants = codec.cpu_isas()
    ref_variant = next(iter(variants)) if variants else before
    try:
        if ref_variant != before:
            codec.set_cpu_isa(ref_variant)
        payload = codec.encode(x, settings.bits, settings.bucket_size, settings.norm, SEED, settings.coding,
                               fingerprint, settings.checksum, name=WHERE, encoder=settings.encoder)
        return np.array(payload, dtype=np.uint8), codec.decode(payload, WHERE), ref_variant
    finally:
        if codec.cpu_isa() != before:
            codec.set_cpu_isa(before)


def _bound_error(x, decoded, settings) -> Optional[str]:
    """Why ``decoded`` is not a QSGD decode of ``x`` (max norm), or None."""
    if decoded.shape != x.shape or not np.all(np.isfinite(decoded)):
        return f"the decode has shape {decoded.shape} or non-finite values"
    b, s = settings.bucket_size, codec.levels(settings.bits)
    pad = (-x.size) % b
    scale = np.abs(np.pad(x, (0, pad))).reshape(-1, b).max(axis=1)
    limit = np.repeat(scale / s, b)[: x.size] * (1 + 1e-5) + 1e-30
    worst = np.abs(decoded - x) - limit
    if worst.max() > 0:
        i = int(worst.argmax())
        return f"element {i} decodes to {decoded[i]!r}, {x[i]!r} encoded: off by more than scale/levels"
    return None


def _compare(name, payload, decode, ref, x, settings) -> Result:
    """``payload`` (a host copy) against the reference's bytes first, then ``decode()`` (its decode, as
    a host array) against the reference's decode and QSGD's bound."""
    ref_payload, ref_decoded, ref_variant = ref
    payload = np.asarray(payload, dtype=np.uint8)
    if payload.size != ref_payload.size or not np.array_equal(payload, ref_payload):
        diff = np.flatnonzero(payload[: ref_payload.size] != ref_payload[: payload.size])
        where = f"first differing byte {int(diff[0])}" if diff.size else "lengths differ"
        return Result(name, False, f"payload differs from the CPU library's ({payload.size} vs {ref_payload.size} "
                                   f"bytes, {where})", _FIX_MISMATCH)
    decoded = np.asarray(decode())
    if not np.array_equal(decoded, ref_decoded):
        bad = int(np.flatnonzero(decoded != ref_decoded)[0]) if decoded.shape == ref_decoded.shape else -1
        return Result(name, False, f"decode differs from the CPU library's (element {bad})", _FIX_MISMATCH)
    why = _bound_error(x, decoded, settings)
    if why:
        return Result(name, False, why, _FIX_MISMATCH)
    return Result(name, True, f"{payload.size}-byte payload of {x.size} elements identical to the CPU "
                              f"library's ({ref_variant} variant), decode equal")


_FIX_MISMATCH = ("the native libraries disagree with each other: rebuild them together from one checkout "
                 "(`pip install --no-build-isolation --no-deps -e .` or `make setup`), then run "
                 "`python -m hvd_qsgd --self-test` again; if it still fails, report it with this output")


def _cpu(x, settings, fingerprint, ref) -> Result:
    backend = backends.CPU
    payload = backend.encode(x.copy(), settings, SEED, fingerprint, "float32", WHERE)
    return _compare(f"cpu ({codec.cpu_isa()} variant)", payload, lambda: backend.decode(payload, WHERE), ref, x,
                    settings)


def _cuda(x, settings, fingerprint, ref) -> Result:
    backend = backends.CUDA
    why = backends.CudaBackend.missing(settings, "allgather")
    if why:
        return Result("cuda", None, f"skipped: {why}")
    import torch
    device_x = torch.from_numpy(x.copy()).to("cuda")
    payload = backend.encode(device_x, settings, SEED, fingerprint, "float32", WHERE)
    name = f"cuda ({torch.cuda.get_device_name(device_x.device)})"
    return _compare(name, payload.cpu().numpy(), lambda: backend.decode(payload, WHERE).cpu().numpy(), ref, x,
                    settings)


def run() -> List[Result]:
    """One Result per backend: ok True, False (with what to do) or None (skipped, with why)."""
    settings = Settings.make(4)
    x = _input()
    fingerprint = codec.tensor_fingerprint("self-test", (NUMEL,), "float32")
    try:
        ref = _reference(x, settings, fingerprint)
    except Exception as e:  # noqa: BLE001 - reported, not raised: the report goes on
        return [Result("cpu", False, f"the CPU library's reference encode failed: {e}", _FIX_MISMATCH)]
    out = []
    for name, check in (("cpu", _cpu), ("cuda", _cuda)):
        try:
            out.append(check(x, settings, fingerprint, ref))
        except Exception as e:  # noqa: BLE001
            out.append(Result(name, False, f"{type(e).__name__}: {e}", _FIX_MISMATCH))
    return out
