"""The training loop. It wires components together; the components do the work.

Order of assembly: validate (preflight, layout) -> process group and mesh -> data (this rank's
slice) -> model (built or loaded, identical on every rank) -> output directory -> parallelize
(pipeline split, tensor parallel, recompute, data parallel / ZeRO) -> optimiser -> loop -> final
model directory (gathered to rank 0).
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, cast

import torch
import torch.nn as nn

from fitlm.checkpoint.checkpointer import Checkpointer
from fitlm.checkpoint.errors import TrainingInterrupted
from fitlm.checkpoint.resume import check_resumable, resume_source
from fitlm.checkpoint.store import latest_checkpoint
from fitlm.config import Config, ConfigError
from fitlm.data.dataset import PackedDataset, check_compat
from fitlm.data.loader import SequenceLoader
from fitlm.data.prompts import PromptDataset
from fitlm.data.tokenizer import Tokenizer
from fitlm.finetune.apply import apply_finetune, final_weights
from fitlm.finetune.early_stopping import EarlyStopping
from fitlm.finetune.init_from import resolve_init_from
from fitlm.finetune.initial_weights import initial_weights
from fitlm.hardware import device_peak_flops, mfu_warning, peak_memory_bytes, return_freed_host_memory
from fitlm.host_allocator import apply_host_allocator
from fitlm.memory.precision import compute_dtype
from fitlm.models.flops import flops_per_token
from fitlm.models.io import write_model_dir
from fitlm.models.streaming import stream_to_hf
from fitlm.parallel.apply import parallelize, prepares_for_tensor_parallel
from fitlm.parallel.gather import full_groups, handed_over, weight_specs
from fitlm.parallel.materialize import materialize, tied_aliases
from fitlm.parallel.mesh import env_world_size, init_parallel, shutdown
from fitlm.parallel_dims import WORLD
from fitlm.registry import build_model
from fitlm.rules import tensorboard_installed
from fitlm.step.guards import GuardEvent, stop_error
from fitlm.step.optim import lr_at, scale_for_batch, set_lr
from fitlm.step.train_step import StepOutput, TrainStep
from fitlm.train import preflight
from fitlm.train.balance import InputMonitor
from fitlm.train.consistency import ConsistencyCheck
from fitlm.train.eval_tasks import TaskEvaluator, plain_module
from fitlm.train.grpo import GrpoRun, grpo_objective, grpo_problems
from fitlm.train.heartbeat import Heartbeat
from fitlm.train.host_memory import HostMemory
from fitlm.train.metrics import MetricsLog, report
from fitlm.train.oom import oom_guard
from fitlm.train.progress import TrainProgress
from fitlm.train.run_lock import lock_for_run
from fitlm.train.trace import OOMSnapshot, ProfileWindow
from fitlm.train.trackers import open_trackers, tracker_names


@dataclass
class TrainResult:
    output_dir: Path
    model_dir: Path
    steps: int
    first_loss: float
    last_loss: float
    eval_loss: float | None
    history: list[dict] = field(default_factory=list)
    is_main: bool = True  # False on the ranks of a multi-process run that do not report


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(["train.device: cuda was asked for but no CUDA device is visible; use cpu or auto"])
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def open_data(cfg: Config) -> tuple[PackedDataset | PromptDataset, PackedDataset | None, Tokenizer]:
    """Open train/valid data and the tokenizer, and check they agree with each other and the model (GRPO's
    train data: prompts, fitlm.data.prompts)."""
    grpo = cfg.finetune.objective == "grpo"
    train = PromptDataset(cfg.data.train) if grpo else PackedDataset(cfg.data.train)
    valid = PackedDataset(cfg.data.valid) if cfg.data.valid else None
    tok = Tokenizer.from_file(cfg.data.tokenizer or train.tokenizer_path)
    for name, ds in (("data.train", train), ("data.valid", valid)):
        if ds is None:
            continue
        if ds.tokenizer_sha256 != tok.sha256:
            raise ConfigError(
                [
                    f"{name}: {ds.path} was packed with another tokenizer than {tok.path}; "
                    "re-pack it with this tokenizer or point data.tokenizer at the one it was packed with"
                ]
            )
        check_compat(ds, cfg.model.vocab_size)
    return train, valid, tok


def meta_model(cfg: Config) -> nn.Module:
    """The model as a structure only (meta device: no storage); `parallelize` gives it this rank's weights."""
    with torch.device("meta"):
        return build_model(cfg.model).train()


