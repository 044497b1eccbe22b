"""Data-parallel training of a byte-level transformer language model on the Python standard library's
source files, with Horovod and the package's compression methods: the discriminating workload of
``python -m benchmarks convergence --workload lm``.

Run under Horovod, e.g.::

    horovodrun -np 4 --gloo -H localhost:4 .venv/bin/python examples/pytorch_lm.py \\
        --compression qsgd --bits 4 --max-steps 600 --json /tmp/qsgd4.json

The text, its fixed train/validation split, the batches and the model are those of
``examples/lm_common.py``. The methods and their flags (``--method``, ``--compression``,
``--bits``, ``--bucket-size``, ``--error-feedback``, ``--reduction``, ``--budget-bits``,
``--period``, ``--block-size``, ...) are the PyTorch digits example's, and so are the optimizer
(momentum SGD, rank 0's start broadcast to every rank) and the byte counting
(``examples/digits_common.py``). Every rank draws its own batches (``train_batch`` with its rank);
``--max-steps`` optimizer steps are taken (default 300).

Every ``--eval-every`` steps and after the last one, rank 0 evaluates the validation bits per byte
on the fixed validation windows (PQASGD: of its last synchronized model), untimed, and records a
point of the curve: the step, the training time so far (seconds, evaluations excluded), the bytes
rank 0 has sent so far, and the validation bits per byte. ``--json`` gets the results (the curve,
the final validation bits per byte, bytes per step, the corpus manifest, the model's size, whether
all ranks ended with bit-identical parameters); ``--save`` gets rank 0's final parameters
(``torch.save`` of the state dict), so that the reported loss can be checked by evaluating them
directly.
"""
import json
import os
import time

import torch
import torch.nn.functional as F

import horovod.torch as hvd

from hvd_qsgd import codec

import digits_common as common  # examples/digits_common.py: flags, compressors, byte counts
import lm_common as lm          # examples/lm_common.py: the text, the batches, the model
import pytorch_digits as digits  # the PyTorch example's optimizers and methods

METHODS = common.METHODS


def add_flags(p):
    p.add_argument("--context", type=int, default=64, help="bytes of context (default 64)")
    p.add_argument("--d-model", type=int, default=128, help="model width (default 128)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--ngram-rows", type=int, default=16384,
                   help="rows of each hashed n-gram embedding table (default 16384; 0: none)")
    p.add_argument("--ngram-orders", default="2,3", help="orders of the n-gram tables (default 2,3)")
    p.add_argument("--eval-every", type=int, default=50, help="steps between evaluations (default 50)")
    p.add_argument("--eval-windows", type=int, default=256, help="validation windows (default 256)")
    p.add_argument("--train-mb", type=float, default=8.0, help="MB of training text (default 8)")
    p.add_argument("--val-mb", type=float, default=1.0, help="MB of validation text (default 1)")
    p.add_argument("--save", metavar="PATH", help="rank 0 saves its final parameters here")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model and its gradients live (default cpu); cuda: GPU local_rank modulo "
                        "the GPUs this host has, so ranks may share one")
    p.set_defaults(batch_size=4, lr=0.1, max_steps=300)


def parse_args(argv=None):
    return common.parse_args(argv, "Byte-level transformer LM on the standard library, with Horovod and QSGD",
                             "torch and codec threads per rank (default 1)", methods=METHODS,
                             add_flags=add_flags)


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(max(1, args.threads))
    codec.set_num_threads(max(1, args.threads))

    corpus = lm.Corpus(args.train_mb, args.val_mb)
    val_x, val_y = lm.val_windows(corpus.val, args.context, args.eval_windows)

    torch.manual_seed(args.seed + rank)  # the broadcast makes the ranks start alike
    orders = tuple(int(n) for n in args.ngram_orders.split(",") if n.strip())
    device = torch.device("cpu")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("[lm] error: --device cuda, but torch sees no CUDA device here")
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    model = lm.make_model(args.d_model, args.layers, args.heads, args.context, args.ngram_rows, orders).to(device)
    compression = digits.make_compression(args, model)
    opt = digits.make_optimizer(args, model, compression)
    numel = sum(p.numel() for p in model.parameters())
    steps = args.max_steps

    def evaluate():
        params = digits.evaluated_params(args, opt)
        if params is None:
            return lm.bits_per_byte(model, val_x, val_y)
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(params[n])
        try:
            return lm.bits_per_byte(model, val_x, val_y)
        finally:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(saved[n])

    if rank == 0:
        print(f"[lm] np={size} {common.method_label(args)} params={numel} steps={steps} "
              f"batch={args.batch_size}x{args.context} train={corpus.train.size} val={corpus.val.size} bytes",
              flush=True)
    curve, eval_time = [], 0.0
    if rank == 0:
        curve.append(dict(step=0, train_time=0.0, bytes_sent_so_far=0, val_bpb=evaluate()))
    hvd.allreduce(torch.zeros(1), name="start")
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        x, y = lm.train_batch(corpus.train, args.batch_size, args.context, args.seed, rank, step)
        opt.zero_grad()
        x, y = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
        loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        loss.backward()
        opt.step()
        if step == steps and args.method == "pqasgd" and opt.local_steps % opt.period:
            opt.synchronize()  # end on a sync: the ranks' parameters are then bit-identical
        if rank == 0 and (step % args.eval_every == 0 or step == steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the step's kernels are in its time
            t_eval = time.perf_counter()
            sent = common.bytes_so_far(args, numel, common.compressor_stats(args, compression), step,
                                       extra=digits.state_bytes(args, opt, numel))
            point = dict(step=step, train_time=t_eval - t0 - eval_time, bytes_sent_so_far=sent,
                         val_bpb=evaluate(), train_loss_bits=float(loss) / 0.6931471805599453)
            curve.append(point)
            eval_time += time.perf_counter() - t_eval
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    train_time = time.perf_counter() - t0 - eval_time

    mine = torch.tensor([digits.param_checksum(model)], dtype=torch.int64)
    sums = hvd.allgather(mine, name="param_checksum").tolist()
    stats = common.compressor_stats(args, compression)
    result = None
    if rank == 0:
        total = common.bytes_so_far(args, numel, stats, steps, extra=digits.state_bytes(args, opt, numel))
        result = dict(
            workload="lm", label=common.method_label(args), method=args.method, compression=args.compression,
            np=size, device=str(device) if device.type == "cpu" else torch.cuda.get_device_name(device), steps=steps, seed=args.seed, numel=numel, train_time=train_time,
            final_val_bpb=curve[-1]["val_bpb"], bytes_sent_total=total, bytes_per_step=total / steps,
            ranks_identical=len(set(sums)) == 1, checksums=sums, stats=stats, curve=curve,
            method_info=digits.method_info(args, opt), corpus=corpus.manifest,
            model=dict(d_model=args.d_model, layers=args.layers, heads=args.heads, context=args.context,
                       ngram_rows=args.ngram_rows, ngram_orders=list(orders)),
            batch_size=args.batch_size, lr=args.lr, momentum=args.momentum)
        print(f"[lm] {result['label']}: val {result['final_val_bpb']:.4f} bits/byte after {steps} steps, "
              f"{train_time:.1f} s, {total / steps:.0f} bytes/step, ranks identical: {result['ranks_identical']}",
              flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        if args.save:
            saved = digits.evaluated_params(args, opt)
            state = model.state_dict() if saved is None else {**model.state_dict(), **saved}
            torch.save(state, args.save)
    if len(set(sums)) != 1:
        raise SystemExit(f"[lm] error: the ranks ended with different parameters: {sums}")
    hvd.shutdown()
    return result


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
