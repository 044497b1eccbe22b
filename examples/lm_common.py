"""The language-model workload: a byte-level transformer trained on the Python standard library's own
source files (on every machine that runs Python; real text nobody here wrote).

The text. The ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` of the running Python, in
sorted order of their paths relative to that directory, skipping ``site-packages``,
``dist-packages`` and ``__pycache__`` directories. Each file's bytes are followed by one 0 byte (a
separator that source files do not contain). The split is fixed and documented:

    a file is a validation file  iff  crc32(its relative path, UTF-8) % 10 == 0

(about a tenth of the files and bytes; it does not depend on any seed). ``max_train_mb`` and
``max_val_mb`` keep the first files (in that order) up to so many MB (10^6 bytes); the manifest
(``Corpus.manifest``) records the Python version, the file counts, the byte counts and a SHA-256 of
each text, so that two runs can be checked to have trained on the same text.

Batches. A training batch is ``batch`` windows of ``context + 1`` bytes starting at offsets drawn
uniformly from the training text by ``numpy.random.default_rng([seed, rank, step])`` (each rank its
own draw, every step a fresh one, reproducible). The validation set is ``windows`` windows of
``context + 1`` bytes at evenly spaced offsets of the validation text (no randomness); the
validation loss is the mean cross-entropy of every predicted byte, and bits per byte is that loss
(in nats) divided by ln 2.

The model. Bytes are embedded (256 symbols, ``d_model``, initialised N(0, 0.02)), plus learned
positions, plus hashed n-gram embeddings (below); ``layers`` pre-norm transformer blocks (causal
multi-head self-attention with ``heads`` heads, a 4x MLP with GELU); a final LayerNorm and a linear
head to 256 logits (tied to the byte embedding).

Hashed n-gram embeddings (as byte-level models use them to see words without a tokenizer): for each
order n of ``ngram_orders`` a table of ``ngram_rows`` rows of ``d_model`` (initialised to zero), and
the input at position t adds row ``ngram_id(t, n)`` of table n, where, with b_i the byte at position
i (0 before the window's start),

    h = b_{t-n+1} * 257^(n-1) + ... + b_{t-1} * 257 + b_t,    ngram_id(t, n) = (h * 40503 + 7919 n) mod rows.

The tables hold most of the parameters and almost none of the arithmetic: their gradients are dense
(PyTorch's default ``nn.Embedding``, as most models have them), so the exchange, not the compute,
sets the pace of a data-parallel step on a slow link, as in the models data-parallel training is
used for. ``ngram_rows=0`` leaves them out.
"""
import hashlib
import math
import os
import sys
import sysconfig
import zlib

import numpy as np

SPLIT_MODULUS = 10
SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")


def stdlib_root():
    return sysconfig.get_paths()["stdlib"]


def source_files(root=None):
    """The relative paths (POSIX separators) of the standard library's .py files, sorted."""
    root = root or stdlib_root()
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        for f in files:
            if f.endswith(".py"):
                out.append(os.path.relpath(os.path.join(folder, f), root).replace(os.sep, "/"))
    return sorted(out)


def is_validation(relpath):
    """The documented split: crc32 of the relative path (UTF-8) modulo 10 is 0."""
    return zlib.crc32(relpath.encode("utf-8")) % SPLIT_MODULUS == 0


def _text(root, paths, max_bytes):
    parts, total, used = [], 0, []
    for rel in paths:
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read() + b"\0"
        if max_bytes is not None and total + len(data) > max_bytes and used:
            break
        parts.append(data)
        used.append(rel)
        total += len(data)
    return np.frombuffer(b"".join(parts), dtype=np.uint8), used


