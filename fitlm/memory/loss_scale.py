"""Loss scaling for fp16: keep small gradients above fp16's underflow, skip steps that overflow.

The loss is multiplied by `scale` before backward; after backward the gradients are divided by it
and checked for inf/NaN. Every rank must take the same decision (they hold different shards of the
same step), so the overflow flag is reduced over the whole world before anyone steps.

Dynamic scaling halves the scale (backoff_factor) on overflow and doubles it (growth_factor) after
growth_interval clean steps; a static scale never changes, but overflowing steps are still skipped.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from fitlm.config import MemoryConfig
from fitlm.memory.precision import uses_loss_scaling


class LossScaler:
    def __init__(self, cfg: MemoryConfig, device: torch.device):
        s = cfg.loss_scaling
        self.enabled = uses_loss_scaling(cfg)
        self.dynamic = cfg.loss_scale == "dynamic"
        self.scale = float(s.initial_scale if self.dynamic else cfg.loss_scale) if self.enabled else 1.0
        self.growth_factor, self.backoff_factor, self.growth_interval = (
            s.growth_factor,
            s.backoff_factor,
            s.growth_interval,
        )
        self.clean_steps = 0  # consecutive steps without overflow since the scale last changed
        self.skipped_steps = 0
        self.device = device

    def unscale_and_check(self, params: list[torch.Tensor], reduce_max: Callable[[torch.Tensor], torch.Tensor]) -> bool:
        """Divide gradients by the scale in place; True when any rank saw inf/NaN (the step must be skipped).

        `reduce_max` takes the world-wide maximum of a tensor (all ranks take part).
        """
        if not self.enabled:
            return False
        found_inf = torch.zeros(1, device=self.device)
        inv_scale = torch.full((1,), 1.0 / self.scale, device=self.device)
        grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in params:
            if p.grad is None:
                continue
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            grads.setdefault((g.device, g.dtype), []).append(g)
        for group in grads.values():
            # One fused pass per dtype: unscale in place and raise found_inf on any non-finite value.
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)
        return bool(reduce_max(found_inf).item() > 0)

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.skipped_steps += 1
            self.clean_steps = 0
            if self.dynamic:
                self.scale *= self.backoff_factor
            return
        self.clean_steps += 1
        if self.dynamic and self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])
