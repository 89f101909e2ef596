"""Guards (`train.observe.guards`): a step whose loss or gradient norm is NaN/Inf, or spikes far above its
running statistics, is skipped, stops the run, or rolls it back to the last checkpoint.

The trainer asks `StepGuards.inspect` after the global gradient norm is known and before the
optimizer steps, so a skipped or stopped step never touches the weights or the optimizer state.
Every rank reaches the same verdict: the loss is all-reduced and the gradient norm is global, and
the verdict itself is reduced with a world-wide maximum, as the fp16 overflow check is. Reading the
two scalars costs one device sync per step (the step has ended by then anyway, bar the update).

A spike is a value above the running mean of the last `window` accepted steps by `sigma` standard
deviations (the deviation is floored at 1% of the mean, so a flat curve does not turn every wobble
into a spike), checked once `warmup_steps` steps have been accepted. Skipped steps do not enter
the statistics; warned ones do, so a lasting shift in level stops being reported.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from fitlm.config import GuardsConfig

# Policies by severity: when ranks disagree, the most severe wins.
SEVERITY = ("ok", "warn", "skip", "rollback", "stop")
DOCS = "docs/troubleshooting.md"
SECTIONS = {"nonfinite": "Loss is NaN", "loss_spike": "Loss spikes", "grad_spike": "Loss spikes"}


class TrainingDiverged(ValueError):
    """A guard stopped the run (train.observe.guards policy `stop`, or rollback impossible/exhausted)."""


@dataclass
class GuardEvent:
    step: int
    kind: str  # nonfinite | loss_spike | grad_spike | "" (another rank saw it)
    reason: str
    action: str  # warn | skip | rollback | stop

    @property
    def applies_update(self) -> bool:
        return self.action == "warn"

    def record(self) -> dict[str, Any]:
        """The metrics.jsonl record (no `loss` key: step records are told apart by it)."""
        return {
            "step": self.step,
            "guard": self.kind or "other_rank",
            "reason": self.reason,
            "action": self.action,
            "see": self.see(),
        }

    def see(self) -> str:
        return f'{DOCS}, section "{SECTIONS.get(self.kind, "Loss is NaN")}"'

    def message(self) -> str:
        return f"step {self.step}: {self.reason}; action: {self.action} (see {self.see()})"


class RunningStats:
    """Mean and standard deviation of the last `window` values."""

    def __init__(self, window: int):
        self.values: deque[float] = deque(maxlen=window)

    def threshold(self, sigma: float) -> float:
        n = len(self.values)
        mean = sum(self.values) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in self.values) / max(1, n - 1))
        return mean + sigma * max(std, 0.01 * abs(mean))

    def mean(self) -> float:
        return sum(self.values) / len(self.values)


class StepGuards:
    def __init__(self, cfg: GuardsConfig, reduce_max: Callable[[torch.Tensor], torch.Tensor]):
        self.cfg = cfg
        self.reduce_max = reduce_max
        self.loss = RunningStats(cfg.window)
        self.grad = RunningStats(cfg.window)
        self.accepted = 0  # steps that entered the statistics
        self.streak = 0  # bad steps in a row (skipped ones)
        self.rollbacks = 0

    def classify(self, loss: float, grad_norm: float) -> tuple[str, str]:
        """(kind, reason) of what is wrong with this step on this rank; ("", "") when nothing is."""
        if not math.isfinite(loss):
            return "nonfinite", f"loss is {loss}"
        if not math.isfinite(grad_norm):
            return "nonfinite", f"gradient norm is {grad_norm}"
        # Statistics need at least one accepted step, even with warmup_steps 0.
        if self.cfg.spike == "none" or self.accepted < max(1, self.cfg.warmup_steps):
            return "", ""
        for kind, name, value, stats, sigma in (
            ("loss_spike", "loss", loss, self.loss, self.cfg.loss_spike_sigma),
            ("grad_spike", "gradient norm", grad_norm, self.grad, self.cfg.grad_spike_sigma),
        ):
            if sigma > 0 and value > (limit := stats.threshold(sigma)):
                return kind, (
                    f"{name} spike: {value:.4g} is above {limit:.4g} (running mean {stats.mean():.4g} "
                    f"+ {sigma:g} standard deviations over the last {len(stats.values)} steps)"
                )
        return "", ""

    def inspect(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> GuardEvent | None:
        """The agreed verdict on this step (collective: every rank calls it), or None when it is fine."""
        values = torch.stack([loss.detach().float().reshape(()).cpu(), grad_norm.detach().float().reshape(()).cpu()])
        loss_v, norm_v = values.tolist()  # one device sync per step
        kind, reason = self.classify(loss_v, norm_v)
        policy = "ok" if not kind else self.cfg.nonfinite if kind == "nonfinite" else self.cfg.spike
        agreed = SEVERITY[int(self.reduce_max(torch.tensor([SEVERITY.index(policy)], device=loss.device)).item())]
        if agreed == "ok":
            self._accept(loss_v, norm_v)
            return None
        if policy == "ok":  # this rank saw nothing wrong; another one did (only rank 0 writes the log)
            reason = f"another rank found this step bad (here: loss {loss_v:.4g}, gradient norm {norm_v:.4g})"
        if agreed == "warn":
            self._accept(loss_v, norm_v)
            return GuardEvent(step, kind, reason, "warn")
        self.streak += 1
        action = agreed
        if agreed == "rollback" and self.streak < self.cfg.rollback_after:
            action = "skip"
        if action == "rollback" and self.rollbacks >= self.cfg.max_rollbacks:
            action = "stop"
            reason += f"; {self.rollbacks} rollback(s) already made (train.observe.guards.max_rollbacks)"
        return GuardEvent(step, kind, reason, action)

    def _accept(self, loss: float, grad_norm: float) -> None:
        self.streak = 0
        self.accepted += 1
        self.loss.values.append(loss)
        self.grad.values.append(grad_norm)

    def rolled_back(self) -> None:
        self.rollbacks += 1
        self.streak = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "loss": list(self.loss.values),
            "grad": list(self.grad.values),
            "accepted": self.accepted,
            "rollbacks": self.rollbacks,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss.values.clear()
        self.grad.values.clear()
        self.loss.values.extend(state["loss"])
        self.grad.values.extend(state["grad"])
        self.accepted, self.rollbacks = int(state["accepted"]), int(state["rollbacks"])


def stop_error(event: GuardEvent, checkpoint: str | None) -> TrainingDiverged:
    where = (
        f"the last checkpoint ({checkpoint}) holds the weights from before it; fix the cause and resume"
        if checkpoint
        else "no checkpoint was written yet (checkpoint.interval)"
    )
    return TrainingDiverged(
        f"training stopped by train.observe.guards at {event.message()}. The update of step "
        f"{event.step} was not applied; {where}."
    )
