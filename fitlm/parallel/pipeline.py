"""Pipeline parallel on `torch.distributed.pipelining`: carve stages out of a full model, schedule them.

One schedule run per optimizer step (see `Pipeline.step`): every pp rank feeds the schedule the step's
accumulation micro batches concatenated along the batch dimension, [G·B, T], which it splits into
`micro_batch_num × G` chunks of B / micro_batch_num rows, so the pipeline fills and drains once per step
and its bubble is (p-1)/(m·G+p-1), not (p-1)/(m+p-1) paid G times. The last stage computes
`cross_entropy_sum(chunk) / total_targets`, where `total_targets` counts the targets of the whole step,
and the schedule does not rescale gradients, so the accumulated gradient is exactly the single-process
token-weighted mean's.

Stage ids: rank r holds stage r (gpipe, 1f1b) or stages r and r + pp (interleaved_1f1b, v = 2), which is
the placement torch's schedules assume (stage i lives on pp rank i % pp). Tied embeddings, the global
gradient norm and the state dict gather live in fitlm.parallel.pipeline_state.

The functions are the building blocks; `Pipeline` bundles them the way fitlm.parallel.apply and the
trainer use them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)

from fitlm.models.loss import cross_entropy_sum
from fitlm.parallel.collective_trace import collective
from fitlm.parallel.pipeline_state import (
    as_process_group,
    clip_grad_norm_pp,  # noqa: F401 (re-exported)
    gather_full_state_dict,
    sync_tied_grads,
    tag_tied_copies,
)

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    from fitlm.models.causal_lm import CausalLM

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}
VIRTUAL_STAGES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}
# Forward-only runs (evaluation, one micro batch at a time) go fill-drain: without a backward there is nothing
# for 1F1B or interleaving to overlap, and these take any chunk count, where 1F1B refuses fewer chunks than
# stages -- which one eval micro batch may now have, since the chunk rule counts the whole training step.
EVAL_SCHEDULES = {1: ScheduleGPipe, 2: ScheduleLoopedBFS}  # by stages per rank


# --------------------------------------------------------------------------- splitting


def split_layers(num_layers: int, num_stages: int, layers_per_stage: list[int] | None = None) -> list[range]:
    """Block indices of each stage. Balanced: earlier stages get the extra block when L % S != 0.

    The embedding (first stage) and the head + loss (last stage) are not counted as layers; to move
    work off the last stage (a large vocabulary makes the logits the biggest tensor), pass
    `layers_per_stage` explicitly, e.g. [5, 5, 5, 3]. Every stage must own at least one block.
    """
    if num_stages < 1:
        raise ValueError(f"need at least one pipeline stage, got {num_stages}")
    if layers_per_stage is None:
        if num_layers < num_stages:
            raise ValueError(
                f"{num_stages} pipeline stages need at least {num_stages} layers "
                f"(model.num_layers={num_layers}); lower parallel.pipeline_parallel"
            )
        base, extra = divmod(num_layers, num_stages)
        layers_per_stage = [base + (1 if s < extra else 0) for s in range(num_stages)]
    counts = list(layers_per_stage)
    if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(
            f"layers_per_stage={counts} must list {num_stages} positive counts summing to model.num_layers={num_layers}"
        )
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return [range(a, a + n) for a, n in zip(starts, counts)]


def stage_ids(pp_rank: int, pp_size: int, schedule: str) -> list[int]:
    """The stage ids this pp rank holds: [rank] or [rank, rank + pp, ...] for interleaved schedules."""
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.pipeline_schedule: unknown schedule {schedule!r}; use one of {sorted(SCHEDULES)}")
    return [pp_rank + k * pp_size for k in range(VIRTUAL_STAGES[schedule])]


def build_stage_modules(
    model: nn.Module, pp_rank: int, pp_size: int, schedule: str, layers_per_stage: list[int] | None = None
) -> list[tuple[int, nn.Module]]:
    """This rank's stage modules as (stage_id, module), stage ids ascending.

    Non-destructive: each stage is a deep copy of only the parts it owns (the others are mapped to
    None in the copy memo, so they are never copied); `model` is left intact. A stage's
    `model.layers` keeps only its blocks, under their original keys, so state_dict names stay HF's;
    embed_tokens/embed_positions live on the first stage, norm and lm_head on the last (None elsewhere).
    Apply tensor parallel, recompute, compile and data parallel to the stages afterwards.
    """
    ids = stage_ids(pp_rank, pp_size, schedule)
    num_stages = pp_size * len(ids)
    model = cast("CausalLM", model)  # (a family's model)
    body = model.model
    num_layers = len(body.layers)
    if layers_per_stage is None and num_layers < num_stages:
        raise ValueError(
            f"parallel.pipeline_schedule={schedule} with pipeline_parallel={pp_size} makes {num_stages} "
            f"stages but model.num_layers={num_layers}; every stage needs a block"
        )
    ranges = split_layers(num_layers, num_stages, layers_per_stage)
    out: list[tuple[int, nn.Module]] = []
    for sid in ids:
        memo = {id(m): None for m in _dropped(model, sid, num_stages, ranges[sid])}
        stage = copy.deepcopy(model, memo)
        for i in [i for i, blk in stage.model.layers.items() if blk is None]:
            del stage.model.layers[i]
        out.append((sid, stage))
    tag_tied_copies(out)
    return out


def _dropped(model: nn.Module, sid: int, num_stages: int, blocks: range) -> list[nn.Module]:
    """The modules stage `sid` does not hold: the other stages' blocks, the embeddings unless it is the first,
    the final norm and head unless it is the last."""
    model = cast("CausalLM", model)  # (a family's model)
    body = model.model
    drop: list[nn.Module | None] = [blk for i, blk in body.layers.items() if int(i) not in blocks]
    if sid != 0:
        drop += [body.embed_tokens, getattr(body, "embed_positions", None)]
    if sid != num_stages - 1:
        drop += [body.norm, model.lm_head]
    return [m for m in drop if m is not None]


def check_every_stage_trains(
    model: nn.Module, num_stages: int, layers_per_stage: list[int] | None = None, key: str = "finetune.freeze_layers"
) -> None:
    """Refuse a split in which some stage holds only frozen parameters (finetune: freeze, or LoRA adapters on
    some blocks only): its rank would have nothing to optimise. Checked on the whole model, so every rank
    raises the same error instead of some ranks waiting for the others."""
    model = cast("CausalLM", model)  # (a family's model)
    ranges = split_layers(len(model.model.layers), num_stages, layers_per_stage)
    for sid, blocks in enumerate(ranges):
        dropped = {id(p) for m in _dropped(model, sid, num_stages, blocks) for p in m.parameters()}
        kept: list[torch.Tensor] = [
            p for _, p in model.named_parameters(remove_duplicate=False) if id(p) not in dropped
        ]
        # A tied head is the embedding: the first stage trains the embedding and the last its own copy of it,
        # though the other end's module (dropped) holds the same parameter.
        if sid == 0:
            kept.append(model.model.embed_tokens.weight)
        if sid == num_stages - 1 and getattr(model, "lm_head", None) is not None:
            kept.append(model.lm_head.weight)
        if not any(p.requires_grad for p in kept):
            what = f"blocks {blocks.start}-{blocks.stop - 1}" + (" and the embeddings" if sid == 0 else "")
            raise ValueError(
                f"{key}: pipeline stage {sid} ({what}) would hold only frozen parameters, and a "
                "stage must have something to train; freeze fewer layers or keep the embeddings "
                "trainable (finetune.freeze_embeddings: false), adapt a block of that stage, give "
                "it a trained block with parallel.pipeline_layers, or use data parallel"
            )


# --------------------------------------------------------------------------- schedule


def token_mean_loss(logits: torch.Tensor, labels: torch.Tensor, total_targets: int | torch.Tensor) -> torch.Tensor:
    """One chunk's share of the step's token-weighted mean: summed CE / targets of the whole step."""
    return cross_entropy_sum(logits, labels) / total_targets


@dataclass
class PipelineSchedule:
    """A torch schedule plus what `pipeline_step` needs to feed it and report its loss."""

    schedule: _PipelineSchedule
    stages: list[PipelineStage]
    group: dist.ProcessGroup
    n_microbatches: int
    device: torch.device

    @property
    def has_first(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def has_last(self) -> bool:
        return any(s.is_last for s in self.stages)


def build_schedule(
    stages: list[tuple[int, nn.Module]],
    pp_group,
    n_microbatches: int,
    loss_fn: Callable | None = None,
    schedule_name: str = "1f1b",
    device: torch.device | str = "cpu",
    forward_only: bool = False,
) -> PipelineSchedule:
    """PipelineStage objects for this rank's (stage_id, module) pairs and the named schedule over
    `n_microbatches` chunks per run. `forward_only`: an evaluation schedule (EVAL_SCHEDULES, any count).

    `loss_fn(logits, labels, total_targets)` defaults to `token_mean_loss`; `scale_grads=False`
    because that loss already divides by the whole step's targets (torch's default would divide the
    gradients by n_microbatches once more).
    """
    group = as_process_group(pp_group)
    pp_size = dist.get_world_size(group)
    expected = stage_ids(dist.get_rank(group), pp_size, schedule_name)
    num_stages = pp_size * len(expected)
    problem = None if forward_only else _micro_batch_problem(pp_size, n_microbatches, schedule_name)
    if problem:
        raise ValueError(problem)
    if [sid for sid, _ in stages] != expected:
        got = [sid for sid, _ in stages]
        raise ValueError(
            f"this rank must hold stages {expected} for {schedule_name}, got {got}; "
            "build them with build_stage_modules(..., schedule=the same name)"
        )
    device = torch.device(device)
    pstages = [PipelineStage(mod, sid, num_stages, device, group=group) for sid, mod in stages]
    loss_fn = loss_fn or token_mean_loss
    cls = EVAL_SCHEDULES[len(pstages)] if forward_only else SCHEDULES[schedule_name]
    sched = cls(
        pstages[0] if len(pstages) == 1 else pstages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False
    )
    return PipelineSchedule(sched, pstages, group, n_microbatches, device)


def carry_document_inputs(module: nn.Module, last: bool) -> None:
    """Make a stage take (hidden, position_ids, document_ids) and, unless it is the last stage, hand all
    three on: every stage's attention needs the document ids (block-causal mask) and positions, and
    a stage only receives what the previous stage returns. The integers need no gradient."""
    inner = module.forward
    max_position = cast("CausalLM", module).config.max_seq_len - 1  # (a stage: a family's model)

    def forward(x, position_ids=None, document_ids=None):
        if position_ids is not None and x.is_floating_point():  # a later stage, fed by the previous one
            # torch's pipelining infers shapes by running such a stage once on uninitialised buffers;
            # keep those positions indexable. Real positions are below max_seq_len: a no-op for them.
            position_ids = position_ids.clamp(0, max_position)
        out = inner(x, position_ids=position_ids, document_ids=document_ids)
        return out if last else (out, position_ids, document_ids)

    module.forward = forward


def _stage_args(pp: PipelineSchedule, input_ids: torch.Tensor, doc: dict[str, torch.Tensor]) -> tuple:
    if not pp.has_first:
        return ()
    if not doc:
        return (input_ids.to(pp.device),)
    return (input_ids.to(pp.device), doc["position_ids"].to(pp.device), doc["document_ids"].to(pp.device))


def _check_split(pp: PipelineSchedule, rows: int, what: str) -> None:
    if rows % pp.n_microbatches:
        raise ValueError(
            f"{what} of {rows} sequences cannot be split into {pp.n_microbatches} equal pipeline chunks "
            f"(parallel.micro_batch_num per micro batch); make train.micro_batch_size a multiple of "
            "parallel.micro_batch_num"
        )


def pipeline_step(
    pp: PipelineSchedule,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    total_targets: int | float | torch.Tensor,
    **doc: torch.Tensor,
) -> torch.Tensor:
    """Forward + backward of a batch [N,T] through one schedule run (fill and drain once), in
    `pp.n_microbatches` chunks of N / n_microbatches rows; gradients accumulate into .grad.

    Call it on every pp rank with the same batch. Returns this batch's contribution to the step's
    loss (sum of the chunks' token_mean_loss), all-reduced so every pp rank holds it. Nothing is
    zeroed: several calls before one optimizer step accumulate, like loss.backward() does.
    """
    _check_split(pp, input_ids.shape[0], "a batch")
    args = _stage_args(pp, input_ids, doc)
    target = labels.to(pp.device) if pp.has_last else None
    losses: list[torch.Tensor] | None = [] if pp.has_last else None
    with collective(
        "send/recv",
        "the pipeline schedule's activations and their gradients between stages "
        f"({pp.n_microbatches} chunks of the batch)",
        "pp",
        input_ids,
    ):
        pp.schedule.step(
            *args, target=target, losses=losses, return_outputs=False, loss_kwargs={"total_targets": total_targets}
        )
    loss = torch.stack(losses).detach().sum().float() if losses else torch.zeros((), device=pp.device)
    with collective("all-reduce", "the step's loss", "pp", loss):
        dist.all_reduce(loss, group=pp.group)  # only the last stage has a non-zero loss
    return loss


@torch.no_grad()
def pipeline_eval(
    pp: PipelineSchedule, input_ids: torch.Tensor, labels: torch.Tensor, **doc: torch.Tensor
) -> torch.Tensor:
    """Forward only: the batch's token-summed CE (divide by count_targets yourself), on every pp rank."""
    _check_split(pp, input_ids.shape[0], "an eval batch")
    args = _stage_args(pp, input_ids, doc)
    losses: list[torch.Tensor] | None = [] if pp.has_last else None
    # eval() forwards extra keywords to step(), whose loss_kwargs reach the loss: divide by 1 = keep sums.
    pp.schedule.eval(
        *args, target=labels.to(pp.device) if pp.has_last else None, losses=losses, loss_kwargs={"total_targets": 1}
    )
    loss = torch.stack(losses).sum().float() if losses else torch.zeros((), device=pp.device)
    dist.all_reduce(loss, group=pp.group)
    return loss


# --------------------------------------------------------------------------- trainer-facing bundle


class Pipeline:
    """What `fitlm.parallel.apply` and the trainer hold: split now, schedule once the stage modules
    are wrapped (tensor parallel, recompute, data parallel), then step / eval / clip / gather.

    `ctx` needs: group("pp"), pp, pp_rank, dp_rank, tp_rank, device, is_main (a ParallelContext).
    """

    def __init__(self, model: nn.Module, cfg, ctx):
        p = cfg.parallel
        self.ctx, self.group = ctx, ctx.group("pp")
        self.schedule_name, self.chunks = p.pipeline_schedule, p.micro_batch_num  # chunks per micro batch
        train = getattr(cfg, "train", None)
        self.accumulation = train.gradient_accumulation_steps if train is not None else 1  # micro batches per step
        self.document_mask = bool(getattr(getattr(cfg, "data", None), "document_mask", False))
        method = getattr(getattr(cfg, "finetune", None), "method", "full")
        check_every_stage_trains(
            model,
            ctx.pp * VIRTUAL_STAGES[self.schedule_name],
            p.pipeline_layers,
            "finetune.lora.target_modules" if method in ("lora", "qlora") else "finetune.freeze_layers",
        )
        self.stages = build_stage_modules(model, ctx.pp_rank, ctx.pp, self.schedule_name, p.pipeline_layers)
        self.stage_modules = [m for _, m in self.stages]
        self.schedule: PipelineSchedule | None = None  # the training step's: chunks × accumulation per run
        self._schedules: dict[int, PipelineSchedule] = {}  # training schedules by micro batches per run
        self._eval: PipelineSchedule | None = None

    def build_schedule(self, parts: list[nn.Module]) -> None:
        """`parts`: the wrapped stage modules, in `stage_modules` order."""
        self.stages = [(sid, part) for (sid, _), part in zip(self.stages, parts)]
        tag_tied_copies(self._bare())  # FSDP2 replaced the Parameters
        if self.document_mask:
            last = self.ctx.pp * VIRTUAL_STAGES[self.schedule_name] - 1
            for sid, part in self.stages:
                carry_document_inputs(part, last=sid == last)
        self.schedule = self._training(self.accumulation)  # built (and its chunk count checked) before step 1

    def _training(self, micro_batches: int) -> PipelineSchedule:
        # A torch schedule fixes its chunk count when built. The trainer always runs `accumulation` micro
        # batches per run; another count (a caller stepping micro batch by micro batch) gets its own schedule
        # over the same modules.
        if micro_batches not in self._schedules:
            self._schedules[micro_batches] = build_schedule(
                self.stages, self.group, self.chunks * micro_batches, None, self.schedule_name, self.ctx.device
            )
        return self._schedules[micro_batches]

    def step(
        self, input_ids: torch.Tensor, labels: torch.Tensor, scale: float, micro_batches: int = 1, **doc: torch.Tensor
    ) -> torch.Tensor:
        """Backward of (summed CE × scale) for `micro_batches` accumulation micro batches concatenated along
        the batch dimension, input_ids/labels [micro_batches·B, T], in one schedule run; returns the summed CE
        on every pp rank. `doc`: position_ids and document_ids [micro_batches·B, T] when data.document_mask is on."""
        return pipeline_step(self._training(micro_batches), input_ids, labels, 1.0 / scale, **doc) / scale

    def eval_step(self, input_ids: torch.Tensor, labels: torch.Tensor, **doc: torch.Tensor) -> torch.Tensor:
        """Summed CE of one eval micro batch [B, T], forward only, in micro_batch_num chunks as in training."""
        if self._eval is None:  # its own PipelineStages: the training schedule keeps its buffers and set-up
            self._eval = build_schedule(
                self.stages, self.group, self.chunks, None, self.schedule_name, self.ctx.device, forward_only=True
            )
        return pipeline_eval(self._eval, input_ids, labels, **doc)

    def clip_grad_norm(self, params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Once per optimizer step, after all backward passes: tied-copy sync, then the global clip."""
        sync_tied_grads(self._bare(), self.group)
        return clip_grad_norm_pp(params, max_norm if max_norm > 0 else float("inf"), self.group)

    def _bare(self) -> list[tuple[int, nn.Module]]:
        return [
            (sid, getattr(m, "module", m) if isinstance(m, nn.parallel.DistributedDataParallel) else m)
            for sid, m in self.stages
        ]

    def gather_full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full HF-named state dict on global rank 0 (None elsewhere). Collective: call on all ranks.

        The stages are materialised here, the same way on every rank: dicts from
        get_model_state_dict(full_state_dict=True, cpu_offload=True) are empty on all ranks but global
        rank 0, so every later stage's weights would be lost.
        """
        # Only the pp group of the first dp/tp replica (the one holding global rank 0) needs to gather.
        gather = self.ctx.dp_rank == 0 and self.ctx.tp_rank == 0
        full = gather_full_state_dict(self._bare(), self.group, gather=gather)
        return full if self.ctx.is_main else None


# --------------------------------------------------------------------------- validation


def _micro_batch_problem(pp: int, m: int, sched: str, accumulation: int = 1) -> str | None:
    # Counted over the whole step, n = m chunks per micro batch × accumulation micro batches: one schedule run
    # takes them all. One chunk per pp rank at least (1F1B's warm-up fills every rank); interleaved_1f1b runs
    # rounds of pp chunks through its 2·pp virtual stages, so n may be below 2·pp.
    n = m * accumulation
    count = f"{m}" if accumulation == 1 else f"{m} × train.gradient_accumulation_steps={accumulation} = {n}"
    if n < pp:
        return (
            f"parallel.micro_batch_num: {count} is below parallel.pipeline_parallel={pp}; a step's one schedule "
            "run (micro_batch_num × gradient_accumulation_steps chunks) needs at least one chunk per stage: set "
            f"parallel.micro_batch_num >= {-(-pp // accumulation)} or raise train.gradient_accumulation_steps "
            "(more chunks per step also shrink the pipeline bubble)"
        )
    rounds = max(1, n // pp)
    if sched == "interleaved_1f1b" and n % rounds:
        return (
            f"parallel.micro_batch_num: interleaved_1f1b cuts the {count} chunks of a step into {rounds} equal "
            f"rounds, which {n} does not allow; make the chunks per step a multiple of "
            f"parallel.pipeline_parallel={pp}"
        )
    return None


def pipeline_problems(model_cfg, parallel_cfg, micro_batch_size: int | None = None, accumulation: int = 1) -> list[str]:
    """Layout problems a pipeline run would hit, each naming the key and the fix ([] when fine).
    `accumulation`: train.gradient_accumulation_steps, whose micro batches share the step's one schedule run."""
    pp, m, sched = parallel_cfg.pipeline_parallel, parallel_cfg.micro_batch_num, parallel_cfg.pipeline_schedule
    L = model_cfg.num_layers
    if pp <= 1:
        return []
    errs = []
    if pp > L:
        errs.append(
            f"parallel.pipeline_parallel: {pp} stages but model.num_layers={L}; every stage needs at least "
            f"one block: set parallel.pipeline_parallel <= {L}"
        )
    elif sched == "interleaved_1f1b" and L < 2 * pp:
        errs.append(
            f"parallel.pipeline_schedule: interleaved_1f1b puts 2 virtual stages on each of {pp} ranks, which "
            f"needs model.num_layers >= {2 * pp} (got {L}); use 1f1b or gpipe, or lower "
            "parallel.pipeline_parallel"
        )
    layers = getattr(parallel_cfg, "pipeline_layers", None)
    if layers is not None:
        stages = len(stage_ids(0, pp, sched)) * pp
        try:
            split_layers(L, stages, layers)
        except ValueError as e:
            errs.append(f"parallel.pipeline_layers: {e}")
    problem = _micro_batch_problem(pp, m, sched, accumulation)
    if problem:
        errs.append(problem)
    if micro_batch_size is not None and micro_batch_size % m:
        errs.append(
            f"train.micro_batch_size: {micro_batch_size} sequences cannot be split into "
            f"parallel.micro_batch_num={m} equal pipeline chunks; make train.micro_batch_size a multiple of {m}"
        )
    return errs
