"""Bits policies: the settings each exchange of a tensor uses, consulted by the adapters.

A compressor is one adapter per framework configured by a ``Settings`` object and a policy, in the
manner of PyTorch's ``PowerSGDState``: the adapter does the exchange, the policy says with which
settings.

* ``FixedBits``: every exchange uses the compressor's settings (QSGD's fixed bits, or BlockSign's
  sign norm with one bit).
* ``ScheduledBits``: DQSGD: each tensor (keyed as its residual) has a ``hvd_qsgd.dynamic.Schedule``;
  an exchange takes its bits from it, and the norm of the exchange's reduced result (bit-identical
  on every rank, summed in float64 in a fixed order) feeds the next choice, so every rank picks the
  same bits with no extra message.
"""
import threading
from typing import Any, Dict, Hashable, List, Tuple

import numpy as np

from hvd_qsgd.dynamic import Schedule
from hvd_qsgd.settings import Settings, default_bucket_size


class FixedBits:
    """Every exchange with the compressor's settings."""

    observes = False   # whether ``observe`` needs each exchange's reduced result

    def __init__(self, settings: Settings):
        self.settings = settings

    def __repr__(self) -> str:
        return f"FixedBits(bits={self.settings.bits})"

    def settings_for(self, key: Hashable) -> Settings:
        return self.settings

    def observe(self, key: Hashable, reduced: np.ndarray) -> None:
        pass

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass

    def reset(self) -> None:
        pass


class ScheduledBits(FixedBits):
    """DQSGD's bits per exchange (see the module docstring and ``hvd_qsgd.dynamic``).

    schedule_args: the ``Schedule``'s arguments (budget, min_bits, max_bits, discount, total_steps)
    fixed_bucket_size: the bucket size of every bit width, or None for the paper's per bit width
    ``bits_history``: (key, bits) of every exchange, in the order the bits were chosen.
    """

    observes = True
    HISTORY = 100000

    def __init__(self, settings: Settings, schedule_args: Dict[str, Any], fixed_bucket_size: Any = None):
        super().__init__(settings)
        self.schedule_args = dict(schedule_args)
        self.fixed_bucket_size = fixed_bucket_size
        self._lock = threading.Lock()
        self._schedules: Dict[Hashable, Schedule] = {}
        self._of_bits: Dict[int, Settings] = {}
        self.bits_history: List[Tuple[Hashable, int]] = []

    def __repr__(self) -> str:
        return f"ScheduledBits({self.schedule_args})"

    def settings_for(self, key: Hashable) -> Settings:
        with self._lock:
            schedule = self._schedules.get(key)
            if schedule is None:
                schedule = self._schedules[key] = Schedule(**self.schedule_args)
            bits = schedule.next_bits()
            self.bits_history.append((key, bits))
            if len(self.bits_history) > self.HISTORY:
                del self.bits_history[: self.HISTORY // 2]
        return self.settings_of_bits(bits)

    def settings_of_bits(self, bits: int) -> Settings:
        """The settings of an exchange with ``bits`` bits: the bucket size fixed, or the paper's for
        those bits (made and checked once per bit width)."""
        with self._lock:
            settings = self._of_bits.get(bits)
            if settings is None:
                bucket = self.fixed_bucket_size or default_bucket_size(bits)
                settings = self._of_bits[bits] = self.settings.replace(bits=bits, bucket_size=bucket)
        return settings

    def bits_range(self) -> range:
        """The bit widths an exchange may use."""
        return range(self.schedule_args["min_bits"], self.schedule_args["max_bits"] + 1)

    def observe(self, key: Hashable, reduced: np.ndarray) -> None:
        x = np.asarray(reduced).reshape(-1).astype(np.float64)
        norm = float(np.sqrt(np.sum(x * x)))
        with self._lock:
            self._schedules[key].observe(norm)

    def state_dict(self) -> Dict[str, Any]:
        with self._lock:
            return {"schedules": {k: s.state() for k, s in self._schedules.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        with self._lock:
            self._schedules = {}
            for k, v in state.get("schedules", {}).items():
                self._schedules[k] = Schedule(**self.schedule_args)
                self._schedules[k].load(v)

    def reset(self) -> None:
        with self._lock:
            self._schedules = {}
