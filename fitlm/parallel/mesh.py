"""The process group and the one DeviceMesh every parallel feature takes its sub-groups from.

Mesh dimensions are fitlm.parallel_dims.MESH_DIMS ("pp", "dp", "cp", "tp"), outermost to innermost, plus the
flattened "dp_cp" under context parallel (`dims.token_dim`: who sums losses and averages gradients), and "edp" and
"ep" under expert parallel, whose flattening is "dp" (fitlm.parallel_dims.EXPERT_DIMS), with "edp_cp" under both
(`dims.expert_replica_dim`). A single
process gets a context with no process group at all, so the single-device path has no distributed code in
it. Every predicate about the layout (sharded, replicated, pipelined) is asked of `ctx.dims`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fitlm.config import ParallelConfig
from fitlm.parallel_dims import DP_CP, EDP_CP, EXPERT_DIMS, MESH_DIMS, WORLD, ParallelDims


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
    dims: ParallelDims = ParallelDims()
    dp_rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    cp_rank: int = 0
    # Whether init_parallel created the default process group: only then does shutdown tear it down. A group
    # the caller made (a script that trains several configs in one job) outlives each run.
    owns_group: bool = False

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def cp(self) -> int:
        return self.dims.cp

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def ep(self) -> int:
        return self.dims.ep

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def group(self, dim: str) -> dist.ProcessGroup | None:
        return self.mesh.get_group(self._dim(dim)) if self.mesh is not None else None

    def submesh(self, dim: str) -> DeviceMesh | None:
        return self.mesh[self._dim(dim)] if self.mesh is not None else None

    def _dim(self, dim: str) -> str:
        # "dp_cp" is made only under context parallel; without it, it names the same ranks as "dp"
        return "dp" if dim == DP_CP and self.cp == 1 else dim

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_reduce_sum(self, value: torch.Tensor, dim: str) -> torch.Tensor:
        """Sum over one mesh dimension (or "dp_cp", see dims.token_dim), or over every rank with dim="world"
        (in place; returns `value`)."""
        return self._all_reduce(value, dim, dist.ReduceOp.SUM)

    def all_reduce_max(self, value: torch.Tensor, dim: str) -> torch.Tensor:
        """Maximum over one mesh dimension, or over every rank with dim="world" (e.g. the peak memory of the
        most loaded rank, or a verdict every rank must share)."""
        return self._all_reduce(value, dim, dist.ReduceOp.MAX)

    def _all_reduce(self, value: torch.Tensor, dim: str, op) -> torch.Tensor:
        if dim != WORLD and dim not in MESH_DIMS + (DP_CP, EDP_CP) + EXPERT_DIMS:
            raise ValueError(
                f"unknown reduction dimension {dim!r}: one of {MESH_DIMS + EXPERT_DIMS}, {DP_CP!r} or {WORLD!r}"
            )
        if self.mesh is None:
            return value
        dim = self._dim(dim)
        if dim == WORLD:
            dist.all_reduce(value, op=op)
        elif self.mesh[dim].size() > 1:  # a one-rank dimension has nothing to reduce
            dist.all_reduce(value, op=op, group=self.group(dim))
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
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend="nccl" if device_kind == "cuda" else "gloo", timeout=timeout)
    mesh = init_device_mesh(device_kind, cfg.dims.mesh_shape, mesh_dim_names=cfg.dims.mesh_names)
    ctx = replace(context_on_mesh(mesh, cfg.dims, device), owns_group=owns_group)
    extra = ((DP_CP,) if cfg.dims.cp > 1 else ()) + (EXPERT_DIMS if cfg.dims.ep > 1 else ())
    extra += (EDP_CP,) if cfg.dims.cp > 1 and cfg.dims.ep > 1 else ()
    for dim in MESH_DIMS + extra:
        mesh.get_group(dim).set_timeout(timeout)
    return ctx


def context_on_mesh(mesh: DeviceMesh, dims: ParallelDims, device: torch.device) -> ParallelContext:
    """This process's place in a built mesh (a real job's, or the planner's fake world as rank 0). Under context
    parallel it also flattens dp x cp into "dp_cp", under expert parallel edp x ep into "dp", under both edp x cp into
    "edp_cp" (collective: every rank builds them)."""
    if dims.ep > 1:
        mesh[EXPERT_DIMS]._flatten("dp")
        if dims.cp > 1:
            mesh["edp", "cp"]._flatten(EDP_CP)
    if dims.cp > 1:
        mesh["dp", "cp"]._flatten(DP_CP)
    return ParallelContext(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        device=device,
        mesh=mesh,
        dims=dims,
        dp_rank=mesh["dp"].get_local_rank(),
        tp_rank=mesh["tp"].get_local_rank(),
        pp_rank=mesh["pp"].get_local_rank(),
        cp_rank=mesh["cp"].get_local_rank(),
    )


def shutdown(ctx: ParallelContext) -> None:
    if ctx.owns_group and dist.is_initialized():
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
