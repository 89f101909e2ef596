"""Periodic, crash-safe, reshardable checkpoints of a training run, and resuming from them.

The trainer calls three methods: `resume` at the start of `fit` (returns the step to continue
after), `after_step` at the end of every optimizer step (saves every `checkpoint.interval` steps and
at the last step, finalises an async save, stops on SIGTERM), and `finish` after the loop.

Every rank writes its own shards with torch.distributed.checkpoint into a temporary directory; the
checkpoint is published (metadata written last, directory renamed) only after every rank's data is
on disk, so the latest visible checkpoint is always complete (fitlm.checkpoint.store).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from fitlm import __version__
from fitlm.checkpoint import faults, state, store
from fitlm.checkpoint.compat import resume_conflicts
from fitlm.checkpoint.errors import CheckpointError, TrainingInterrupted


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def resume_source(cfg) -> Path | None:
    """The checkpoint a run starts from: the output dir's own latest, else `checkpoint.resume` if it is a path."""
    mode = cfg.checkpoint.resume
    if mode == "never":
        return None
    own = store.latest_checkpoint(cfg.train.output_dir)
    if own is not None or mode == "auto":
        return own
    path = Path(mode)
    if (path / store.CKPT_DIR).is_dir():  # a run directory: its latest checkpoint
        latest = store.latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"checkpoint.resume: {path} is a run directory without checkpoints; pass a "
                                  "checkpoint directory (checkpoints/step_N) or set checkpoint.resume: auto")
        return latest
    return path


def trim_metrics(path: Path, step: int) -> None:
    """Drop metrics.jsonl records past `step`: the resumed run logs those steps again."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
    tmp.replace(path)


class _FaultWriter(FileSystemWriter):
    """Only under FITLM_FAULT: die after this rank's shards are written, before the checkpoint completes."""

    def __init__(self, path: Path, step: int, rank: int):
        super().__init__(str(path))
        self._step, self._rank = step, rank

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        fut.wait()
        faults.maybe_die("save", self._step, self._rank)
        return fut


