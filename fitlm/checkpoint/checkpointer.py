"""Periodic, crash-safe, reshardable checkpoints of a training run, and resuming from them.

The trainer calls three methods: `resume` at the start of `fit` (returns the step to continue
after), `after_step` at the end of every optimizer step (saves every `checkpoint.interval` steps and
at the last step, finalises an async save, stops on SIGTERM or Ctrl-C: fitlm.checkpoint.signals, under any
interval), and `finish` after the loop.

Every rank writes its own shards with torch.distributed.checkpoint into a temporary directory; the
checkpoint is published (metadata written last, directory renamed) only after every rank's data is
on disk, so the latest visible checkpoint is always complete (fitlm.checkpoint.store).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fitlm import __version__, faults
from fitlm.checkpoint import checksums, state, store
from fitlm.checkpoint.errors import CheckpointError, TrainingInterrupted
from fitlm.checkpoint.resume import check_resumable, resume_source, say_starting_over, trim_metrics
from fitlm.checkpoint.signals import StopSignals, rerun_from
from fitlm.diskspace import DiskFullError, is_disk_full
from fitlm.parallel_dims import layout_name


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


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
        self.pending: tuple[Any, Path, dict, int, int] | None = None  # future, tmp, meta, step, bytes
        self.last_path: Path | None = None
        self.save_seconds: list[float] = []  # time the loop was blocked per save (bench/checkpoint.py)
        ck = cfg.checkpoint
        self.signals = StopSignals(output_dir, ck.save_on_signal, ck.resume, speaks=ctx.is_main)
        # CPU (gloo) groups: the stop flag and async saves must not share the training group, nor each other.
        # The flag is agreed after every step under any interval: a signal may reach one rank only (the UI's Stop).
        wait = timedelta(seconds=cfg.parallel.timeout_s)  # new groups get torch's default (30 min), not the world's
        self.flag_group = dist.new_group(backend="gloo", timeout=wait) if ctx.distributed else None
        saving = ctx.distributed and self.interval > 0
        self.save_group = dist.new_group(backend="gloo", timeout=wait) if saving and ck.async_save else None
        if ctx.is_main:
            for p in store.clean_stale(self.root):
                print(f"fitlm: removed {p}, left by a checkpoint save that did not finish", file=sys.stderr)
        ctx.barrier()

    # ------------------------------------------------------------------ resume

    def resume(self, pm, optimizer, stateful: dict[str, Stateful]) -> int:
        """Load the latest checkpoint (if any) into the model, optimizer, RNG and `stateful`; returns its step."""
        ckpt = self._verified(resume_source(self.cfg))
        if ckpt is None:
            if self.ctx.is_main:
                say_starting_over(self.output_dir)
                trim_metrics(self.output_dir / "metrics.jsonl", 0)  # a restart before the first checkpoint
            self.ctx.barrier()
            self.signals.install()
            return 0
        step, meta = self._load(ckpt, pm, optimizer, stateful)
        if self.ctx.is_main:
            trim_metrics(self.output_dir / "metrics.jsonl", step)
            print(
                f"fitlm: resumed from {ckpt} (step {step}, saved on {meta['layout']['name']}); "
                f"resuming from step {step}, the next step is {step + 1}",
                file=sys.stderr,
            )
        self.ctx.barrier()
        self.signals.install()
        return step

    def latest(self) -> Path | None:
        """The checkpoint a rollback would load: this run's latest, else the one it started from."""
        return store.latest_checkpoint(self.output_dir) or resume_source(self.cfg)

    def rollback(self, pm, optimizer, stateful: dict[str, Stateful]) -> int | None:
        """Reload the latest checkpoint into the model, optimizer, RNG and `stateful` mid-run (train.observe.guards
        rollback); returns its step, or None when there is none. metrics.jsonl is kept: it records the rollback."""
        self._wait_pending()
        ckpt = self._verified(self.latest())
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
        rng_entries = {  # (the RNG states are tensors)
            k.split(".")[-1]: cast(TensorStorageMetadata, v)
            for k, v in md.state_dict_metadata.items()
            if k.startswith(f"rng.{rng_key}.")
        }
        same_world = meta["layout"]["world_size"] == self.ctx.world_size
        if same_world and rng_entries:
            to_load["rng"] = {
                rng_key: {n: torch.empty(tuple(e.size), dtype=e.properties.dtype) for n, e in rng_entries.items()}
            }
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

    def _verified(self, ckpt: Path | None) -> Path | None:
        """`ckpt` if it is intact; for this run's own checkpoints, else the newest older one that is, saying so.

        Intact: complete (metadata, every file at its recorded size) and, with checkpoint.verify, every file's
        CRC-32 equal to the one recorded at save. A damaged checkpoint is left on disk for the user to inspect."""
        if ckpt is None:
            return None
        own = [p for _, p in store.list_checkpoints(self.root)]
        candidates = own[::-1] if ckpt in own else [ckpt]
        problems: list[str] = []
        for candidate in candidates:
            problem = self._damage(candidate)
            if problem is None:
                if problems and self.ctx.is_main:
                    print(
                        f"fitlm: resuming from {candidate} instead (the previous complete checkpoint)", file=sys.stderr
                    )
                return candidate
            problems.append(problem)
            if self.ctx.is_main:
                print(f"fitlm: warning: checkpoint {candidate} is damaged: {problem}", file=sys.stderr)
        raise CheckpointError(
            f"no intact checkpoint to resume from: {'; '.join(problems)}. Restore the files, or "
            "delete the damaged checkpoints (or pass --overwrite) to start again"
        )

    def _damage(self, ckpt: Path) -> str | None:
        """Why `ckpt` cannot be resumed from, or None; the same answer on every rank (the CRC work is split)."""
        try:
            meta = store.read_meta(ckpt)
        except CheckpointError as exc:
            return str(exc)
        sums = meta.get("checksums") if self.cfg.checkpoint.verify else None
        found = checksums.damaged(ckpt, sums, sorted(sums)[self.ctx.rank :: self.ctx.world_size]) if sums else []
        if self.ctx.distributed:
            every: list[list[str]] = [[] for _ in range(self.ctx.world_size)]
            dist.all_gather_object(every, found)
            found = [p for part in every for p in part]
        return "; ".join(found) or None

    def check(self, ckpt: Path) -> dict[str, Any]:
        """Metadata of `ckpt` after refusing what cannot be resumed: damage, another run, another tokenizer."""
        return check_resumable(ckpt, self.cfg, self.tokenizer_sha256)

    # ------------------------------------------------------------------ save

    def after_step(self, step: int, pm, optimizer, stateful: dict[str, Stateful]) -> None:
        if self.interval > 0:
            faults.maybe_die("step", step, self.ctx.rank)
            self._poll()
        if self._agreed_stop():
            raise self._stop(step, pm, optimizer, stateful)
        if self.interval <= 0:
            return
        if step % self.interval == 0 or step == self.cfg.train.max_steps:
            try:
                self.save(step, pm, optimizer, stateful)
            except DiskFullError as exc:
                if self.cfg.checkpoint.on_save_error == "stop":
                    raise
                if self.ctx.is_main:  # checkpoint.on_save_error: continue
                    print(
                        f"fitlm: warning: checkpoint of step {step} not saved: {exc}; training goes on "
                        f"(checkpoint.on_save_error: continue), the next save is at step {step + self.interval}",
                        file=sys.stderr,
                    )

    def _stop(self, step: int, pm, optimizer, stateful: dict[str, Stateful]) -> TrainingInterrupted:
        """A signal asked for a stop: the final checkpoint (unless checkpoint.save_on_signal is false), then the
        exception that ends the run (the CLI prints it on rank 0 and exits 128 + the signal)."""
        signum = self.signals.stop_signal  # the one this rank got, else SIGTERM (the UI's Stop signals rank 0 only)
        if not self.cfg.checkpoint.save_on_signal:
            self.finish()  # an interval's async save in flight completes: it is a good checkpoint
            return TrainingInterrupted(step, None, signum, rerun_from(self.output_dir, self.cfg.checkpoint.resume))
        path = self.save(step, pm, optimizer, stateful, wait=True)
        self.finish()
        refused = self.cfg.checkpoint.resume == "never"  # a rerun would refuse the directory: say what to set
        return TrainingInterrupted(step, str(path), signum, rerun_from(self.output_dir, "never") if refused else "")

    def save(self, step: int, pm, optimizer, stateful: dict[str, Stateful], wait: bool = False) -> Path:
        """Write checkpoint `step` (collective). Synchronous unless checkpoint.async_save; `wait` forces it.

        A full disk on any rank (fitlm.diskspace) removes the partial checkpoint and raises DiskFullError on
        every rank; the previous checkpoint stays the latest."""
        self._wait_pending()
        started = time.perf_counter()
        name = store.step_name(step)
        tmp = self.root / (store.TMP_PREFIX + name)
        payload = {
            "model": state.model_state(pm.modules),
            "optim": state.optimizer_state(optimizer, pm.modules),
            "rng": {f"rank{self.ctx.rank}": state.rng_state()},
        }
        failure: BaseException | None = None
        if self.ctx.is_main:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
                store.write_json(
                    tmp / store.EXTRA_FILE, {k: state.encode_state(v.state_dict()) for k, v in stateful.items()}
                )
                if self.tokenizer_path is not None and Path(self.tokenizer_path).is_file():
                    shutil.copyfile(self.tokenizer_path, tmp / "tokenizer.json")
            except OSError as exc:
                failure = exc
        self._agree_or_fail(
            failure, tmp, _payload_bytes(payload)
        )  # the directory exists before any rank writes into it
        meta = self._meta(step, list(stateful))
        writer = _FaultWriter(tmp, step, self.ctx.rank) if faults.enabled() else FileSystemWriter(str(tmp))
        no_dist = not self.ctx.distributed
        if self.cfg.checkpoint.async_save and not wait:
            future = dcp.async_save(payload, storage_writer=writer, process_group=self.save_group, no_dist=no_dist)
            self.pending = (future, tmp, meta, step, _payload_bytes(payload))
            self.save_seconds.append(time.perf_counter() - started)
            return tmp
        try:
            with store.quiet_single_process():
                dcp.save(payload, storage_writer=writer, no_dist=no_dist)
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            self._agree_or_fail(_disk_full_cause(exc) or exc, tmp, _payload_bytes(payload), collective=False)
        path = self._publish(tmp, meta)
        self.save_seconds.append(time.perf_counter() - started)
        return path

    def _agree_or_fail(self, failure: BaseException | None, tmp: Path, nbytes: int, collective: bool = True) -> None:
        """Continue only if no rank failed; otherwise remove the partial checkpoint and raise on every rank.

        `collective=False`: the failure is already known to every rank (DCP gathers every rank's write result)."""
        failed = self.ctx.any_rank(failure is not None, self.flag_group) if collective else failure is not None
        if not failed:
            return
        self._barrier(None)
        if self.ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        self._barrier(None)
        full = _disk_full_cause(failure) if failure is not None else None
        if full is not None or failure is None:  # failure None: another rank's disk filled; it says which
            raise DiskFullError(
                self.root,
                nbytes * self.ctx.world_size,
                f"checkpoint save ({tmp.name.removeprefix(store.TMP_PREFIX)})",
                full,
            )
        raise failure

    def finish(self) -> None:
        """Complete a pending async save. Call on every rank after the loop. The signal handlers stay until
        `restore_sigterm`: a signal during the final model save lets it finish (a second one stops at once)."""
        self._wait_pending()
        self.signals.final_save = True

    def restore_sigterm(self) -> None:
        """Put back the SIGTERM / SIGINT handlers from before `resume` (also when training ended with an error)."""
        self.signals.restore()

    # ------------------------------------------------------------------ internals

    def _meta(self, step: int, extras: list[str]) -> dict[str, Any]:
        p, c = self.cfg.parallel, self.ctx
        return {
            "format": store.FORMAT,
            "format_version": store.FORMAT_VERSION,
            "step": step,
            "layout": {
                "world_size": c.world_size,
                "data_parallel": c.dp,
                "tensor_parallel": c.tp,
                "pipeline_parallel": c.pp,
                "context_parallel": c.cp,
                "zero_stage": p.zero_stage,
                "name": f"{layout_name(c.dp, c.tp, c.pp, c.cp)} zero{p.zero_stage}",
            },
            "tokenizer_sha256": self.tokenizer_sha256,
            "fitlm_version": __version__,
            "torch_version": torch.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "extras": extras,
            "config": self.cfg.to_dict(),
        }

    def _publish(self, tmp: Path, meta: dict[str, Any]) -> Path:
        # dcp.save returns on every rank only after the coordinator gathered every rank's write results.
        final = tmp.parent / tmp.name.removeprefix(store.TMP_PREFIX)
        sums = checksums.checksums(checksums.written_by(tmp, self.ctx.rank, skip=(store.META_FILE,)))
        if self.ctx.distributed:  # each rank hashed what it wrote; rank 0 records them all
            every: list[dict[str, str]] = [{} for _ in range(self.ctx.world_size)]
            dist.all_gather_object(every, sums)
            sums = {k: v for part in every for k, v in part.items()}
        if self.ctx.is_main:
            final = store.publish(tmp, dict(meta, checksums=sums))
            store.prune(self.root, self.cfg.checkpoint.keep_last)
        self.ctx.barrier()
        self.last_path = final
        return final

    def _wait_pending(self) -> None:
        if self.pending is None:
            return
        future, tmp, meta, _, nbytes = self.pending
        self.pending = None
        failure: BaseException | None = None
        try:
            future.result()  # raises what the background save raised
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            failure = _disk_full_cause(exc) or exc
        self._agree_or_fail(failure, tmp, nbytes)
        self._barrier(self.save_group)
        self._publish(tmp, meta)

    def _poll(self) -> None:
        """Publish a finished async save; ranks agree first, since publishing is collective."""
        if self.pending is None:
            return
        if not self.ctx.any_rank(not self.pending[0].done(), self.flag_group):  # done on every rank
            self._wait_pending()

    def _agreed_stop(self) -> bool:
        return self.ctx.any_rank(self.signals.signum is not None, self.flag_group)

    def _barrier(self, group) -> None:
        if self.ctx.distributed:
            dist.barrier(group=group)


def _disk_full_cause(exc: BaseException) -> OSError | None:
    """The ENOSPC/EDQUOT behind `exc`, also inside DCP's CheckpointException (one entry per failed rank)."""
    if is_disk_full(exc):
        return exc  # type: ignore[return-value]
    for failure in getattr(exc, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if is_disk_full(inner):
            return inner
    cause = exc.__cause__ or exc.__context__
    return _disk_full_cause(cause) if cause is not None else None


def _payload_bytes(payload: Any) -> int:
    """Bytes of the tensors in a (nested) state dict: what this rank writes (DTensors: their local shard)."""
    if isinstance(payload, dict):
        return sum(_payload_bytes(v) for v in payload.values())
    if isinstance(payload, (list, tuple)):
        return sum(_payload_bytes(v) for v in payload)
    if isinstance(payload, torch.Tensor):
        t = payload.to_local() if hasattr(payload, "to_local") else payload
        return t.numel() * t.element_size()
    return 0


def _read_extras(ckpt: Path) -> dict[str, Any]:
    path = ckpt / store.EXTRA_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise CheckpointError(
            f"{path} is not valid JSON ({e}); the checkpoint is damaged: delete {ckpt} to resume "
            "from the previous checkpoint"
        ) from None
