"""Compute and energy accounting: FLOPs from XLA's cost analysis of the compiled programs that ran,
and energy estimates from two stated assumptions. Every number here is an estimate and says so.

XLA's cost analysis counts the operations of the optimised program (for attention over the whole
cache, masked slots included), not hardware counters; energy is FLOPs x an assumed J/FLOP, and
separately wall time x an assumed device power.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class EnergyAssumptions:
    joules_per_flop: float
    device_watts: float

    def describe(self) -> dict[str, Any]:
        return {
            "joules_per_flop": self.joules_per_flop,
            "device_watts": self.device_watts,
            "flops": "XLA cost analysis of each compiled prefill/decode program, times the "
            "number of times it ran (estimate: operation counts, not hardware counters)",
            "energy_from_flops_j": "flops x joules_per_flop (estimate)",
            "energy_from_wall_j": "wall seconds x device_watts (estimate)",
            "prefill_flops_avoided": "tokens not prefilled x FLOPs per token of this run's "
            "prefill program (estimate)",
        }


def program_flops(compiled) -> float:
    """FLOPs XLA's cost analysis reports for one compiled program (0.0 where it reports none)."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # some backends do not implement it
        return 0.0
    if isinstance(analysis, list | tuple):
        analysis = analysis[0] if analysis else {}
    return float((analysis or {}).get("flops", 0.0))


class FlopCounter:
    """Caches per-program FLOPs of an `Engine` and adds up what a run executed."""

    def __init__(self):
        self._cache: dict[int, float] = {}

    def of(self, compiled) -> float:
        key = id(compiled)
        if key not in self._cache:
            self._cache[key] = program_flops(compiled)
        return self._cache[key]

    def prefill(self, eng, schedule) -> float:
        return sum(self.of(eng.prefill_program(c.length)) for c in schedule)

    def decode(self, eng, steps: int) -> float:
        return self.of(eng.decode_program()) * steps if steps else 0.0

    def batch_items(self, eng, run) -> list[float]:
        """Per item of a ragged batch run (`exact.batch.BatchRun`): the FLOPs of every step its
        row took part in, each step's program shared evenly among the rows that worked in it."""
        working = [sum(v > 0 for v in step.valid) for step in run.schedule.steps]
        per_step = [
            self.of(eng.ragged_program(step.length)) / max(n, 1)
            for step, n in zip(run.schedule.steps, working, strict=True)
        ]
        return [sum(per_step[s] for s in item.steps) for item in run.items]

    def per_prefill_token(self, eng, schedule) -> float:
        tokens = sum(c.length for c in schedule)
        return self.prefill(eng, schedule) / tokens if tokens else 0.0