def materializer(cfg: Config, model: nn.Module, ctx) -> Callable[[list[nn.Module]], None]:
    """What `parallelize` calls on this rank's parts: allocate them and fill them with their slices of the
    run's initial weights (seeded, or read from model.init_from, then LoRA's adapters)."""
    prepare = cfg.model.family.prepare_state_dict if prepares_for_tensor_parallel(cfg) else None
    weights = initial_weights(cfg, model, prepare)
    aliases = tied_aliases(model)
    # FSDP2's CPU offload keeps the shards in host memory: allocate them there.
    device = torch.device("cpu") if cfg.memory.cpu_offload and ctx.dims.fsdp_sharded else ctx.device
    return lambda parts: materialize(parts, weights, device, aliases)


def release_training_state(optimizer: torch.optim.Optimizer) -> None:
    """After the last step (and its checkpoint): gradients, optimizer moments and host master copies are
    no longer needed, so the final save gathers its blocks into the memory they held (a full fine-tune
    holds 12 of its 16 bytes per parameter there)."""
    optimizer.zero_grad(set_to_none=True)
    for opt in {id(o): o for o in (optimizer, getattr(optimizer, "optim", optimizer))}.values():
        opt.state.clear()
        host = getattr(opt, "_host", None)
        if isinstance(host, dict):  # HostAdamW's fp32 masters
            host.clear()
    return_freed_host_memory()


class FinalSaveFailed(ValueError):
    """Told on the other ranks when rank 0 could not write the final model (rank 0 reports the reason)."""


