"""What a training run needs to ride out failures, as small pure pieces the trainer composes.

* :func:`young_daly_steps`: the checkpoint interval that minimises expected lost work,
  τ = √(2·C·MTBF) (Young 1974; Daly 2006's first-order form), with C the measured save stall and MTBF
  the job's (one node's MTBF / nodes), rounded to steps.
* :class:`SpikeGuard`: flags a step whose loss or gradient norm is not finite, or whose loss is above
  mean + k·σ of a trailing window of accepted losses.
* :class:`Faults`: fault injection for tests and chaos drills, read from the environment and inert unless
  set: ``LLMP_FAULT_BAD_BATCH="POS:spike,POS:nan"`` (the global batch that starts at sample position POS
  gets its loss scaled ×1000 or made NaN before backward), ``LLMP_FAULT_EXIT_AT_STEP=N`` (every rank exits
  with code 17 right after step N's checkpoint committed, as a lost node would end the job),
  ``LLMP_FAULT_STEP_DELAY_S`` (sleep per step, to give a test time to kill a rank).
"""
from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Optional


def young_daly_steps(stall_s: float, mtbf_hours: float, nodes: int, step_s: float, max_steps: int) -> int:
    """Young/Daly interval √(2·C·MTBF_job) in steps (at least 1, at most ``max_steps``)."""
    mtbf_job_s = mtbf_hours * 3600.0 / max(1, nodes)
    tau = math.sqrt(2.0 * max(stall_s, 1e-6) * mtbf_job_s)
    return int(min(max_steps, max(1, round(tau / max(step_s, 1e-9)))))


class SpikeGuard:
    def __init__(self, window: int, sigma: float, min_history: int):
        self.hist: deque[float] = deque(maxlen=window)
        self.sigma, self.min_history = sigma, min_history

    def reset(self, losses: list[float]) -> None:
        self.hist.clear()
        self.hist.extend(losses[-self.hist.maxlen:])

    def check(self, loss: float, grad_norm: float) -> Optional[str]:
        """Why this step must not be applied, or None."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return f"non-finite (loss={loss}, grad_norm={grad_norm})"
        if len(self.hist) >= self.min_history:
            n = len(self.hist)
            mean = sum(self.hist) / n
            std = math.sqrt(sum((x - mean) ** 2 for x in self.hist) / n)
            limit = mean + self.sigma * max(std, 1e-3 * abs(mean))
            if loss > limit:
                return f"spike (loss {loss:.4f} > mean {mean:.4f} + {self.sigma:g}·σ {std:.4f} = {limit:.4f})"
        return None

    def accept(self, loss: float) -> None:
        self.hist.append(loss)


@dataclass
class Faults:
    bad_batches: dict[int, str] = field(default_factory=dict)
    exit_at_step: Optional[int] = None
    step_delay_s: float = 0.0

    @classmethod
    def from_env(cls) -> "Faults":
        bad = {}
        for item in filter(None, os.environ.get("LLMP_FAULT_BAD_BATCH", "").split(",")):
            pos, kind = item.split(":")
            bad[int(pos)] = kind
        exit_at = os.environ.get("LLMP_FAULT_EXIT_AT_STEP")
        return cls(bad, int(exit_at) if exit_at else None, float(os.environ.get("LLMP_FAULT_STEP_DELAY_S", "0")))

    def scale_loss(self, position: int, loss):
        kind = self.bad_batches.get(position)
        if kind == "spike":
            return loss * 1000.0
        if kind == "nan":
            return loss * float("nan")
        return loss
