"""The simulation's world: torch's fake process group playing one rank, and what torch's DDP, pipelining and
DTensor would otherwise need from peers (or from real storage) that a single fake process cannot give.

The fake process group (`torch.testing._internal.distributed.fake_pg`) completes every collective at once
without moving data; shapes stay right, values and received objects do not exist. Each patch below replaces
one such exchange by the answer every real rank of a fitlm run gets, and nothing else, so the simulated step
holds the same tensors as the real one:

- A device mesh works out this rank's coordinates from its rank tensor when it is made, and meshes are made
  inside the step's set-up (a submesh on every slicing, `mesh["tp"]`; FSDP2 joins the dp and tp meshes):
  under the fake mode that tensor was fake and the coordinates came from `.item()` stubs (a pipeline stage's
  tensor-parallel shards came out empty; FSDP2 over tensor parallel could not start). Meshes are made on
  real tensors here, the fake mode set aside while they are.
- DTensor sharding propagation runs each op once on global-shape fake tensors to learn the output's
  metadata, inside the *active* fake mode when there is one. In a real run that is a fresh mode, which
  MemTracker ignores; in the simulation it is the simulation's own, and MemTracker counted those tensors as
  the step's: the loss-parallel backward's full-vocabulary [tokens, V] input and output, which made the simulated
  tp2 step too large (docs/planning.md).
  Propagation gets a fresh fake mode here too.
- A fake tensor's deep copy (`copy.deepcopy`, how a pipeline stage is carved out of the model) lands in
  another fake mode, where every view of it (a weight's transpose in each matmul) gets a storage of its
  own: MemTracker counted each stage weight a second time. Copies stay in the simulation's mode here.
- DDP compares every parameter's shape across ranks and broadcasts rank 0's values at construction, and
  rebuilds its buckets after the first step from an order agreed over ranks: all read real storage. Replicas
  start equal and buckets keep their bytes whatever their order, so these are skipped. The fake group's
  all-reduce has no result for DDP's reducer: `answer_ddp` registers a communication hook that hands each
  bucket back (an in-place all-reduce's result).
- torch's PipelineStage learns its neighbours' activation and gradient metadata at the first step (a vote
  on static vs dynamic inference, then objects sent stage to stage). fitlm's stages are built without example
  inputs, so every real rank votes dynamic; the metadata a stage would receive is what the stage before it
  sends (recorded when the first stage is simulated: every boundary carries the same hidden state, positions
  and document ids) or, for gradients, its own outputs' shapes. The fake group's works are finished when
  made and keep nothing, where a real backend's keep their tensors until waited on and dropped, which the
  interleaved schedule does only at the end of the step (every gradient sent back stays alive till then):
  the schedule's batches of works hold their tensors here.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.parallel.distributed as ddp
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import _sharding_prop
from torch.nn.parallel import DistributedDataParallel

from fitlm.config import Config
from fitlm.parallel.mesh import ParallelContext, context_on_mesh


class SimulationUnsupported(ValueError):
    """This layout cannot be simulated from one process (the analytic engine still answers)."""


def pipeline_ranks(cfg: Config) -> list[int]:
    """Global ranks of the first replica of every pipeline position: (pp, dp, cp, tp) mesh, row-major; dp, cp and
    tp positions of one stage hold the same bytes."""
    d = cfg.parallel.dims
    return [r * d.dp_cp * d.tp for r in range(d.pp)]


@contextlib.contextmanager
def fake_world(cfg: Config, rank: int = 0) -> Iterator[ParallelContext]:
    """A fake process group and the mesh of the layout, playing global `rank`; torn down after."""
    dims = cfg.parallel.dims
    if dims.world_size == 1:
        yield ParallelContext()
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise SimulationUnsupported("a process group already exists in this process; simulate in a fresh one")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
    init = DeviceMesh.__init__

    def init_on_real_tensors(self, *args, **kwargs) -> None:  # see the module docstring
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    try:
        with mock.patch.object(DeviceMesh, "__init__", init_on_real_tensors):
            mesh = init_device_mesh("cpu", dims.mesh_shape, mesh_dim_names=dims.mesh_names)
            yield context_on_mesh(mesh, dims, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def peers_answered(boundary: dict[str, Any], fake_tensors: bool, pipeline: bool) -> Iterator[None]:
    """The patches of the module docstring, for the duration of one simulated rank. `boundary` carries the
    activation metadata the first pipeline stage sent, from its simulation to the later stages'."""
    with contextlib.ExitStack() as stack:
        if fake_tensors:
            stack.enter_context(mock.patch.object(_sharding_prop, "detect_fake_mode", lambda *a, **k: None))
            stack.enter_context(mock.patch.object(FakeTensor, "__deepcopy__", _deepcopy_in_mode))
        stack.enter_context(mock.patch.object(ddp, "_verify_param_shape_across_processes", lambda *a, **k: None))
        stack.enter_context(mock.patch.object(ddp, "_sync_module_states", lambda *a, **k: None))
        stack.enter_context(mock.patch.object(dist.Reducer, "_rebuild_buckets", lambda self: False))
        if pipeline:
            stack.enter_context(_pipeline_peers(boundary))
        yield


