"""The CPU codec's instruction-set variants (kernels/qsgd_cpu_isa.cc, chosen at run time).

Every variant this machine can run must produce the same payload bytes and the same decoded sums,
bit for bit, as the baseline variant: over every bit width, norm and coding, bucket sizes that do
and do not divide 8, 32 or the packing blocks, lengths with every kind of tail, the parallel
threshold, and special values (zeros of both signs, subnormals, values at the quantization levels,
infinities, NaN). The choice itself: the widest variant the CPU runs (checked against
/proc/cpuinfo, an independent reading of the CPU), HVD_QSGD_ISA forcing one in a fresh process, and
a clear error for a name the library does not have or a variant the CPU cannot run.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from hvd_qsgd import _native, codec, codec_segments, reduction
from hvd_qsgd.settings import Settings
from tests import references
from tests.helpers import ROOT

VARIANTS = codec.cpu_isas()
RUNNABLE = [name for name, runs in VARIANTS.items() if runs]
OTHERS = [name for name in RUNNABLE if name != RUNNABLE[0]]

# /proc/cpuinfo flags each x86-64 variant needs (its -march level's instructions, AVX-512 subsets)
NEEDS = {
    "baseline": (),
    "sse4": ("cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"),
    "avx2": ("avx", "avx2", "bmi1", "bmi2", "fma", "f16c", "movbe", "abm", "sse4_2", "popcnt"),
    "avx512": ("avx", "avx2", "bmi1", "bmi2", "fma", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
}


@pytest.fixture
def restore_isa():
    yield
    codec.set_cpu_isa("auto")


def _data(n, seed, kind):
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return rng.standard_normal(n).astype(np.float32)
    if kind == "wide":  # magnitudes over many binades, with subnormals and zeros of both signs
        x = (rng.standard_normal(n) * np.exp2(rng.integers(-140, 60, n))).astype(np.float32)
        x[rng.random(n) < 0.05] = 0.0
        x[rng.random(n) < 0.05] = -0.0
        return x
    if kind == "levels":  # values on and next to the quantization levels of a max-norm bucket
        x = rng.integers(-7, 8, n).astype(np.float32) / 7.0
        x = np.where(rng.random(n) < 0.5, x, np.nextafter(x, np.float32(2.0)))
        return x.astype(np.float32)
    if kind == "tiny":  # the smallest subnormals: the level spacing scale / s rounds to 0, so negative
        # codes decode to -0 and the order of decode's operations shows in the sign of zeros
        return (rng.integers(-3, 4, n) * np.float32(2.0 ** -149)).astype(np.float32)
    if kind == "special":  # non-finite values in some buckets
        x = rng.standard_normal(n).astype(np.float32)
        for v in (np.inf, -np.inf, np.nan):
            if n:
                x[rng.integers(0, n, max(1, n // 5000))] = v
        return x
    raise ValueError(kind)


def _encode_all(variants, x, **kw):
    out = {}
    for name in variants:
        codec.set_cpu_isa(name)
        out[name] = codec.encode(x, **kw)
    return out


def test_the_variants_and_the_one_in_use():
    assert RUNNABLE and RUNNABLE[0] in ("baseline", "generic"), VARIANTS
    # the widest runnable variant is in use (unless HVD_QSGD_ISA forces one)
    forced = os.environ.get("HVD_QSGD_ISA", "auto") or "auto"
    assert codec.cpu_isa() == (RUNNABLE[-1] if forced == "auto" else forced)


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo") or "baseline" not in VARIANTS,
                    reason="x86-64 with /proc/cpuinfo only")
def test_cpuid_agrees_with_proc_cpuinfo():
    flags = _native._cpu_flags()
    for name, runs in VARIANTS.items():
        expected = all(f in flags for f in NEEDS[name])
        assert runs == expected, (name, runs, [f for f in NEEDS[name] if f not in flags])


CASES = [
    # (bits, norm, coding, bucket_size)
    *[(b, "max", "fixed", 512) for b in range(1, 9)],
    *[(b, "l2", "fixed", 512) for b in (1, 2, 4, 8)],
    (1, "sign", "fixed", 512),
    *[(b, "max", "fixed", bucket) for b in (2, 3, 4, 7, 8) for bucket in (1, 3, 8, 100, 4072, 4096, 5000)],
    *[(b, "max", "elias", bucket) for b in (2, 4, 8) for bucket in (128, 512)],
    (3, "l2", "elias", 100),
]
SIZES = [0, 1, 7, 8, 31, 33, 1000, 4097, 70_001]


@pytest.mark.skipif(not OTHERS, reason="this CPU runs only the baseline variant")
@pytest.mark.parametrize("bits,norm,coding,bucket", CASES)
def test_every_variant_encodes_and_decodes_like_the_baseline(restore_isa, bits, norm, coding, bucket):
    for n in SIZES:
        for kind in ("normal", "wide", "levels", "tiny", "special"):
            if kind == "special" and coding == "elias" and n > 1000:
                continue  # covered at the smaller sizes; Elias of NaN buckets is slow to build
            x = _data(n, seed=n * 7 + bits, kind=kind)
            kw = dict(bits=bits, bucket_size=bucket, norm=norm, coding=coding, seed=n + 1, fingerprint=5)
            enc = _encode_all(RUNNABLE, x, **kw)
            base = enc[RUNNABLE[0]]
            for name in OTHERS:
                assert np.array_equal(enc[name], base), (name, n, kind, kw)
            # one payload (decoded straight into out) and two (summed first), scaled, into zeros and
            # accumulated onto data
            other = codec.encode(_data(n, seed=n + 99, kind="normal"), **dict(kw, seed=n + 2))
            start = _data(n, seed=3, kind="normal")
            for payloads, alpha, accumulate in (([base], 1.0, False), ([base], -0.25, True),
                                                ([base, other], 1.0, False), ([base, other], 0.5, True)):
                dec = {}
                for name in RUNNABLE:
                    codec.set_cpu_isa(name)
                    out = start.copy()
                    codec.decode_sum(payloads, alpha, out=out, accumulate=accumulate)
                    dec[name] = out
                for name in OTHERS:
                    assert np.array_equal(dec[name].view(np.uint32), dec[RUNNABLE[0]].view(np.uint32)), (
                        name, n, kind, kw, alpha)


@pytest.mark.skipif(not OTHERS, reason="this CPU runs only the baseline variant")
@pytest.mark.parametrize("checksum", [True, False])
def test_checksum_and_validation_agree_across_variants(restore_isa, checksum):
    """The encoder adds up the checksum chunk by chunk while packing; the value must be the one the
    whole-payload checksum gives (every variant), and a flipped bit must be caught by each."""
    x = _data(300_000, seed=1, kind="normal")
    for bits in (1, 3, 4, 8):
        for bucket in (7, 512):
            enc = _encode_all(RUNNABLE, x, bits=bits, bucket_size=bucket, seed=9, checksum=checksum)
            for name in RUNNABLE:
                assert np.array_equal(enc[name], enc[RUNNABLE[0]])
                codec.set_cpu_isa(name)
                codec.validate(enc[name])
                if checksum:
                    lib = _native.load()
                    p = enc[name].copy()
                    stored = int.from_bytes(p[48:56].tobytes(), "little")
                    assert lib.qsgd_checksum_cpu(p.ctypes.data, p.size) == stored
                    p[p.size // 2] ^= 0x10
                    with pytest.raises(codec.PayloadError, match="checksum"):
                        codec.validate(p)


def test_checksum_is_the_wire_formats_on_every_variant(restore_isa):
    """qsgd_checksum_cpu over byte strings from a header's length (56 bytes: the field's word is the
    last one the header loop takes) up, odd lengths, and strings long enough for several parallel
    ranges (2^14 words each), in every variant, against the format's definition."""
    rng = np.random.default_rng(11)
    lengths = list(range(56, 100)) + [127, 1000, 4099, 8 * (1 << 14) + 13, 3 * 8 * (1 << 14) + 5]
    strings = [rng.integers(0, 256, n, dtype=np.uint8) for n in lengths]
    expected = [references.checksum(s.tobytes()) for s in strings]
    lib = _native.load()
    for name in RUNNABLE:
        codec.set_cpu_isa(name)
        for s, want in zip(strings, expected):
            assert lib.qsgd_checksum_cpu(s.ctypes.data, s.size) == want, (name, s.size)


