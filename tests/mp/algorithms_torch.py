"""Worker for tests/test_algorithms.py: each algorithm's update rule, step by step, against a
single-process NumPy re-statement of its equations, under horovodrun.

The problem: a model with one compressed parameter ``w`` (12,000 elements: the last bucket/block
is partial) and one small parameter ``b`` (100 elements, below ``min_numel``: averaged exactly by
Horovod), and a loss linear in them, L_r,t = <c_r,t, w> + <d_r,t, b>, so rank r's gradient at step
t is (c_r,t, d_r,t), drawn from a seeded generator every rank can reproduce for every rank. Each
rank runs the real optimizer and compressor; the re-statement runs every rank's side of the
algorithm in NumPy (quantizing with ``hvd_qsgd.codec`` and the documented payload seeds, as the
codec is specified and tested on its own) and every step's parameters must match. Every rank prints
``OK <scenario>``; a failed check raises (the rank exits non-zero) naming the step.
"""
import sys

import numpy as np
import torch
import horovod.torch as hvd

import hvd_qsgd
import hvd_qsgd.torch
from hvd_qsgd import codec, protocol
from hvd_qsgd.settings import default_bucket_size
from tests.references import block_sign, dqsgd_bits

NW, NB = 12000, 100
MIN_NUMEL = 1000
STEPS = 8
SCALES = [1.0, 8.0, 0.5, 4.0, 1.0, 0.1, 2.0, 16.0, 0.25, 1.0]   # gradient size per step (DQSGD's bits vary)


def grads(r, t, scale=1.0):
    g = np.random.default_rng([11, r, t])
    return (scale * g.standard_normal(NW)).astype(np.float32), g.standard_normal(NB).astype(np.float32)


