"""``hvd_qsgd.torch.DynamicQSGD``: the PyTorch adapter of ``hvd_qsgd.DynamicQSGD`` (DQSGD).

Each tensor (keyed as its error-feedback residual is: parameter name, or position in the step)
has a ``hvd_qsgd.dynamic.Schedule``; an exchange takes its bits from it in ``compress`` and feeds it
the norm of its reduced result in ``decompress``. That result is bit-identical on every rank and
the norm is summed in a fixed order (NumPy pairwise summation in float64), so every rank computes
the same bits for the next exchange of the tensor without exchanging anything.
"""
import numpy as np

from hvd_qsgd.settings import default_bucket_size
from hvd_qsgd.dynamic import Schedule
from hvd_qsgd.torch.compressor import QSGD


class DynamicQSGD(QSGD):
    """DQSGD for ``horovod.torch`` (see ``hvd_qsgd.DynamicQSGD``)."""

    def __init__(self, *args, schedule_args, fixed_bucket_size=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._schedule_args = dict(schedule_args)
        self._fixed_bucket_size = fixed_bucket_size
        self._schedules = {}
        self._settings_of_bits = {}
        self.bits_history = []     # (key, bits) of every exchange, in compress order

    def __repr__(self):
        return f"hvd_qsgd.torch.DynamicQSGD({self._schedule_args}, {self.settings})"

    def _exchange_settings(self, residual_key, tensor):
        with self._lock:
            schedule = self._schedules.get(residual_key)
            if schedule is None:
                schedule = self._schedules[residual_key] = Schedule(**self._schedule_args)
            bits = schedule.next_bits()
            self.bits_history.append((residual_key, bits))
            if len(self.bits_history) > 100000:
                del self.bits_history[:50000]
        settings = self._settings_of_bits.get(bits)
        if settings is None:  # made (and checked) once per bit width
            bucket = self._fixed_bucket_size or default_bucket_size(bits)
            settings = self._settings_of_bits[bits] = self.settings.replace(bits=bits, bucket_size=bucket)
        return settings

    def _decoded(self, ctx, out):
        x = out.detach().reshape(-1).cpu().numpy().astype(np.float64)
        norm = float(np.sqrt(np.sum(x * x)))
        with self._lock:
            self._schedules[ctx.residual_key].observe(norm)

    def state_dict(self):
        state = super().state_dict()
        with self._lock:
            state["schedules"] = {k: s.state() for k, s in self._schedules.items()}
        return state

    def load_state_dict(self, state):
        super().load_state_dict(state)
        with self._lock:
            self._schedules = {}
            for k, v in state.get("schedules", {}).items():
                self._schedules[k] = Schedule(**self._schedule_args)
                self._schedules[k].load(v)

    def reset(self, residuals=True):
        super().reset(residuals)
        if residuals:
            with self._lock:
                self._schedules = {}