def _deepcopy_in_mode(self, memo: dict) -> torch.Tensor:
    """A fake tensor's deep copy in its own fake mode (torch's makes it in another, whose views then look like
    new storages: a pipeline stage, a deep copy of its part of the model, counted every weight twice)."""
    if id(self) not in memo:
        out = self.detach().clone()
        is_param = isinstance(self, torch.nn.Parameter)
        memo[id(self)] = (
            torch.nn.Parameter(out, self.requires_grad) if is_param else out.requires_grad_(self.requires_grad)
        )
    return memo[id(self)]


@contextlib.contextmanager
def _pipeline_peers(boundary: dict[str, Any]) -> Iterator[None]:
    try:  # private parts of torch.distributed.pipelining (torch 2.13): refuse clearly if they moved
        from torch.distributed.pipelining import schedules, stage
        from torch.distributed.pipelining._utils import _derive_grad_metas

        dynamic, backward_meta = stage.InferenceMode.DYNAMIC, stage._StageBackwardMeta
        send_meta, base = stage.PipelineStage._send_meta, schedules._PipelineSchedule
    except (ImportError, AttributeError) as e:
        raise SimulationUnsupported(
            f"this torch's pipelining has no {e.name if hasattr(e, 'name') else e}: "
            "pipeline layouts cannot be simulated; the analytic engine covers them"
        ) from None

    def warmup(self, stages, has_backward, p2p_done) -> None:
        for s in stages:
            s._inference_mode = dynamic

    def send(self, meta, dst_stage: int) -> None:
        if dst_stage > self.stage_index:
            boundary.setdefault("forward", meta)
        send_meta(self, meta, dst_stage)

    def recv(self, src_stage: int):
        if src_stage > self.stage_index:  # the next stage's input gradients: shaped as this stage's outputs
            return backward_meta(backward_metas=_derive_grad_metas(self._stage_meta.outputs))
        if "forward" not in boundary:
            raise SimulationUnsupported("a later pipeline stage was simulated before the first one")
        return boundary["forward"]

    batch_p2p = schedules._batch_p2p

    def held_p2p(p2p_ops, desc=None) -> list:
        return _HeldWorks(batch_p2p(p2p_ops, desc), [op.tensor for op in p2p_ops])

    with (
        mock.patch.object(base, "_warmup_p2p", warmup),
        mock.patch.object(stage.PipelineStage, "_send_meta", send),
        mock.patch.object(stage.PipelineStage, "_recv_meta", recv),
        mock.patch.object(schedules, "_batch_p2p", held_p2p),
    ):
        yield


class _HeldWorks(list):
    """A batch of the fake group's (finished) works that keeps its tensors, as a real backend's works do until
    they are waited on and dropped."""

    def __init__(self, works: list, tensors: list[torch.Tensor]):
        super().__init__(works)
        self.tensors = tensors


def answer_ddp(modules: list[torch.nn.Module]) -> None:
    """Register the bucket-returning communication hook on every DDP module (before its first backward)."""

    def own_bucket(state: None, bucket):
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    own_bucket.__annotations__["return"] = torch.futures.Future[torch.Tensor]  # DDP checks it (not a string)
    for module in modules:
        if isinstance(module, DistributedDataParallel):
            module.register_comm_hook(None, own_bucket)