class Model(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        g = np.random.default_rng(seed)
        self.w = torch.nn.Parameter(torch.from_numpy(g.standard_normal(NW).astype(np.float32)))
        self.b = torch.nn.Parameter(torch.from_numpy(g.standard_normal(NB).astype(np.float32)))

    def loss(self, r, t, scale=1.0):
        c, d = grads(r, t, scale)
        return (self.w * torch.from_numpy(c)).sum() + (self.b * torch.from_numpy(d)).sum()


def step(opt, model, rank, t, lr=None, scale=1.0):
    """One training step of this rank (at learning rate ``lr``, if given)."""
    if lr is not None:
        for group in opt.param_groups:
            group["lr"] = lr
    opt.zero_grad()
    model.loss(rank, t, scale).backward()
    opt.step()


def close(actual, expected, what, rtol=1e-5, atol=1e-6):
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    err = np.abs(actual - expected)
    bound = atol + rtol * np.abs(expected)
    if not np.all(err <= bound):
        i = int(np.argmax(err - bound))
        raise AssertionError(f"{what}: element {i} is {actual[i]!r}, the re-statement gives {expected[i]!r} "
                             f"(max abs error {err.max():.3g})")


def qsgd_payload(x, bits, bucket, seed):
    return codec.encode(np.asarray(x, np.float32), bits, bucket, "max", seed, "fixed", 0, False)


# -- error feedback with learning-rate changes ----------------------------------------------------

LRS = [0.1, 0.1, 0.05, 0.05, 0.1, 0.2, 0.1, 0.1, 0.1, 0.1]   # lr_made / lr_now up to 2


def scenario_error_feedback(n, rank):
    """QSGD(4, error_feedback=True) + follow_learning_rate under hvd.DistributedOptimizer(SGD):
        v_r = g_r + e_r * lr_made / lr_t,  p_r = Q(v_r),  e_r <- v_r - decode(p_r),  lr_made <- lr_t
        w <- w - lr_t * (1/n) sum_r decode(p_r)
    and the property error feedback exists for: sum_t lr_t (1/n) sum_r g_r,t - (w_0 - w_t) equals
    lr_made * (1/n) sum_r e_r (what is still owed), which stays bounded: |e| <= G / (s - rho)
    elementwise, G = max |g|, s = 7 levels, rho = the largest lr_made / lr_t: a quantization leaves
    at most one level step, scale/s = max|v|/s, and max|v| <= G + rho max|e|, so from e = 0 the
    bound E <= (G + rho E)/s holds at every step. The learning rate is the one applied: Horovod's
    optimizer's, after its load_state_dict too (then the groups of the optimizer it wraps are stale)."""
    model = Model(5)
    comp = hvd_qsgd.QSGD(4, error_feedback=True, min_numel=MIN_NUMEL, seed=3,
                         named_parameters=model.named_parameters())
    base = torch.optim.SGD(model.parameters(), lr=LRS[0])
    comp.follow_learning_rate(base)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=comp)
    k = comp._creation_index
    w = model.w.detach().numpy().astype(np.float32).copy()
    w0 = w.astype(np.float64)
    e = [np.zeros(NW, np.float32) for _ in range(n)]
    made = [None] * n
    owed_target = np.zeros(NW)
    rho = max(max(a / b for a, b in zip(LRS[:-1], LRS[1:])), 1.0)
    G = max(float(np.abs(grads(r, t)[0]).max()) for r in range(n) for t in range(STEPS))
    bound = G / (7 - rho) * (1 + 1e-6)
    for t in range(STEPS):
        lr = LRS[t]
        if t == 3:   # a resume, as Horovod's examples make one: the optimizer Horovod made gets groups of
            opt.load_state_dict(opt.state_dict())   # its own, and base's learning rate no longer moves
        step(opt, model, rank, t, lr)
        payloads = []
        for r in range(n):
            v = grads(r, t)[0] + (e[r] * np.float32(made[r] / lr) if made[r] else e[r])
            p = qsgd_payload(v, 4, 512, protocol.payload_seed(3, r, f"hvd_qsgd.{k}.p.w", t))
            e[r] = v - codec.decode(p)
            made[r] = lr
            payloads.append(p)
        avg = codec.decode_sum(payloads, 1.0 / n)
        w = (w - np.float32(lr) * avg).astype(np.float32)
        close(model.w.detach().numpy(), w, f"error feedback, step {t}: w")
        owed_target += lr * np.mean([grads(r, t)[0] for r in range(n)], axis=0, dtype=np.float64)
        owed = owed_target - (w0 - model.w.detach().numpy().astype(np.float64))
        close(owed, lr * np.mean(e, axis=0, dtype=np.float64), f"error feedback, step {t}: what is owed",
              rtol=1e-3, atol=1e-4)
        worst = max(float(np.abs(x).max()) for x in e)
        if worst > bound:
            raise AssertionError(f"error feedback, step {t}: residual {worst} exceeds the bound {bound}")
    mine = np.asarray(comp._adapter("torch").residuals.residuals["w"])  # NumPy on the CPU backend
    close(mine, e[rank], "error feedback: this rank's residual", rtol=1e-5, atol=1e-6)
    # the state checkpoints: a fresh compressor loaded from it continues identically
    state = comp.state_dict()
    if state["torch"]["residual_lr"] != {"w": LRS[STEPS - 1]}:
        raise AssertionError(f"error feedback: checkpointed learning rates {state['torch']['residual_lr']}")


# -- DQSGD -----------------------------------------------------------------------------------------

def scenario_dqsgd(n, rank):
    """DynamicQSGD(3.0) under hvd.DistributedOptimizer(SGD): step t quantizes every rank's gradient
    with b_t bits (bucket 128 for 2 bits, else 512), b_t from the norms of the previous reduced
    gradients; w <- w - lr (1/n) sum_r decode(p_r). Bits must vary here (the gradients' scale does)."""
    model = Model(6)
    comp = hvd_qsgd.DynamicQSGD(3.0, min_numel=MIN_NUMEL, seed=4, named_parameters=model.named_parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), compression=comp)
    k = comp._creation_index
    w = model.w.detach().numpy().astype(np.float32).copy()
    norms = []
    for t in range(STEPS):
        step(opt, model, rank, t, scale=SCALES[t])
        b = dqsgd_bits(3.0, norms)[t]
        payloads = [qsgd_payload(grads(r, t, SCALES[t])[0], b, default_bucket_size(b),
                                 protocol.payload_seed(4, r, f"hvd_qsgd.{k}.p.w", t)) for r in range(n)]
        avg = codec.decode_sum(payloads, 1.0 / n)
        norms.append(float(np.sqrt(np.sum(avg.astype(np.float64) ** 2))))
        w = (w - np.float32(0.01) * avg).astype(np.float32)
        close(model.w.detach().numpy(), w, f"dqsgd, step {t} ({b} bits): w")
    used = [b for key, b in comp._adapter("torch").bits_history if key == "w"]
    if used != dqsgd_bits(3.0, norms)[:STEPS] or len(set(used)) < 2:
        raise AssertionError(f"dqsgd: bits {used}, the rule gives {dqsgd_bits(3.0, norms)[:STEPS]}")


