"""DQSGD: dynamic quantization, the bits of every step chosen from the error bound under a
communication budget (Yan, Huang, Lan & Song, "DQSGD: Dynamic Quantized Stochastic Gradient Descent
for Communication-Efficient Distributed Learning").

The rule. The paper bounds the model error after T steps of quantized SGD (step size alpha, an
L-smooth, mu-strongly convex loss, N workers) by a contraction term plus the variance each step's
quantization adds, discounted by the contraction of the remaining steps:

    E F(w_T) - F*  <=  (1 - alpha mu)^T (F(w_0) - F*)
                       + (L alpha^2 / 2N) sum_t (1 - alpha mu)^(T-1-t) (sigma^2 + q(b_t) ||g_t||^2),

where q(b) is the quantizer's variance factor, E||Q(g) - g||^2 <= q(b) ||g||^2. For QSGD with
s = 2^(b-1) - 1 levels per bucket of B elements, q(b) = B / s^2 (Lemma 3.1 of the QSGD paper, the
regime s < sqrt(B) used in practice), which is c * 4^(-b) up to the -1. Minimising that bound over
b_0 .. b_{T-1} under the communication budget sum_t d b_t <= d T b_bar (Lagrange multiplier lambda)
sets the derivative of each step's term equal:

    ln(4) c w_t ||g_t||^2 4^(-b_t) = lambda,          w_t = (1 - alpha mu)^(T-1-t),
    b_t = kappa + log2 ||g_t|| + (T-1-t)/2 * log2(1 - alpha mu),

with kappa fixed by the budget: the bits of a step grow by one for every doubling of the gradient
norm, and, with a discount (1 - alpha mu) < 1, as fewer steps remain ("the norm of gradients and the
remaining number of iterations", as the paper puts it). The full text was not at hand when this was
written: the derivation above is the paper's optimisation problem solved in closed form here, and
the docstrings cite it by its terms, not by section numbers.

How it runs (``Schedule``), per tensor, so that every rank picks the same bits with no extra
message:

* ||g_t|| is the norm of the tensor's previous *reduced* gradient, the decoded result every rank
  already holds bit-identically (the current local gradient differs per rank; agreeing on it would
  cost a round trip). The first step, with no history, sends b_bar.
* r_t = log2 ||g_t|| + h_t splits into the norm term and the horizon term
  h_t = (T-1-t)/2 log2(discount). The horizon term is known in advance, so its mean over the run,
  h_bar = (T-1)/4 log2(discount), is exact; the norm term's mean is not (future norms are not known)
  and is estimated by the running mean of the norms so far. The budget of step t is
  a_t = b_bar + (h_t - h_bar) (they add up to T b_bar) and its target
  p_t = a_t + (log2 ||g_t|| - running mean of log2 ||g||).
* The budget is a hard one: bits are whole numbers in [min_bits, max_bits], and the budget left
  unspent so far, u_t = sum_{tau<t} (a_tau - b_tau), is added before rounding:
  b_t = clamp(round(p_t + u_t)). Bits a large gradient takes are repaid at the next steps, rounding
  error too, so sum_t b_t stays within a few bits of sum_t a_t while the clamp does not bind. The
  price of not knowing future norms: a norm trend that outlasts the repayment is flattened; what the
  rule moves is bits from steps with small gradients to steps with large ones, and (discount < 1)
  from early steps to late ones.

The bits of each exchange enter the control vector's settings tag and the payload header, so ranks
that disagree (a bug, or different settings) get a mismatch error, not a silent mix. Payloads
change length with the bits; the reductions take variable-length payloads already.
"""
import math

from hvd_qsgd import codec


class Schedule:
    """The bits of one tensor's exchanges, step after step (see the module docstring).

    budget:     b_bar, the average bits per coordinate to spend
    min_bits, max_bits: the range of b_t (QSGD: 2..8; 2 bits is ternary)
    discount:   1 - alpha mu of the error bound (1: no horizon term)
    total_steps: T, needed when discount < 1
    """

    FIELDS = ("steps", "observed", "sum_r", "carry", "norm")

    def __init__(self, budget, min_bits=2, max_bits=8, discount=1.0, total_steps=None):
        self.budget, self.min_bits, self.max_bits = float(budget), int(min_bits), int(max_bits)
        self.discount, self.total_steps = float(discount), total_steps
        self.steps = 0       # exchanges so far, t
        self.observed = 0    # steps that had a previous norm
        self.sum_r = 0.0     # sum of log2 ||g|| over them
        self.carry = 0.0     # the budget left unspent so far, u_t
        self.norm = None     # ||previous reduced gradient||

    def next_bits(self):
        """b_t for the next exchange (and advance the state)."""
        budget = self.budget                         # a_t
        if self.discount < 1.0:
            t = min(self.steps, self.total_steps - 1)
            budget += 0.5 * math.log2(self.discount) * ((self.total_steps - 1 - t) - (self.total_steps - 1) / 2)
        target = budget                              # p_t
        if self.norm is not None:
            r = math.log2(max(self.norm, 1e-30))
            self.observed += 1
            self.sum_r += r
            target += r - self.sum_r / self.observed
        bits = int(min(self.max_bits, max(self.min_bits, math.floor(target + self.carry + 0.5))))
        self.carry += budget - bits
        self.steps += 1
        return bits

    def observe(self, norm):
        """Record the norm of the tensor's reduced gradient of this step."""
        self.norm = float(norm) if math.isfinite(norm) else self.norm

    def state(self):
        return {k: getattr(self, k) for k in self.FIELDS}

    def load(self, state):
        for k in self.FIELDS:
            setattr(self, k, state[k])


def check_schedule_args(budget_bits_per_coord, min_bits, max_bits, discount, total_steps):
    """ValueError naming the parameter. The compressor is ``hvd_qsgd.DynamicQSGD``
    (``hvd_qsgd.compressor``); its adapters take their bits from ``hvd_qsgd.policy.ScheduledBits``."""
    if not isinstance(budget_bits_per_coord, (int, float)) or isinstance(budget_bits_per_coord, bool) \
            or not math.isfinite(budget_bits_per_coord):
        raise ValueError(f"budget_bits_per_coord must be a number, got {budget_bits_per_coord!r}")
    for name, v in (("min_bits", min_bits), ("max_bits", max_bits)):
        if not codec.is_integer(v) or not 2 <= v <= 8:
            raise ValueError(f"{name} must be an integer in 2..8, got {v!r}")
    if min_bits > max_bits:
        raise ValueError(f"min_bits ({min_bits}) must not exceed max_bits ({max_bits})")
    if not min_bits <= budget_bits_per_coord <= max_bits:
        raise ValueError(f"budget_bits_per_coord must lie in [min_bits, max_bits] = [{min_bits}, {max_bits}], "
                         f"got {budget_bits_per_coord!r}")
    if not isinstance(discount, (int, float)) or isinstance(discount, bool) or not 0 < discount <= 1:
        raise ValueError(f"discount must be in (0, 1], got {discount!r}")
    if (discount < 1 or total_steps is not None) and (not codec.is_integer(total_steps) or total_steps < 1):
        raise ValueError(f"total_steps must be a positive integer (needed when discount < 1), got {total_steps!r}")