class Checkpointer:
    def __init__(self, cfg, ctx, output_dir: Path, tokenizer_sha256: str, tokenizer_path: Path | None = None):
        self.cfg, self.ctx = cfg, ctx
        self.root = store.checkpoints_root(output_dir)
        self.output_dir = Path(output_dir)
        self.tokenizer_sha256, self.tokenizer_path = tokenizer_sha256, tokenizer_path
        self.interval = cfg.checkpoint.interval
        self.pending: tuple[Any, Path, dict, int] | None = None
        self.last_path: Path | None = None
        self.save_seconds: list[float] = []  # time the loop was blocked per save (bench/checkpoint.py)
        self._stop_requested = False
        self._previous_handler: Any = None
        # CPU (gloo) groups: the stop flag and async saves must not share the training group, nor each other.
        saving = ctx.distributed and self.interval > 0
        self.flag_group = dist.new_group(backend="gloo") if saving else None
        self.save_group = dist.new_group(backend="gloo") if saving and cfg.checkpoint.async_save else None
        if ctx.is_main:
            for p in store.clean_stale(self.root):
                print(f"fitlm: removed {p}, left by a checkpoint save that did not finish", file=sys.stderr)
        ctx.barrier()

    # ------------------------------------------------------------------ resume

    def resume(self, pm, optimizer, stateful: dict[str, Stateful]) -> int:
        """Load the latest checkpoint (if any) into the model, optimizer, RNG and `stateful`; returns its step."""
        ckpt = resume_source(self.cfg)
        if ckpt is None:
            if self.ctx.is_main:
                trim_metrics(self.output_dir / "metrics.jsonl", 0)  # a restart before the first checkpoint
            self.ctx.barrier()
            self._catch_sigterm()
            return 0
        step, meta = self._load(ckpt, pm, optimizer, stateful)
        if self.ctx.is_main:
            trim_metrics(self.output_dir / "metrics.jsonl", step)
            print(f"fitlm: resumed from {ckpt} (step {step}, saved on {meta['layout']['name']})", file=sys.stderr)
        self.ctx.barrier()
        self._catch_sigterm()
        return step

    def latest(self) -> Path | None:
        """The checkpoint a rollback would load: this run's latest, else the one it started from."""
        return store.latest_checkpoint(self.output_dir) or resume_source(self.cfg)

    def rollback(self, pm, optimizer, stateful: dict[str, Stateful]) -> int | None:
        """Reload the latest checkpoint into the model, optimizer, RNG and `stateful` mid-run (train.guards
        rollback); returns its step, or None when there is none. metrics.jsonl is kept: it records the rollback."""
        self._wait_pending()
        ckpt = self.latest()
        if ckpt is None:
            return None
        step, _ = self._load(ckpt, pm, optimizer, stateful)
        if self.ctx.is_main:
            print(f"fitlm: rolled back to {ckpt} (step {step})", file=sys.stderr)
        self.ctx.barrier()
        return step

    def _load(self, ckpt: Path, pm, optimizer, stateful: dict[str, Stateful]) -> tuple[int, dict[str, Any]]:
        meta = self.check(ckpt)
        md = store.read_dcp_metadata(ckpt)
        model_sd = state.model_state(pm.modules)
        state.check_model_keys(model_sd, md, str(ckpt))
        optim_sd, targets = state.optimizer_template(optimizer, pm.modules, md)
        to_load: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        rng_key = f"rank{self.ctx.rank}"
        rng_entries = {k.split(".")[-1]: v for k, v in md.state_dict_metadata.items() if k.startswith(f"rng.{rng_key}.")}
        same_world = meta["layout"]["world_size"] == self.ctx.world_size
        if same_world and rng_entries:
            to_load["rng"] = {rng_key: {n: torch.empty(tuple(e.size), dtype=e.properties.dtype)
                                        for n, e in rng_entries.items()}}
        with store.quiet_single_process():
            dcp.load(to_load, storage_reader=store.SafeReader(ckpt), no_dist=not self.ctx.distributed)
        state.apply_optimizer_state(optimizer, optim_sd, targets)
        if "rng" in to_load:
            state.set_rng_state(to_load["rng"][rng_key])
        extras = _read_extras(ckpt)
        for name, obj in stateful.items():
            if name in extras:
                obj.load_state_dict(state.decode_state(extras[name]))
        return int(meta["step"]), meta

    def _catch_sigterm(self) -> None:
        """From now until `finish`, SIGTERM means: checkpoint at the end of this step, then stop."""
        if self.interval > 0 and _is_main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    def check(self, ckpt: Path) -> dict[str, Any]:
        """Metadata of `ckpt` after refusing what cannot be resumed: damage, another run, another tokenizer."""
        meta = store.read_meta(ckpt)
        conflicts = resume_conflicts(meta.get("config", {}), self.cfg.to_dict())
        if conflicts:
            raise CheckpointError(f"checkpoint {ckpt} belongs to a different run; the config differs in "
                                  f"{'; '.join(conflicts)}. Resume with the config it was saved with "
                                  f"({ckpt / store.META_FILE} holds it), or start a fresh run in another train.output_dir")
        if meta.get("tokenizer_sha256") != self.tokenizer_sha256:
            raise CheckpointError(f"checkpoint {ckpt} was trained with another tokenizer (sha256 "
                                  f"{str(meta.get('tokenizer_sha256'))[:12]}, now {self.tokenizer_sha256[:12]}); token ids "
                                  f"would mean other text. Point data.tokenizer at the one it used (a copy is "
                                  f"{ckpt / 'tokenizer.json'}) or start a fresh run")
        return meta

    # ------------------------------------------------------------------ save

    def after_step(self, step: int, pm, optimizer, stateful: dict[str, Stateful]) -> None:
        if self.interval <= 0:
            return
        faults.maybe_die("step", step, self.ctx.rank)
        self._poll()
        if self._agreed_stop():
            path = self.save(step, pm, optimizer, stateful, wait=True)
            self.finish()
            raise TrainingInterrupted(step, str(path))
        if step % self.interval == 0 or step == self.cfg.train.max_steps:
            self.save(step, pm, optimizer, stateful)

    def save(self, step: int, pm, optimizer, stateful: dict[str, Stateful], wait: bool = False) -> Path:
        """Write checkpoint `step` (collective). Synchronous unless checkpoint.async_save; `wait` forces it."""
        self._wait_pending()
        started = time.perf_counter()
        name = store.step_name(step)
        tmp = self.root / (store.TMP_PREFIX + name)
        if self.ctx.is_main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
            store.write_json(tmp / store.EXTRA_FILE, {k: state.encode_state(v.state_dict()) for k, v in stateful.items()})
            if self.tokenizer_path is not None and Path(self.tokenizer_path).is_file():
                shutil.copyfile(self.tokenizer_path, tmp / "tokenizer.json")
        self.ctx.barrier()  # the directory exists before any rank writes into it
        payload = {"model": state.model_state(pm.modules), "optim": state.optimizer_state(optimizer, pm.modules),
                   "rng": {f"rank{self.ctx.rank}": state.rng_state()}}
        meta = self._meta(step, list(stateful))
        writer = _FaultWriter(tmp, step, self.ctx.rank) if faults_enabled() else FileSystemWriter(str(tmp))
        no_dist = not self.ctx.distributed
        if self.cfg.checkpoint.async_save and not wait:
            future = dcp.async_save(payload, storage_writer=writer, process_group=self.save_group, no_dist=no_dist)
            self.pending = (future, tmp, meta, step)
            self.save_seconds.append(time.perf_counter() - started)
            return tmp
        with store.quiet_single_process():
            dcp.save(payload, storage_writer=writer, no_dist=no_dist)
        path = self._publish(tmp, meta)
        self.save_seconds.append(time.perf_counter() - started)
        return path

    def finish(self) -> None:
        """Complete a pending async save and restore the SIGTERM handler. Call on every rank after the loop."""
        self._wait_pending()
        if self._previous_handler is not None and _is_main_thread():
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    # ------------------------------------------------------------------ internals

    def _meta(self, step: int, extras: list[str]) -> dict[str, Any]:
        p, c = self.cfg.parallel, self.ctx
        return {
            "format": store.FORMAT, "format_version": store.FORMAT_VERSION, "step": step,
            "layout": {"world_size": c.world_size, "data_parallel": c.dp, "tensor_parallel": c.tp,
                       "pipeline_parallel": c.pp, "zero_stage": p.zero_stage,
                       "name": f"dp{c.dp}×tp{c.tp}×pp{c.pp} zero{p.zero_stage}"},
            "tokenizer_sha256": self.tokenizer_sha256, "fitlm_version": __version__,
            "torch_version": torch.__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "extras": extras, "config": self.cfg.to_dict(),
        }

    def _publish(self, tmp: Path, meta: dict[str, Any]) -> Path:
        # dcp.save returns on every rank only after the coordinator gathered every rank's write results.
        final = tmp.parent / tmp.name.removeprefix(store.TMP_PREFIX)
        if self.ctx.is_main:
            final = store.publish(tmp, meta)
            store.prune(self.root, self.cfg.checkpoint.keep_last)
        self.ctx.barrier()
        self.last_path = final
        return final

    def _wait_pending(self) -> None:
        if self.pending is None:
            return
        future, tmp, meta, _ = self.pending
        self.pending = None
        future.result()  # raises what the background save raised
        self._barrier(self.save_group)
        self._publish(tmp, meta)

    def _poll(self) -> None:
        """Publish a finished async save; ranks agree first, since publishing is collective."""
        if self.pending is None:
            return
        done = torch.tensor([1 if self.pending[0].done() else 0])
        if self.flag_group is not None:
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self.flag_group)
        if done.item():
            self._wait_pending()

    def _agreed_stop(self) -> bool:
        flag = torch.tensor([1 if self._stop_requested else 0])
        if self.flag_group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.flag_group)
        return bool(flag.item())

    def _barrier(self, group) -> None:
        if self.ctx.distributed:
            dist.barrier(group=group)

    def _on_sigterm(self, signum, frame) -> None:
        self._stop_requested = True


def faults_enabled() -> bool:
    return bool(os.environ.get("FITLM_FAULT"))


def _is_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _read_extras(ckpt: Path) -> dict[str, Any]:
    path = ckpt / store.EXTRA_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the checkpoint is damaged: delete {ckpt} to resume "
                              "from the previous checkpoint") from None