# -- dist-EF-SGDM ------------------------------------------------------------------------------------

def scenario_efsgdm(n, rank, reduction):
    """EFSGDM with BlockSign(256): Algorithm 1 of dist-EF-SGDM in float64,
        m_r = mu m_r + g_r;  p_r = lr (mu m_r + g_r) + e_r;  D_r = C(p_r);  e_r = p_r - D_r
        server: D~ = (1/n) sum_r D_r + e~;  D = C(D~);  e~ = D~ - D     (scatter_allgather: two-way)
                D = (1/n) sum_r D_r                                     (allgather: one-way)
        w <- w - D;  b (exact average, no compression) <- b - (1/n) sum_r lr (mu m_r + g_r)."""
    block, mu = 256, 0.9
    model = Model(7)
    comp = hvd_qsgd.BlockSign(block_size=block, min_numel=MIN_NUMEL, reduction=reduction)
    opt = hvd_qsgd.torch.EFSGDM(model.named_parameters(), lr=LRS[0], momentum=mu, compression=comp)
    w = model.w.detach().numpy().astype(np.float64)
    b = model.b.detach().numpy().astype(np.float64)
    m = [np.zeros(NW) for _ in range(n)]
    mb = [np.zeros(NB) for _ in range(n)]
    e = [np.zeros(NW) for _ in range(n)]
    server_e = np.zeros(NW)
    for t in range(STEPS):
        lr = LRS[t]
        step(opt, model, rank, t, lr)
        sent, ub = [], []
        for r in range(n):
            c, d = (x.astype(np.float64) for x in grads(r, t))
            m[r] = mu * m[r] + c
            mb[r] = mu * mb[r] + d
            p = lr * (mu * m[r] + c) + e[r]
            sent.append(block_sign(p, block))
            e[r] = p - sent[-1]
            ub.append(lr * (mu * mb[r] + d))
        if reduction == "scatter_allgather":
            avg = np.mean(sent, axis=0) + server_e
            delta = block_sign(avg, block)
            server_e = avg - delta
        else:
            delta = np.mean(sent, axis=0)
        w, b = w - delta, b - np.mean(ub, axis=0)
        scale = float(np.abs(delta).max())
        close(model.w.detach().numpy(), w, f"efsgdm ({reduction}), step {t}: w", rtol=1e-5, atol=1e-5 * scale)
        close(model.b.detach().numpy(), b, f"efsgdm ({reduction}), step {t}: b", rtol=1e-5, atol=1e-6)


# -- PQASGD ----------------------------------------------------------------------------------------