class Trainer:
    def __init__(self, cfg: Config, overwrite: bool = False, console=None):
        # Resolved here too, for callers that pass the user's config; a config a command already resolved
        # (fitlm.run_config) is accepted again unchanged. self.cfg is the resolved one: config.yaml and
        # checkpoints record it. Then what the processes started can run, judged on that model.
        cfg = resolve_init_from(cfg)
        problems = preflight.launch_problems(cfg, env_world_size())
        if problems:
            raise ConfigError(problems)
        self.cfg, t = cfg, cfg.train
        self.ctx = init_parallel(cfg.parallel, resolve_device(t.device).type)
        self.device = self.ctx.device
        self.heartbeat = Heartbeat.for_context(self.ctx, cfg.parallel.timeout_s)  # names a hung rank on a timeout
        self.train_data, self.valid_data, self.tokenizer = open_data(cfg)
        if isinstance(self.train_data, PromptDataset) and (problems := grpo_problems(cfg, self.train_data)):
            raise ConfigError(problems)
        # train.observe.eval_tasks: lm-eval's tasks read and checked now, before anything is written
        self.task_eval = TaskEvaluator(cfg, self.tokenizer) if t.observe.eval_tasks else None
        # Everything that can fail on bad input runs before the output directory is touched.
        self.loader = None if isinstance(self.train_data, PromptDataset) else self._loader(self.train_data, True)
        # Built on meta: no rank holds the whole model; `parallelize` gives each its share (same values on every
        # layout: the single process's seeded or loaded weights).
        model = meta_model(cfg)
        self.flops_per_token = flops_per_token(model, cfg.model, cfg.data.seq_length)
        apply_finetune(model, cfg)  # LoRA adapters / frozen layers on the plain model, before any wrapper
        problem = preflight.output_dir_problem(cfg, overwrite)  # checked on every rank, so all stop together
        source = resume_source(cfg)  # a checkpoint from elsewhere (checkpoint.resume: PATH) is checked now,
        if problem is None and source is not None and latest_checkpoint(t.output_dir) is None:  # before writing
            check_resumable(source, cfg, self.tokenizer.sha256)
        if problem:
            raise ConfigError([problem])
        self.ctx.barrier()  # every rank has looked before rank 0 writes
        self.run_lock = lock_for_run(self.ctx, Path(t.output_dir))  # one run per directory at a time
        if self.ctx.is_main:
            preflight.prepare_output_dir(cfg, overwrite=overwrite)
        self.ctx.barrier()
        self.output_dir = Path(t.output_dir)
        self.pm = parallelize(model, cfg, self.ctx, materialize=materializer(cfg, model, self.ctx))
        return_freed_host_memory()  # the load's transients (source tensors, casts) leave the heap
        # Only now: the load streams each source tensor once, so there is nothing to reuse, and a heap that keeps
        # those blocks fragments (a higher load peak when set before; fitlm/host_allocator.py).
        apply_host_allocator(t.host_allocator, self.device.type, self.ctx.dims.fsdp_sharded)
        self.host_memory = HostMemory(self.ctx)
        self.host_memory.mark("load")  # building, loading and sharding the model is the first phase
        # The step (optimizer, loss scaler, guards, phase timer), built as the planner and profiler build it.
        self.step = TrainStep.create(cfg, self.ctx, self.pm)
        # GRPO: each step's micro batches are completions sampled from the weights being trained
        self.grpo = None
        if isinstance(self.train_data, PromptDataset):
            self.grpo = GrpoRun(cfg, self.ctx, self.pm, self.tokenizer, self.train_data, self.output_dir)
        # The schedule actually followed: train.lr_scaling may rescale lr/min_lr/warmup for the batch.
        self.schedule, batch_note = scale_for_batch(t, self.ctx.dp)
        self.console = console
        if batch_note and self.ctx.is_main:
            print(f"fitlm: note: {batch_note}", file=sys.stderr)
        rows = 2 if cfg.finetune.pairs else 1  # DPO, SimPO: a sample is a pair of sequences
        # (GRPO: the positions a step may fill, completions × seq_length; its throughput counts real tokens)
        self.tokens_per_step = (
            rows * t.micro_batch_size * cfg.data.seq_length * t.gradient_accumulation_steps * self.ctx.dp
        )
        # One peak for every rank: a CPU measures its own at start-up, and ranks sharing cores would
        # otherwise report different MFUs for the same speed.
        peak = device_peak_flops(self.device, compute_dtype(cfg.memory), t.peak_tflops)
        self.peak_flops = float(
            self.ctx.all_reduce_max(torch.tensor(peak, dtype=torch.float64, device=self.device), WORLD)
        )
        self.mfu_warned = False
        # Resumable checkpoints (fitlm.checkpoint): stale temporary saves are removed here; fit resumes and saves.
        self.checkpointer = Checkpointer(cfg, self.ctx, self.output_dir, self.tokenizer.sha256, self.tokenizer.path)
        # Observers (docs/troubleshooting.md): replica checksums, input balance, traces (the guards are the step's).
        self.consistency = ConsistencyCheck(t.observe.consistency_interval, self.ctx, self.pm.modules)
        self.inputs = InputMonitor(
            self.ctx, self.train_data.pad_id, t.observe.balance_threshold, t.observe.data_wait_warn
        )
        self.profile_window = ProfileWindow(t.observe.profile_steps, self.output_dir, self.ctx.rank, self.device)
        self.oom_snapshot = OOMSnapshot(t.observe.oom_snapshot, self.output_dir, self.ctx.rank, self.device)

    def release_lock(self, outcome: str | None = None) -> None:
        if self.run_lock is not None:
            self.run_lock.release(outcome)

    @contextlib.contextmanager
    def guard(self, phase: str):
        """Out of memory inside `phase` becomes a diagnosis naming the phase, this rank and the remedies
        (and, with train.observe.oom_snapshot on CUDA, an allocator snapshot)."""
        with oom_guard(self.cfg, phase, self.ctx.rank, self.device), self.oom_snapshot.on_oom():
            yield

    def _loader(self, data: PackedDataset, shuffle: bool) -> SequenceLoader:
        # Each data-parallel rank reads its own disjoint windows; tensor/pipeline ranks of a replica share them.
        t = self.cfg.train
        return SequenceLoader.from_config(
            data,
            self.cfg.data,
            t.micro_batch_size,
            seed=t.seed,
            rank=self.ctx.dp_rank,
            world_size=self.ctx.dp,
            shuffle=shuffle,
        )

    def step_tokens(self) -> int:
        """Tokens the last step trained on, all ranks: the packed windows' (a fixed count), or under GRPO the
        sampled sequences' own (prompt + completion, no padding), so tokens_per_s and MFU are what was computed."""
        if self.grpo is None:
            return self.tokens_per_step
        return int(grpo_objective(self.step.objective).step_tokens)

    def batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """The packed data's micro batches (none under GRPO: its steps sample theirs, `GrpoRun`)."""
        return iter(self.loader) if self.loader is not None else iter([])

    def train_step(self, step: int, batches: Iterator[dict[str, torch.Tensor]]) -> StepOutput:
        """One optimizer step (1-based `step`): read the micro batches, forward/backward, update."""
        s = self.step
        set_lr(s.optimizer, lr_at(step - 1, self.schedule))
        self.heartbeat.mark("data loading", step)
        if self.grpo is not None:
            self.heartbeat.mark("sampling", step)
            with self.guard("sampling"), s.timer("sampling"):
                micro = self.grpo.micro_batches(step, grpo_objective(s.objective))
        else:
            with self.guard("data loading"), s.timer("data"):
                micro = [next(batches) for _ in range(self.cfg.train.gradient_accumulation_steps)]
        self.inputs.observe_batches(micro)
        self.heartbeat.mark("forward/backward", step)
        with self.guard("forward/backward"):
            loss = s.forward_backward(micro)
        self.heartbeat.mark("optimizer", step)
        with self.guard("the optimizer step"), s.timer("optimizer"):
            grad_norm, skipped = s.optimizer_step(loss, step)
        return StepOutput(loss, grad_norm, skipped, s.timer.pop(), s.guard_event)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if self.valid_data is None:
            return None
        t = self.cfg.train
        loader = self._loader(self.valid_data, shuffle=False)
        # eval_steps counts global batches, so every layout with the same global batch sees the same sequences.
        steps = max(1, min(t.eval_steps * t.gradient_accumulation_steps, loader.batches_per_epoch))
        for m in self.pm.modules:
            m.eval()
        sums = torch.zeros(2, device=self.device)  # [summed loss, targets]
        for _, batch in zip(range(steps), loader):
            sums += self.step.eval_sums(batch)
        self.pm.after_eval()
        for m in self.pm.modules:
            m.train()
        sums = self.ctx.all_reduce_sum(sums, self.ctx.dims.token_dim)  # context parallel: each rank scored part
        return (sums[0] / sums[1].clamp(min=1)).item()

    def evaluate_tasks(self, step: int, log: MetricsLog | None) -> None:
        """train.observe.eval_tasks on rank 0's copy of the weights (fitlm.rules keeps the layouts that have one);
        the scores go to metrics.jsonl (and the trackers) as eval/<task>/<metric>."""
        if log is None or self.task_eval is None:
            return
        scores = self.task_eval.scores(plain_module(self.pm.modules[0]))
        log.write({"step": step, **{k: round(v, 6) for k, v in scores.items()}})

    def fit(self) -> TrainResult:
        """Train to train.max_steps (resuming the latest checkpoint), save the final model; the run lock is
        released however this ends, with how it ended (fitlm.train.run_lock.lock_status reads it)."""
        outcome = "failed"
        try:
            with self.heartbeat.on_timeout():  # a collective timed out: name the rank that stopped responding
                result = self._fit()
            outcome = "finished"
            return result
        except TrainingInterrupted:
            outcome = "stopped"
            raise
        finally:
            if self.task_eval is not None:
                self.task_eval.close()
            self.checkpointer.restore_sigterm()  # an error must not leave this run's handler in the process
            self.release_lock(outcome)

    def _fit(self) -> TrainResult:
        t, main = self.cfg.train, self.ctx.is_main
        start = self.checkpointer.resume(self.pm, self.step.optimizer, self.stateful())  # 0 without a checkpoint
        log = self.open_metrics_log() if main else None
        batches = self.batches()
        history: list[dict] = []
        eval_loss = None
        stopper = EarlyStopping(t.early_stopping_patience)
        step = start
        progress = TrainProgress(t.max_steps, enabled=t.progress and main, console=self.console)
        window_start, window_tokens = time.perf_counter(), 0
        try:
            with progress:
                while step < t.max_steps:
                    step += 1
                    with self.profile_window.step(step):
                        out = self.train_step(step, batches)
                    self.inputs.observe_step(out.seconds)
                    if out.guard is not None and (restored := self.respond(out.guard, log)) is not None:
                        step, window_start, window_tokens = restored, time.perf_counter(), 0  # rolled back
                        continue
                    self.heartbeat.mark("logging", step)
                    self.consistency(step)  # replicas still identical (every consistency_interval steps)
                    window_tokens += self.step_tokens()
                    if step % t.log_interval == 0 or step == t.max_steps or step == 1 or out.skipped:
                        record = self.log_step(step, out, time.perf_counter() - window_start, window_tokens, log)
                        history.append(record)
                        progress.update(step, loss=record["loss"], tokens_per_s=record["tokens_per_s"])
                        window_start, window_tokens = time.perf_counter(), 0
                    else:
                        progress.update(step)
                    if t.eval_interval and (step % t.eval_interval == 0 or step == t.max_steps):
                        self.heartbeat.mark("evaluation", step)
                        with self.guard("evaluation"):
                            eval_loss = self.evaluate()
                        if eval_loss is not None:
                            if log:
                                log.write({"step": step, "eval_loss": round(eval_loss, 6)})
                            progress.update(step, eval_loss=eval_loss)
                            window_start = time.perf_counter()  # evaluation time is not training time
                        if self.task_eval is not None:
                            with self.guard("evaluation"):
                                self.evaluate_tasks(step, log)
                            window_start = time.perf_counter()
                    self.heartbeat.mark("checkpoint save", step)
                    with self.guard("checkpoint save"):
                        self.checkpointer.after_step(step, self.pm, self.step.optimizer, self.stateful())
                    if t.eval_interval and step % t.eval_interval == 0 and stopper.should_stop(eval_loss):
                        if log:  # eval_loss is all-reduced: every rank stops at the same step
                            log.write({"step": step, "early_stop": True, "best_eval_loss": round(stopper.best, 6)})
                        break
        finally:
            self.profile_window.close()
            if log:
                log.close()
        self.heartbeat.mark("final save", step)
        with self.guard("checkpoint save"):
            self.checkpointer.finish()
            release_training_state(self.step.optimizer)
            # The save phase starts here: a peak read from this mark on starts at what is resident now, so the
            # training state must already be let go (a full fine-tune's 12 bytes per parameter; marked before the
            # release, the save's figure was at least that).
            self.host_memory.mark("step")
            model_dir = self.save_final_model()
        self.host_memory.mark("save")
        self.host_memory.write(self.output_dir)
        self.heartbeat.close()
        shutdown(self.ctx)
        first, last = (history[0]["loss"], history[-1]["loss"]) if history else (float("nan"), float("nan"))
        return TrainResult(self.output_dir, model_dir, step, first, last, eval_loss, history, is_main=main)

    def open_metrics_log(self) -> MetricsLog:
        """metrics.jsonl and the run trackers of train.observe (report_to / tensorboard), given the resolved config."""
        o = self.cfg.train.observe
        names = tracker_names(o.report_to, o.tensorboard, tensorboard_installed())
        trackers = open_trackers(names, self.output_dir, self.cfg.model_dump(mode="json"), o)
        return MetricsLog(self.output_dir / "metrics.jsonl", trackers)

    def log_step(self, step: int, out: StepOutput, seconds: float, tokens: int, log: MetricsLog | None) -> dict:
        """Write a log step's metrics record and any input warnings; returns the record (collective: peak memory
        and input stats are reduced over ranks)."""
        tps = tokens / seconds
        peak = self.ctx.all_reduce_max(torch.tensor(peak_memory_bytes(self.device)), WORLD)
        mfu = tps * self.flops_per_token / (self.peak_flops * self.ctx.world_size)
        record = {
            "step": step,
            "loss": round(out.loss.item(), 6),
            "lr": lr_at(step - 1, self.schedule),
            "grad_norm": round(float(out.grad_norm), 6),
            "tokens_per_s": round(tps, 1),
            "mfu": round(mfu, 4),
            "peak_bytes": int(peak),
            "tokens": step * self.tokens_per_step,
        }
        # the objective's metrics beside the loss (DPO, SimPO: the pairs' rewards, margin and accuracy; SFT: none)
        record.update({k: round(v, 6) for k, v in self.step.objective.metrics.items()})
        if self.step.balance is not None:  # MoE: the auxiliary loss and the expert load
            record.update({k: round(v, 6) for k, v in self.step.balance.metrics.items()})
        scaler = self.step.scaler
        if scaler.enabled:
            record.update(loss_scale=scaler.scale, skipped=out.skipped, skipped_steps=scaler.skipped_steps)
        inputs, warnings = self.inputs.summary(step)
        if not self.mfu_warned and (overstated := mfu_warning(mfu, self.device)):
            self.mfu_warned = True  # once per run: the peak does not change
            warnings = [*warnings, {"step": step, "warning": "mfu_above_peak", "message": overstated}]
        record.update(inputs)
        if log:
            log.write(record)
        for warning in warnings:
            report(warning, log)
        return record

    def respond(self, event: GuardEvent, log: MetricsLog | None) -> int | None:
        """Log a guard's verdict and act on it (warn, skip: nothing more); returns the restored step after a rollback.

        A rollback reloads weights, optimizer, RNG and loss scale from the last checkpoint but keeps the data
        position, so the batches of the bad streak are not replayed (as PaLM does after a loss spike)."""
        record, restored = event.record(), None
        if event.action == "rollback":
            restored = self.checkpointer.rollback(self.pm, self.step.optimizer, {"scaler": self.step.scaler})
            if restored is None:
                event.action = record["action"] = "stop"
                event.reason = record["reason"] = (
                    event.reason + "; rollback needs a checkpoint and none was written yet"
                )
            else:
                record["restored_step"] = restored
                self.step.guards.rolled_back()
        report(record, log)
        if event.action == "stop":
            self.checkpointer.finish()  # a pending async save completes: the last checkpoint predates this step
            latest = self.checkpointer.latest()
            raise stop_error(event, str(latest) if latest else None)
        return restored

    def stateful(self) -> dict:
        """Objects besides model and optimizer whose state a checkpoint keeps (state_dict/load_state_dict)."""
        loader = self.grpo.stream if self.grpo is not None else self.loader
        out: dict[str, Any] = {"loader": loader, "scaler": self.step.scaler, "guards": self.step.guards}
        if self.step.balance is not None and self.step.balance.biased:
            out["router"] = self.step.balance  # aux_free: the MoE layers' routing biases
        return out

    def save_final_model(self) -> Path:
        """Write output_dir/model from the trained weights, gathered block by block to rank 0 (collective:
        no rank holds the whole model; fitlm.parallel.gather).

        A failed write (a full disk: fitlm.diskspace.DiskFullError, naming model/ and the bytes needed, after
        the partial directory is removed and a previous model/ is back) is raised on rank 0 once every rank
        knows of it: the others stop with FinalSaveFailed instead of waiting at a barrier for rank 0."""
        specs = weight_specs(self.pm)
        blocks = full_groups(self.pm)
        model_dir = self.output_dir / "model"
        failed: Exception | None = None
        balance = self.step.balance
        if self.ctx.is_main and balance is not None and balance.biased:
            print(f"fitlm: warning: {routing_bias_dropped(self.cfg.model.arch, balance.bias_max())}", file=sys.stderr)
        if self.ctx.is_main:
            try:
                specs, plain = final_weights(specs, blocks, self.cfg, self.output_dir)  # LoRA: merged, adapter/
                # HF's names and layouts, whatever the layout changed (Phi-3's projections, split for sharding,
                # are fused again as the module and HF store them).
                # (handed_over gives back final_weights' groups, all dicts)
                hf_specs, tensors = stream_to_hf(
                    specs, self.cfg.model, cast(Iterator[dict[str, torch.Tensor]], handed_over(plain))
                )
                write_model_dir(
                    hf_specs, tensors, self.cfg, model_dir, tokenizer_path=self.tokenizer.path, what="final model save"
                )
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks are told
                failed = exc
        for _ in blocks:  # the rest of the walk: the other ranks' gathers need this rank to the end
            pass
        # In place of a barrier: every rank learns whether rank 0 succeeded.
        if self.ctx.any_rank(failed is not None) and failed is None:
            raise FinalSaveFailed(
                f"rank 0 could not write the final model to {model_dir} (its message says why); this rank stops too"
            )
        if failed is not None:
            raise failed
        return model_dir


def routing_bias_dropped(arch: str, bias_max: float) -> str:
    """What the final save says of an aux_free model's routing bias (model.moe_balance)."""
    return (
        f"model.moe_balance is aux_free: model/ holds the weights without the routing bias (largest |b_e| "
        f"{bias_max:.4g}), since Hugging Face's {arch} has no place for one; the saved model routes by the unbiased "
        "probabilities, in fitlm as in transformers and llama.cpp, so its outputs differ from the trained model's "
        "wherever the bias changed a top-k choice. The checkpoints keep the bias (resume)"
    )
