"""The process group and the one DeviceMesh every parallel feature takes its sub-groups from.

Mesh dimensions are ("pp", "dp", "tp"), outermost to innermost: tensor-parallel ranks are adjacent
(same node, fastest links), pipeline stages are furthest apart. A single process gets a context
with no process group at all, so the single-device path has no distributed code in it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fitlm.config import ParallelConfig


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class ParallelContext:
    world_size: int = 1
    rank: int = 0
    device: torch.device = torch.device("cpu")
    mesh: DeviceMesh | None = None
    dp: int = 1
    tp: int = 1
    pp: int = 1
    dp_rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def group(self, dim: str) -> dist.ProcessGroup | None:
        return self.mesh.get_group(dim) if self.mesh is not None else None

    def submesh(self, dim: str) -> DeviceMesh | None:
        return self.mesh[dim] if self.mesh is not None else None

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_reduce_sum(self, value: torch.Tensor, dim: str) -> torch.Tensor:
        """Sum over one mesh dimension (a no-op when that dimension has one rank)."""
        if self.mesh is not None and self.mesh[dim].size() > 1:
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.group(dim))
        return value


    def all_reduce_max(self, value: torch.Tensor) -> torch.Tensor:
        """Maximum over all ranks (e.g. the peak memory of the most loaded rank)."""
        if self.distributed:
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return value

    def any_rank(self, flag: bool, group: dist.ProcessGroup | None = None) -> bool:
        """Whether `flag` holds on any rank, the same answer everywhere (collective): how ranks agree on a
        failure or a stop one of them saw, in place of a barrier that the others would wait at forever.
        `group`: a CPU (gloo) side group, e.g. the checkpointer's; None = every rank, on this device."""
        if not self.distributed:
            return flag
        value = torch.tensor([1 if flag else 0], device="cpu" if group is not None else self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return bool(value.item())


def init_parallel(cfg: ParallelConfig, device_kind: str) -> ParallelContext:
    """Join the torchrun job (if any) and build the mesh. `device_kind` is "cpu" or "cuda"."""
    if not launched_by_torchrun() or (env_world_size() == 1 and cfg.world_size == 1):
        return ParallelContext(device=torch.device(device_kind))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_kind == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    # parallel.timeout_s bounds every collective and barrier (gloo raises, nccl's watchdog aborts); the mesh's
    # sub-groups would otherwise get torch's default (30 min for gloo, 10 min for nccl), whatever the world's is.
    timeout = timedelta(seconds=cfg.timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_kind == "cuda" else "gloo", timeout=timeout)
    mesh = init_device_mesh(device_kind, (cfg.pipeline_parallel, cfg.data_parallel, cfg.tensor_parallel),
                            mesh_dim_names=("pp", "dp", "tp"))
    for dim in ("pp", "dp", "tp"):
        mesh.get_group(dim).set_timeout(timeout)
    return ParallelContext(
        world_size=dist.get_world_size(), rank=dist.get_rank(), device=device, mesh=mesh,
        dp=cfg.data_parallel, tp=cfg.tensor_parallel, pp=cfg.pipeline_parallel,
        dp_rank=mesh["dp"].get_local_rank(), tp_rank=mesh["tp"].get_local_rank(),
        pp_rank=mesh["pp"].get_local_rank(),
    )


def shutdown(ctx: ParallelContext) -> None:
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int = 0) -> NoReturn:
    """Leave a process that joined a process group: tear the group down, flush, and skip finalization.

    Why not a normal exit: with torch 2.13, DeviceMesh, FSDP and DTensor keep the gloo group alive past
    `destroy_process_group`, and its C++ threads are then destroyed during interpreter finalization,
    which aborts the finished process ("terminate called without an active exception", SIGABRT) in
    about one 2-rank run in twelve. `os._exit` after flushing keeps the exit status the run earned.
    Everything a run writes is closed before this point (logs, TensorBoard, checkpoints, loader pool).
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe must not turn a finished run into a crash
            pass
    os._exit(code)