def scenario_pqasgd(n, rank, momentum):
    """PeriodicQuantizedAveraging(SGD(lr, mu), period 3, QSGD(2)): ranks start from rank 0's model
    (broadcast), take local momentum-SGD steps (buf = mu buf + g, buf_0 = g; x -= lr buf) and every
    3rd step x^ <- x^ + (1/n) sum_r decode(Q(x_r - x^)) (b: exact average), x_r <- x^; momentum
    buffers stay local ("local") or are replaced by their average over the ranks ("average")."""
    period, lr, mu = 3, 0.05, 0.9
    model = Model(100 + rank)                 # different on every rank: the broadcast makes them alike
    start = Model(100)
    comp = hvd_qsgd.QSGD(2, min_numel=MIN_NUMEL, seed=9)
    opt = hvd_qsgd.torch.PeriodicQuantizedAveraging(
        torch.optim.SGD(model.parameters(), lr=lr, momentum=mu), model.named_parameters(), period=period,
        compression=comp, momentum=momentum)
    k = comp._creation_index
    x = [[start.w.detach().numpy().copy(), start.b.detach().numpy().copy()] for _ in range(n)]
    anchor = [start.w.detach().numpy().copy(), start.b.detach().numpy().copy()]
    buf = [[None, None] for _ in range(n)]
    syncs = 0
    for t in range(2 * period + 2):
        step(opt, model, rank, t)
        for r in range(n):
            for i, g in enumerate(grads(r, t)):
                buf[r][i] = g.copy() if buf[r][i] is None else (np.float32(mu) * buf[r][i] + g).astype(np.float32)
                x[r][i] = (x[r][i] - np.float32(lr) * buf[r][i]).astype(np.float32)
        if (t + 1) % period == 0:
            payloads = [qsgd_payload(x[r][0] - anchor[0], 2, 128,
                                     protocol.payload_seed(9, r, f"hvd_qsgd.{k}.s{syncs}", 0)) for r in range(n)]
            anchor[0] = (anchor[0] + codec.decode_sum(payloads, 1.0 / n)).astype(np.float32)
            anchor[1] = (anchor[1] + np.mean([x[r][1] - anchor[1] for r in range(n)], axis=0)).astype(np.float32)
            for r in range(n):
                x[r] = [anchor[0].copy(), anchor[1].copy()]
            if momentum == "average":
                for i in range(2):
                    avg = np.mean([buf[r][i] for r in range(n)], axis=0).astype(np.float32)
                    for r in range(n):
                        buf[r][i] = avg.copy()
            syncs += 1
        close(model.w.detach().numpy(), x[rank][0], f"pqasgd ({momentum}), step {t}: w", rtol=1e-4, atol=1e-5)
        close(model.b.detach().numpy(), x[rank][1], f"pqasgd ({momentum}), step {t}: b", rtol=1e-4, atol=1e-5)
        state_buf = opt.state[model.w]["momentum_buffer"].numpy()
        close(state_buf, buf[rank][0], f"pqasgd ({momentum}), step {t}: momentum buffer", rtol=1e-4, atol=1e-5)
    if opt.syncs != syncs:
        raise AssertionError(f"pqasgd: {opt.syncs} syncs, expected {syncs}")


def scenario_pqasgd_elastic_state(n, rank):
    """hvd_qsgd.torch.elastic.TorchState carrying a PeriodicQuantizedAveraging made with broadcast=False
    (every rank from a model of its own, rank r r + 1 local steps in: a worker joining a job): its sync
    gives every rank rank 0's parameters, momentum buffer, x^ and step counts; a restore after a
    sync brings back the saved ones; pickling it (Horovod's own state would) is refused, naming the
    package's state."""
    import pickle
    import hvd_qsgd.torch.elastic
    model = Model(100 + rank)
    opt = hvd_qsgd.torch.PeriodicQuantizedAveraging(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model.named_parameters(), period=3,
        compression=hvd_qsgd.QSGD(2, min_numel=MIN_NUMEL, seed=9), broadcast=False)
    for t in range(rank + 1):
        step(opt, model, rank, t)

    def everything():
        return ([model.w.detach().numpy().copy(), model.b.detach().numpy().copy(),
                 opt.state[model.w]["momentum_buffer"].numpy().copy()]
                + [opt.anchor[k].numpy().copy() for k in ("w", "b")], (opt.local_steps, opt.syncs))

    state = hvd_qsgd.torch.elastic.TorchState(model=model, optimizer=opt, step=0)
    assert state.optimizer is opt
    state.sync()
    tensors, counts = everything()
    root = hvd.broadcast_object(everything(), root_rank=0, name="pqasgd_elastic_root")
    if counts != (1, 0) or counts != root[1] or not all(np.array_equal(a, b) for a, b in zip(tensors, root[0])):
        raise AssertionError(f"pqasgd elastic: after the sync, rank {rank} holds step counts {counts}, rank 0 {root[1]}")
    if rank and np.array_equal(tensors[3], Model(100 + rank).w.detach().numpy()):
        raise AssertionError("pqasgd elastic: x^ is still this rank's own")
    state.save()
    for t in range(1, 4):   # a sync at the third local step
        step(opt, model, rank, t)
    if opt.syncs != 1:
        raise AssertionError(f"pqasgd elastic: {opt.syncs} syncs, expected 1")
    state.restore()
    again, counts = everything()
    if counts != (1, 0) or not all(np.array_equal(a, b) for a, b in zip(again, tensors)):
        raise AssertionError(f"pqasgd elastic: restore gave step counts {counts}, or other tensors than saved")
    try:
        pickle.dumps(opt)
    except TypeError as e:
        assert "hvd_qsgd.torch.elastic.TorchState" in str(e), e
    else:
        raise AssertionError("pqasgd elastic: pickled")


