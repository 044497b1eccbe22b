"""Seed inputs for tests/fuzz/fuzz_codec.cc, written into a folder: real payloads of every setting
the encoder takes (modes 0 and 3, as they arrive and resealed), encoder settings with ordinary and
special elements (modes 1 and 4) and real control vectors (mode 2). libFuzzer starts its search from them;
scripts/fuzz.sh merges what it finds into tests/fuzz/corpus/.

    python tests/fuzz/make_seeds.py DIR
"""
import hashlib
import os
import struct
import sys

import numpy as np

from hvd_qsgd import codec


def payloads():
    rng = np.random.default_rng(7)
    for bits in range(1, 9):
        for coding in ("fixed", "elias"):
            for norm in ("max", "l2", "sign"):
                if (norm == "sign" and (bits != 1 or coding != "fixed")) or (coding == "elias" and bits == 1):
                    continue
                for encoder in (1, 2):
                    for numel, bucket in ((1, 1), (5, 2), (37, 8), (300, 64), (1000, 512)):
                        x = rng.standard_normal(numel).astype(np.float32)
                        x[:: max(1, numel // 4)] = 0.0
                        yield codec.encode(x, bits=bits, bucket_size=bucket, norm=norm, coding=coding, seed=numel,
                                           checksum=bool(numel & 1), encoder=encoder).tobytes()


def encoder_inputs():
    rng = np.random.default_rng(11)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3.4e38, -3.4e38, 1e-38], np.float32)
    for a in range(0, 256, 5):
        for numel in (0, 1, 7, 64, 200):
            x = rng.standard_normal(numel).astype(np.float32) * float(rng.choice([1e-30, 1.0, 1e30]))
            if a % 3 == 0 and numel:
                x[rng.integers(0, numel, size=min(numel, 4))] = rng.choice(special, size=min(numel, 4))
            head = struct.pack("<BBHQQB", a, a >> 1, (a * 37) % 4096, a * 2654435761, a, a * 13 % 256)
            for mode in (1, 4):  # the CPU's encoders, the emulated device's
                yield bytes([mode]) + head + x.tobytes()


def control_inputs():
    for world in (1, 2, 3, 8, 25, 49, 64):
        for mask in (0xFFFFFFFFFFFFFFFF, 0x5555555555555555, 0x6):
            for how in (1, 3, 5, 0):
                tail = struct.pack("<d", 0.5) * 3 if how & 4 else b""
                yield bytes([2]) + struct.pack("<BQB", world - 1, mask, how) + tail


def main(out):
    os.makedirs(out, exist_ok=True)
    n = 0
    for p in payloads():
        for mode in (0x00, 0x80, 0x03, 0x83):  # the CPU's readers, the emulated device's
            data = bytes([mode]) + p
            n += write(out, data)
    for data in (*encoder_inputs(), *control_inputs()):
        n += write(out, data)
    print(f"{n} seed inputs in {out}")


def write(out, data):
    path = os.path.join(out, hashlib.sha1(data).hexdigest())
    if os.path.exists(path):
        return 0
    with open(path, "wb") as f:
        f.write(data)
    return 1


if __name__ == "__main__":
    main(sys.argv[1])