@pytest.mark.skipif(not OTHERS, reason="this CPU runs only the baseline variant")
def test_scatter_allgather_chunk_steps_agree_across_variants(restore_isa):
    from hvd_qsgd.settings import Settings
    settings = Settings.make(bits=4, bucket_size=128)
    x = _data(100_003, seed=4, kind="normal")
    results = {}
    for name in RUNNABLE:
        codec.set_cpu_isa(name)
        buf, lens = reduction.encode_chunks(x, settings, step_seed=11, n=3)
        results[name] = np.asarray(buf).tobytes(), list(lens)
    for name in OTHERS:
        assert results[name] == results[RUNNABLE[0]], name


def test_set_cpu_isa_refuses_unknown_and_unrunnable_variants(restore_isa):
    with pytest.raises(ValueError, match="not-a-variant"):
        codec.set_cpu_isa("not-a-variant")
    for name, runs in VARIANTS.items():
        if not runs:
            with pytest.raises(ValueError, match="cannot run"):
                codec.set_cpu_isa(name)
    codec.set_cpu_isa(RUNNABLE[0])
    assert codec.cpu_isa() == RUNNABLE[0]
    codec.set_cpu_isa("auto")
    assert codec.cpu_isa() == RUNNABLE[-1]


def _in_fresh_process(env_value, code="from hvd_qsgd import codec; print(codec.cpu_isa())"):
    env = dict(os.environ, HVD_QSGD_ISA=env_value)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=120)