def scenario_state_broadcast(n, rank):
    """Horovod's resume pattern (rank 0 loads the checkpoint, then hvd.broadcast_optimizer_state, as
    Horovod's elastic TorchState's sync does too): Horovod fills an empty state by calling step() on
    the ranks that hold none, and EFSGDM's exchange there waited forever for rank 0. Now that step
    only makes the momentum buffers: every rank gets rank 0's, and the next step runs, replicas
    alike. A PeriodicQuantizedAveraging, which holds more than an optimizer's state, is refused on
    every rank, saying what to do (it failed with KeyError: 'state')."""
    def efsgdm():
        model = Model(7)
        return model, hvd_qsgd.torch.EFSGDM(model.named_parameters(), lr=0.01, momentum=0.9,
                                            compression=hvd_qsgd.BlockSign(block_size=256, min_numel=MIN_NUMEL))
    model, opt = efsgdm()
    for t in range(2):
        step(opt, model, rank, t)
    saved = opt.state_dict() if rank == 0 else None
    model, opt = efsgdm()   # (a new process: rank 0 loads its checkpoint, the others start empty)
    if rank == 0:
        opt.load_state_dict(saved)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    mine = [opt.state[p]["momentum_buffer"].numpy().copy() for p in (model.w, model.b)]
    root = hvd.broadcast_object(mine, root_rank=0, name="state_broadcast_momentum")
    if not np.any(root[0]) or not all(np.array_equal(a, b) for a, b in zip(mine, root)):
        raise AssertionError(f"state broadcast: rank {rank}'s momentum buffers are not rank 0's")
    step(opt, model, rank, 2)
    w = hvd.allgather(model.w.detach().reshape(1, -1), name="state_broadcast_w")
    if not all(torch.equal(w[0], w[r]) for r in range(n)):
        raise AssertionError("state broadcast: replicas differ after the next step")
    pq = hvd_qsgd.torch.PeriodicQuantizedAveraging(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                                   period=2, compression=hvd_qsgd.QSGD(2, min_numel=MIN_NUMEL))
    try:
        hvd.broadcast_optimizer_state(pq, root_rank=0)
    except TypeError as e:
        assert "load its checkpoint (state_dict()) on every rank" in str(e), e
    else:
        raise AssertionError("state broadcast: a PeriodicQuantizedAveraging was taken")


SCENARIOS = {
    "state-broadcast": scenario_state_broadcast,
    "error-feedback": scenario_error_feedback,
    "dqsgd": scenario_dqsgd,
    "efsgdm-two-way": lambda n, r: scenario_efsgdm(n, r, "scatter_allgather"),
    "efsgdm-one-way": lambda n, r: scenario_efsgdm(n, r, "allgather"),
    "pqasgd-local": lambda n, r: scenario_pqasgd(n, r, "local"),
    "pqasgd-average": lambda n, r: scenario_pqasgd(n, r, "average"),
    "pqasgd-elastic-state": scenario_pqasgd_elastic_state,
}


def main():
    hvd.init()
    torch.set_num_threads(1)
    for name in sys.argv[1:]:
        SCENARIOS[name](hvd.size(), hvd.rank())
        print(f"OK {name}", flush=True)


if __name__ == "__main__":
    main()
