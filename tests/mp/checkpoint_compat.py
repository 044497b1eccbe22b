"""Checkpoints of the PyTorch compressors load across the package's restructuring.

``checkpoint_compat.py save PATH`` (run at commit a518ccf, one process, ``hvd.init()`` of size 1)
trains three compressors for three steps (QSGD(4) with error feedback following the learning rate
under scatter_allgather with server error feedback, DQSGD with error feedback, BlockSign) and saves
their ``state_dict()``s with torch.save. ``checkpoint_compat.py check PATH`` makes the same
compressors with the code now, loads the file, checks that every residual, rate, server residual,
statistic and DQSGD schedule came back as saved, and takes one more step from there; it prints
``CHECKPOINT OK``. tests/test_golden_payloads.py runs the check on tests/data/checkpoint_a518ccf.pt.
"""
import sys

import numpy as np
import torch
import horovod.torch as hvd

import hvd_qsgd


def compressors(named):
    return {
        "qsgd": hvd_qsgd.QSGD(4, error_feedback=True, reduction="scatter_allgather", server_error_feedback=True,
                              named_parameters=named).follow_learning_rate(lambda key: 0.05),
        # made with the default of a518ccf, reduction="allgather" (the default is "auto" since)
        "dqsgd": hvd_qsgd.DynamicQSGD(3.0, error_feedback=True, reduction="allgather", named_parameters=named),
        "blocksign": hvd_qsgd.BlockSign(named_parameters=named),
    }


def step(c, params, i):
    for j, p in enumerate(params):
        g = torch.from_numpy(np.random.default_rng(10 * i + j).standard_normal(p.numel()).astype(np.float32))
        p.grad = g
        ctrl, ctx = c.compress(p.grad)
        c.decompress(hvd.allreduce(ctrl, op=hvd.Average, name=f"ckpt.{id(c)}.{i}.{j}"), ctx)


def same(a, b, where):
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(map(str, a)) == sorted(map(str, b)), (where, list(a), list(b))
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, torch.as_tensor(b)), where
    else:
        assert a == b, (where, a, b)


def main():
    mode, path = sys.argv[1], sys.argv[2]
    hvd.init()
    params = [torch.nn.Parameter(torch.zeros(12000)), torch.nn.Parameter(torch.zeros(10500))]
    named = [("w", params[0]), ("b", params[1])]
    cs = compressors(named)
    if mode == "save":
        for c in cs.values():
            for i in range(3):
                step(c, params, i)
        torch.save({k: c.state_dict() for k, c in cs.items()}, path)
        return
    saved = torch.load(path, weights_only=False)
    for k, c in cs.items():
        c.load_state_dict(saved[k])
        now = c.state_dict()["torch"]
        for field, value in saved[k]["torch"].items():
            if field == "stats":  # fields added since keep their zero
                value = {**{f: 0 for f in now["stats"]}, **value, "ratio": now["stats"]["ratio"]}
            if field == "settings":  # settings added since keep their default
                value = {**{f: v for f, v in now["settings"].items() if f not in value}, **value}
            same(value, now[field], f"{k}.{field}")
        assert now["residuals"] and (k != "qsgd" or (now["server_residuals"] and now["residual_lr"]))
        step(c, params, 3)
    print("CHECKPOINT OK", flush=True)


if __name__ == "__main__":
    main()