def test_hvd_qsgd_isa_forces_a_variant_at_load():
    for name in RUNNABLE:
        proc = _in_fresh_process(name)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split()[-1] == name


def test_hvd_qsgd_isa_with_a_bad_value_is_an_import_error_not_a_silent_fallback():
    proc = _in_fresh_process("avx9000")
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr and "HVD_QSGD_ISA='avx9000'" in proc.stderr
    assert "is not one of its variants" in proc.stderr
    unrunnable = [name for name, runs in VARIANTS.items() if not runs]
    if unrunnable:
        proc = _in_fresh_process(unrunnable[0])
        assert proc.returncode != 0
        assert "cannot run on this CPU" in proc.stderr and unrunnable[0] in proc.stderr


@pytest.fixture
def restore_stream_bytes():
    yield
    codec.set_stream_bytes(None)


@pytest.mark.parametrize("bits,bucket", [(b, 512) for b in range(1, 9)] + [(4, 8), (3, 100), (8, 3), (2, 4072)])
def test_streamed_decodes_write_the_same_bits_as_cached_ones(restore_isa, restore_stream_bytes, bits, bucket):
    """A decoded result at least ``stream_bytes`` large is written with streaming stores (past the
    caches); every variant must write the same bits as with cached stores: one and two payloads, an
    output that is 16-byte aligned (streamed) and one that is not (written through the cache), sizes
    with every kind of tail and above the parallel threshold, and the chunk steps' decodes."""
    for n in (1, 7, 8, 4097, 70_001, 200_003):
        x, y = _data(n, seed=n + bits, kind="wide"), _data(n, seed=n + 5, kind="normal")
        kw = dict(bits=bits, bucket_size=bucket, seed=n, fingerprint=3)
        payloads = [codec.encode(x, **kw), codec.encode(y, **dict(kw, seed=n + 1))]
        for name in RUNNABLE:
            codec.set_cpu_isa(name)
            results = {}
            for label, nbytes in (("cached", 2**64 - 1), ("streamed", 1)):
                codec.set_stream_bytes(nbytes)
                backing = np.full(n + 5, np.float32(7.0))
                start = (-backing.ctypes.data // 4) % 4   # out 16-byte aligned, and 4 bytes past it
                for offset in (start, start + 1):
                    for count, alpha in ((1, 1.0), (2, 0.5)):
                        out = backing[offset:offset + n]
                        codec.decode_sum(payloads[:count], alpha, out=out)
                        results[label, offset - start, count] = out.view(np.uint32).copy()
                buf, lens = reduction.encode_chunks(x, Settings.make(bits=bits, bucket_size=bucket), step_seed=2, n=3)
                chunks = np.split(np.asarray(buf), np.cumsum(lens)[:-1])
                results[label, "chunks"] = reduction.decode_chunks(chunks, 0.25, n, bucket).view(np.uint32).copy()
            for key in [k for k in results if k[0] == "cached"]:
                assert np.array_equal(results[("streamed",) + key[1:]], results[key]), (name, n, key)


def test_stream_bytes_defaults_to_three_eighths_of_the_last_level_cache(restore_stream_bytes):
    codec.set_stream_bytes(12345)
    assert codec.stream_bytes() == 12345
    codec.set_stream_bytes(None)
    def getconf(name):  # the C library's sysconf, as the kernels read it (Python's os.sysconf lacks these)
        out = subprocess.run(["getconf", name], capture_output=True, text=True).stdout.strip()
        return int(out) if out.isdigit() else -1
    llc = getconf("LEVEL3_CACHE_SIZE")
    if llc <= 0:
        llc = getconf("LEVEL2_CACHE_SIZE")
    assert codec.stream_bytes() == (llc // 8 * 3 if llc > 0 else 32 << 20)
    for bad in (-1, 2**64, 1.5, "1"):
        with pytest.raises(ValueError, match="nbytes"):
            codec.set_stream_bytes(bad)
    assert codec.stream_bytes() == (llc // 8 * 3 if llc > 0 else 32 << 20)


SEGMENT_CASES = [(b, "max", 512, 2) for b in range(1, 9)] + [
    (4, "l2", 512, 2), (1, "sign", 512, 2), (4, "max", 8, 1), (3, "max", 100, 2), (8, "max", 3, 2),
    (2, "max", 4072, 2), (4, "max", 128, 1), (3, "max", 5000, 1), (4, "max", 5000, 2)]


@pytest.mark.parametrize("bits,norm,bucket,encoder", SEGMENT_CASES)
def test_a_segmented_encode_writes_the_bytes_of_the_assembled_tensor(restore_isa, bits, norm, bucket, encoder):
    """``codec_segments.encode`` (a fusion buffer's members encoded where they are) gives the bytes of
    ``codec.encode`` of the tensor they make with zeros between: every variant, members at bucket
    boundaries and not, with tails, empty ones, long gaps and a tensor beyond the last member."""
    rng = np.random.default_rng(bits * 31 + bucket)
    sizes = [20_000, 1, 777, 0, 4096, 70_001, 9]
    layouts = {"aligned": [], "anywhere": []}
    end = 0
    for n in sizes:   # each member at the next bucket boundary, as a fusion buffer places them
        layouts["aligned"].append((-(-end // bucket) * bucket, n))
        end = layouts["aligned"][-1][0] + n
    end = 0
    for n in sizes:   # and at any offset after a gap of 0-2 buckets
        layouts["anywhere"].append((end + int(rng.integers(0, 2 * bucket + 1)), n))
        end = layouts["anywhere"][-1][0] + n
    for label, layout in layouts.items():
        numel = layout[-1][0] + layout[-1][1] + int(rng.integers(0, bucket + 1))
        parts = [_data(n, seed=i + bits, kind="wide" if i % 2 else "normal") for i, (_, n) in enumerate(layout)]
        dense = np.zeros(numel, np.float32)
        for (o, n), p in zip(layout, parts):
            dense[o:o + n] = p
        for checksum in (True, False):
            prepared = codec.prepare(numel, bits, bucket, norm, fingerprint=5, checksum=checksum, encoder=encoder)
            for name in RUNNABLE:
                codec.set_cpu_isa(name)
                want = codec.encode_prepared(prepared, dense, seed=77)
                got = codec_segments.encode(prepared, codec_segments.Members(parts, [o for o, _ in layout], numel), 77)
                assert np.array_equal(got, want), (name, label, checksum)
                assert np.array_equal(codec_segments.encode(prepared, codec_segments.Members([], [], numel), 77),
                                      codec.encode_prepared(prepared, np.zeros(numel, np.float32), seed=77))


@pytest.mark.parametrize("bits,bucket,n", [(4, 512, 2), (4, 512, 3), (2, 128, 5), (8, 100, 16), (3, 8, 7), (1, 512, 4)])
def test_members_encode_to_the_chunk_payloads_of_the_assembled_tensor(restore_isa, bits, bucket, n):
    """scatter_allgather's phase 1 of a fusion buffer from its members where they are
    (``reduction.encode_chunks`` of ``codec_segments.Members``): the bytes and lengths of the
    chunks of the assembled buffer, members inside a chunk and across chunk boundaries, empty chunks
    (more ranks than buckets), empty members, the avx512 variant and the baseline."""
    rng = np.random.default_rng(bits * 7 + n)
    for sizes in ([20_000, 700, 5_000, 1, 0, 12_345], [3], []):
        offsets, end = [], 0
        for k in sizes:
            offsets.append(-(-end // bucket) * bucket + int(rng.integers(0, 2)) * bucket)
            end = offsets[-1] + k
        numel = end + int(rng.integers(0, bucket))
        parts = [_data(k, seed=i + bits, kind="wide" if i % 2 else "normal") for i, k in enumerate(sizes)]
        dense = np.zeros(numel, np.float32)
        for o, p in zip(offsets, parts):
            dense[o:o + p.size] = p
        s = Settings.make(bits=bits, bucket_size=bucket, norm="sign" if bits == 1 else "max")
        for name in {"baseline", RUNNABLE[-1]}:
            codec.set_cpu_isa(name)
            want = reduction.encode_chunks(dense, s, 99, n, 5, "float16")
            got = reduction.encode_chunks(codec_segments.Members(parts, offsets, numel), s, 99, n, 5, "float16")
            assert got[1] == want[1] and np.array_equal(got[0], want[0]), (name, sizes)


def test_a_segmented_encode_refuses_what_it_cannot_encode():
    x = np.ones(1000, np.float32)
    ok = codec.prepare(3000, 4, 512)
    for parts, offsets in (([x, x], [1000, 500]),        # not sorted
                           ([x, x], [0, 999]),           # overlapping
                           ([x], [2001]),                # beyond the tensor
                           ([x[::2].copy(), x], [0, 0])):  # overlapping (a shorter first part)
        with pytest.raises(codec.EncodeError, match="invalid argument"):
            codec_segments.encode(ok, codec_segments.Members(parts, offsets, 3000), 1)
    top = codec_segments.BUCKET_MAX   # the largest bucket the kernel pads, as takes() says
    for bucket, coding in ((top + 1, "fixed"), (512, "elias")):
        prepared = codec.prepare(2 * top, 4, bucket, coding=coding)
        assert not codec_segments.takes(Settings.make(4, bucket_size=bucket, coding=coding))
        with pytest.raises(codec.EncodeError, match="invalid argument"):
            codec_segments.encode(prepared, codec_segments.Members([x], [top - 10], prepared[1]), 1)
    prepared = codec.prepare(2 * top, 4, top)
    assert codec_segments.takes(Settings.make(4, bucket_size=top))
    dense = np.zeros(2 * top, np.float32)
    dense[top - 10:top + 990] = x
    assert np.array_equal(codec_segments.encode(prepared, codec_segments.Members([x], [top - 10], 2 * top), 1),
                          codec.encode_prepared(prepared, dense, 1))
    for bad in (x.astype(np.float64), x[::2], x.reshape(10, 100)):
        with pytest.raises(ValueError, match="contiguous 1-D float32"):
            codec_segments.encode(ok, codec_segments.Members([bad], [0], 3000), 1)
    with pytest.raises(ValueError, match="prepared for 3000 elements, got 2999"):
        codec_segments.encode(ok, codec_segments.Members([x], [0], 2999), 1)
