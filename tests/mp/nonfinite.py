"""Inputs with NaN/Inf in known buckets, shared by the robustness workers of both frameworks."""
import numpy as np

SEED = 3


def bad_input(r, numel, bucket, dtype=np.float32):
    """Rank r's input with NaN/Inf in a few buckets: rank 0 a NaN in bucket 0 and +Inf in bucket 3,
    rank 1 -Inf in bucket 3 (Inf - Inf across ranks) and in bucket 10, and +Inf in the last bucket."""
    x = np.random.default_rng([SEED, r]).standard_normal(numel).astype(np.float32)
    if r == 0:
        x[5], x[3 * bucket + 7] = np.nan, np.inf
    if r == 1:
        x[3 * bucket + 1], x[10 * bucket] = -np.inf, -np.inf
        x[numel - 1] = np.inf
    return x.astype(dtype)
