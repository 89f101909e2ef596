"""CPU offload (memory.cpu_offload): optimizer states in host memory, the optimizer step on the CPU.

Without ZeRO-2/3 the model stays on the device and `HostAdamW` keeps, per parameter, an fp32 host copy
plus AdamW's two moments in host memory: at each step the gradients are copied to the host, AdamW runs
there, and the updated values are copied back (ZeRO-Offload's split). That takes 12 bytes per
parameter off the device. With ZeRO-2/3, FSDP2's CPUOffloadPolicy also keeps the parameter and
gradient shards on the host (`fsdp_offload_policy`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.adam import adam


def fsdp_offload_policy(enabled: bool, device: torch.device):
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not enabled:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


class HostAdamW(torch.optim.AdamW):
    """AdamW with its states and an fp32 master copy of every parameter in host memory.

    Its state dict is keyed by the model's own parameters, like torch's AdamW, so checkpoints and
    resharding treat it exactly as the plain optimizer; the states just live on the CPU.
    """

    def __init__(self, params, **kwargs):
        super().__init__(params, foreach=True, **kwargs)
        self._host: dict[torch.Tensor, torch.Tensor] = {}  # param -> fp32 host copy
        self._version: dict[torch.Tensor, int] = {}  # param._version right after our last write

    def _host_copy(self, p: torch.Tensor) -> torch.Tensor:
        # Re-read the parameter if anything else wrote it since our last step (a checkpoint load, a tie sync).
        if p not in self._host or self._version.get(p) != p._version:
            pinned = p.device.type == "cuda"
            self._host[p] = p.detach().to("cpu", torch.float32, copy=True)
            if pinned:
                self._host[p] = self._host[p].pin_memory()
        return self._host[p]

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "HostAdamW does not take a closure"
        for group in self.param_groups:
            live = [p for p in group["params"] if p.grad is not None]
            if not live:
                continue
            hosts, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for p in live:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32)
                hosts.append(self._host_copy(p))
                grads.append(p.grad.detach().to("cpu", torch.float32))
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            beta1, beta2 = group["betas"]
            # Fused on the host (one pass, no temporaries): the device AdamW is fused too, same arithmetic.
            adam(
                hosts,
                grads,
                exp_avgs,
                exp_avg_sqs,
                [],
                steps,
                fused=True,
                decoupled_weight_decay=True,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )
            for p, host in zip(live, hosts):
                p.copy_(host, non_blocking=True)
                self._version[p] = p._version
        return None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # torch moves loaded states next to their parameter; ours belong in host memory.
        for state in self.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.device.type != "cpu":
                    state[key] = value.to("cpu")
        self._host.clear()