class Corpus:
    """The training and validation texts (uint8 arrays) and their manifest."""

    def __init__(self, max_train_mb=None, max_val_mb=None, root=None):
        root = root or stdlib_root()
        files = source_files(root)
        val_files = [f for f in files if is_validation(f)]
        train_files = [f for f in files if not is_validation(f)]
        to_bytes = (lambda mb: None if mb is None else int(mb * 1e6))
        self.train, self.train_files = _text(root, train_files, to_bytes(max_train_mb))
        self.val, self.val_files = _text(root, val_files, to_bytes(max_val_mb))
        self.manifest = dict(
            python=sys.version.split()[0], root=root, split=f"crc32(relative path) % {SPLIT_MODULUS} == 0 -> validation",
            train_files=len(self.train_files), val_files=len(self.val_files),
            train_bytes=int(self.train.size), val_bytes=int(self.val.size),
            train_sha256=hashlib.sha256(self.train.tobytes()).hexdigest(),
            val_sha256=hashlib.sha256(self.val.tobytes()).hexdigest())


def train_batch(text, batch, context, seed, rank, step):
    """(inputs, targets): int64 arrays of shape (batch, context), windows at offsets drawn by
    ``default_rng([seed, rank, step])``."""
    rng = np.random.default_rng([seed, rank, step])
    offsets = rng.integers(0, text.size - context - 1, size=batch)
    idx = offsets[:, None] + np.arange(context + 1)[None, :]
    w = text[idx].astype(np.int64)
    return w[:, :-1], w[:, 1:]


def val_windows(text, context, windows):
    """The validation set: ``windows`` windows of context + 1 bytes at evenly spaced offsets."""
    span = text.size - context - 1
    offsets = np.linspace(0, span, num=windows).astype(np.int64) if windows > 1 else np.zeros(1, np.int64)
    idx = offsets[:, None] + np.arange(context + 1)[None, :]
    w = text[idx].astype(np.int64)
    return w[:, :-1], w[:, 1:]


NGRAM_MULTIPLIER, NGRAM_OFFSET, NGRAM_BASE = 40503, 7919, 257


def ngram_ids(x, n, rows):
    """Row of the order-n table for every position of the int64 windows x (batch, t): the hash of
    the module docstring (bytes before the window's start count as 0)."""
    import torch.nn.functional as F
    t = x.shape[1]
    h = x.new_zeros(x.shape)
    for i in range(n - 1, -1, -1):  # oldest byte first: h = b_{t-n+1} * 257^(n-1) + ... + b_t
        h = h * NGRAM_BASE + F.pad(x, (i, 0))[:, :t]
    return (h * NGRAM_MULTIPLIER + NGRAM_OFFSET * n) % rows


def make_model(d_model=128, layers=2, heads=4, context=128, ngram_rows=0, ngram_orders=(2, 3)):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.proj = nn.Linear(d_model, d_model)
            self.fc1, self.fc2 = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class ByteLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(256, d_model)
            self.pos = nn.Parameter(torch.zeros(context, d_model))
            self.blocks = nn.ModuleList([Block() for _ in range(layers)])
            self.ln = nn.LayerNorm(d_model)
            nn.init.normal_(self.embed.weight, std=0.02)  # small logits at the start: about 8 bits per byte
            nn.init.normal_(self.pos, std=0.02)
            self.orders = tuple(ngram_orders) if ngram_rows else ()
            self.ngrams = nn.ModuleList([nn.Embedding(ngram_rows, d_model) for _ in self.orders])
            for table in self.ngrams:
                nn.init.zeros_(table.weight)

        def forward(self, x):
            h = self.embed(x) + self.pos[: x.shape[1]]
            for n, table in zip(self.orders, self.ngrams):
                h = h + table(ngram_ids(x, n, table.num_embeddings))
            for blk in self.blocks:
                h = blk(h)
            return self.ln(h) @ self.embed.weight.t()

    if d_model % heads:
        raise ValueError(f"d_model {d_model} must be a multiple of heads {heads}")
    return ByteLM()


def bits_per_byte(model, inputs, targets, chunk=64):
    """Mean cross-entropy of every predicted byte of the windows, in bits (nats / ln 2)."""
    import torch
    import torch.nn.functional as F
    was = model.training
    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    with torch.no_grad():
        for lo in range(0, inputs.shape[0], chunk):
            x = torch.from_numpy(inputs[lo: lo + chunk]).to(device)
            y = torch.from_numpy(targets[lo: lo + chunk]).to(device)
            logits = model(x)
            total += float(F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1), reduction="sum"))
            count += y.numel()
    model.train(was)
    return total / count / math.log(2)
