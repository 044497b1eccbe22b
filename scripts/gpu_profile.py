"""One call of each kernel family on a large tensor, for ``ncu`` (docs/gpu.md's profile):
``ncu --section SpeedOfLight --section InstructionStats python3 scripts/gpu_profile.py [numel] [bits] [bucket] [encoder]``.
Runs the fixed-coding encode, the encode with error feedback fused, decode_sum, and the Elias
coding's encode and decode."""
import sys

import torch

from hvd_qsgd import cuda


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 64 << 20
    bits = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    bucket = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    encoder = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    x = torch.randn(n, device="cuda")
    p = cuda.encode(x, bits=bits, bucket_size=bucket, encoder=encoder)
    cuda.decode_sum([p])
    residual = torch.zeros(n, device="cuda")
    cuda.encode(x, bits=bits, bucket_size=bucket, residual=residual, residual_valid=True, encoder=encoder)
    q = cuda.encode(x, bits=bits, bucket_size=bucket, coding="elias", encoder=encoder)
    cuda.decode_sum([q])
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
