"""One encode and one decode_sum of a large tensor on the GPU, for ``ncu`` (make gpu-check's profile
step): ``ncu --set basic python3 scripts/gpu_profile.py [numel] [bits] [bucket]``."""
import sys

import torch

from hvd_qsgd import cuda


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 64 << 20
    bits = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    bucket = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    x = torch.randn(n, device="cuda")
    p = cuda.encode(x, bits=bits, bucket_size=bucket)
    cuda.decode_sum([p])
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
