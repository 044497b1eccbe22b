"""The kept fuzzing inputs as one file (tests/fuzz/corpus.pack): records of a little-endian uint32
length and that many bytes, in the order of their file names (tests/fuzz/replay.cc reads it).

    python tests/fuzz/pack.py pack OUT.pack DIR...    the files of DIRs, into one pack
    python tests/fuzz/pack.py unpack PACK DIR         a pack's inputs as files named by their SHA-1
"""
import hashlib
import os
import struct
import sys


def records(path):
    with open(path, "rb") as f:
        data = f.read()
    at = 0
    while at < len(data):
        if len(data) - at < 4:
            raise ValueError(f"{path}: a record's length is cut short at byte {at}")
        (n,) = struct.unpack_from("<I", data, at)
        at += 4
        if len(data) - at < n:
            raise ValueError(f"{path}: a record of {n} bytes is cut short at byte {at}")
        yield data[at:at + n]
        at += n


def pack(out, folders):
    names = sorted((name, folder) for folder in folders for name in os.listdir(folder))
    with open(out, "wb") as f:
        for name, folder in names:
            with open(os.path.join(folder, name), "rb") as g:
                data = g.read()
            f.write(struct.pack("<I", len(data)) + data)
    print(f"packed {len(names)} inputs into {out} ({os.path.getsize(out)} bytes)")


def unpack(path, folder):
    os.makedirs(folder, exist_ok=True)
    n = 0
    for data in records(path):
        with open(os.path.join(folder, hashlib.sha1(data).hexdigest()), "wb") as f:
            f.write(data)
        n += 1
    print(f"unpacked {n} inputs into {folder}")


if __name__ == "__main__":
    verb, *args = sys.argv[1:] or ["help"]
    if verb == "pack" and len(args) >= 2:
        pack(args[0], args[1:])
    elif verb == "unpack" and len(args) == 2:
        unpack(*args)
    else:
        sys.exit(__doc__)
