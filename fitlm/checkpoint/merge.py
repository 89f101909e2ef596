"""`fitlm ckpt merge`: a sharded checkpoint -> one safetensors file, a Hugging Face or a fitlm model directory.

Streaming: the tensors of one transformer block (or of the embeddings/head) are read from the shards
with torch.distributed.checkpoint (which assembles a tensor from however many ranks wrote pieces of
it), converted to Hugging Face names, written at their offset in the output, and dropped before the
next block is read. Names and shapes come from DCP's index and a pass of the name adapter over meta
tensors, so no weights are read to plan the file. Peak memory is about one block (or the embedding).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fitlm import __version__
from fitlm.atomic import atomic_dir, atomic_file
from fitlm.checkpoint import store
from fitlm.checkpoint.errors import CheckpointError
from fitlm.config import Config, ConfigError, validate_dict
from fitlm.models.hf import write_hf_configs
from fitlm.models.safetensors_io import StreamingSafetensorsWriter
from fitlm.models.streaming import grouped, stream_to_hf

FORMATS = ("safetensors", "hf", "fitlm")


def resolve_checkpoint(path: str | Path) -> Path:
    """A step directory, a checkpoints/ directory or a run directory -> the checkpoint to read."""
    p = Path(path)
    if (p / store.META_FILE).is_file() or (p / ".metadata").is_file():
        return p
    for root in (p, p / store.CKPT_DIR):
        found = store.list_checkpoints(root)
        if found:
            return found[-1][1]
    if p.is_dir() and (p / "model").is_dir():
        raise CheckpointError(
            f"{p} is a training run without checkpoints (checkpoint.interval was 0); its final model is {p / 'model'}"
        )
    raise CheckpointError(
        f"{p} is not a checkpoint: expected a checkpoints/step_N directory (holding "
        f"{store.META_FILE}), or a run directory with checkpoints/"
    )


def checkpoint_config(ckpt: Path, meta: dict) -> Config:
    try:
        return validate_dict(meta["config"], f"{ckpt / store.META_FILE}", written_by_fitlm=True)
    except (ConfigError, KeyError) as e:
        raise CheckpointError(
            f"{ckpt / store.META_FILE} holds no valid config ({e}); the checkpoint is damaged"
        ) from None


def stream_hf_tensors(
    ckpt: Path, cfg: Config
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], Iterator[tuple[str, torch.Tensor]]]:
    """(HF name -> (dtype, shape), iterator of (HF name, tensor)) reading one block's tensors at a time."""
    md = store.read_dcp_metadata(ckpt)
    entries = {
        k[len("model.") :]: e
        for k, e in md.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(e, TensorStorageMetadata)
    }
    if not entries:
        raise CheckpointError(f"{ckpt} holds no model tensors; it is not a fitlm training checkpoint")
    reader = store.SafeReader(ckpt)

    def blocks() -> Iterator[dict[str, torch.Tensor]]:
        for keys in grouped(entries).values():
            real = {k: torch.empty(tuple(entries[k].size), dtype=entries[k].properties.dtype) for k in keys}
            with store.quiet_single_process():
                dcp.load({"model": real}, storage_reader=reader, no_dist=True)
            yield real

    specs = {k: (e.properties.dtype, tuple(e.size)) for k, e in entries.items()}
    return stream_to_hf(specs, cfg.model, blocks())


def merge_checkpoint(path: str | Path, out: str | Path, fmt: str = "safetensors") -> dict:
    """Write the checkpoint's model weights to `out`; returns a summary (paths, tensor count, bytes)."""
    if fmt not in FORMATS:
        raise CheckpointError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    ckpt = resolve_checkpoint(path)
    meta = store.read_meta(ckpt)
    cfg = checkpoint_config(ckpt, meta)
    if cfg.finetune.method == "qlora":
        raise CheckpointError(
            f"{ckpt} is a QLoRA checkpoint: it holds the adapters and optimizer only, not the 4-bit base "
            f"(model.init_from: {cfg.model.init_from}, quantized again on resume). For the model at step "
            f"{meta['step']}, resume it and stop there: fitlm train CONFIG --set checkpoint.resume={ckpt} "
            f"--set train.max_steps={meta['step']} --set train.output_dir=NEW_DIR (NEW_DIR/model is merged, "
            f"NEW_DIR/adapter is the PEFT adapter)"
        )
    out = Path(out)
    if fmt == "safetensors" and out.is_dir():
        raise CheckpointError(
            f"--out {out} is a directory; --format safetensors writes one file "
            "(e.g. --out merged.safetensors), --format hf or fitlm write a directory"
        )
    if fmt != "safetensors" and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"--out {out} exists and is not an empty directory; choose a new path")
    specs, tensors = stream_hf_tensors(ckpt, cfg)
    # Published only when complete (fitlm.atomic): an interrupted merge leaves no half-written output.
    if fmt == "safetensors":
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(out) as tmp, StreamingSafetensorsWriter(tmp, specs) as w:
            w.write_all(tensors)
    else:
        with atomic_dir(out, durable=True) as target:
            with StreamingSafetensorsWriter(target / "model.safetensors", specs) as w:
                w.write_all(tensors)
            dtype = str(next(iter(specs.values()))[0]).removeprefix("torch.")
            _write_companions(ckpt, cfg, target, fmt, dtype)
    size = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for d, s in specs.values())
    return {
        "checkpoint": str(ckpt),
        "step": meta["step"],
        "out": str(out),
        "format": fmt,
        "tensors": len(specs),
        "bytes": size,
    }


def _write_companions(ckpt: Path, cfg: Config, target: Path, fmt: str, dtype: str) -> None:
    tok = ckpt / "tokenizer.json"
    if tok.is_file():
        shutil.copyfile(tok, target / "tokenizer.json")
    if fmt == "hf":
        bos = eos = None
        if tok.is_file():
            from fitlm.data.tokenizer import Tokenizer

            t = Tokenizer.from_file(tok)
            bos, eos = t.bos_id, t.eos_id
        write_hf_configs(target, cfg.model, dtype, bos, eos)
    else:  # a fitlm model directory (what training writes to output_dir/model), loadable as MODEL
        from fitlm.models.io import FORMAT_VERSION, MARKER

        (target / "config.yaml").write_text(cfg.to_yaml())
        info = {"format_version": FORMAT_VERSION, "fitlm_version": __version__, "torch_version": torch.__version__}
        (target / MARKER).write_text(json.dumps(info, indent=2) + "\n")
