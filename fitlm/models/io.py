"""The fitlm model directory: what `fitlm train` leaves in `model/` and every MODEL argument accepts.

Layout:

    config.yaml        the full resolved fitlm Config (load with fitlm.config.load_config)
    model.safetensors  weights under Hugging Face names (tied head stored once); large models are
                       sharded as model-0000i-of-0000n.safetensors + model.safetensors.index.json
    tokenizer.json     optional, with its companions (tokenizer_config.json, chat_template.jinja, ...)
    fitlm.json         {"format_version": 1, "fitlm_version": ..., "torch_version": ...}; written last,
                       so its presence marks a complete directory

Directories are written to a hidden sibling and renamed into place, so a crash never leaves a
half-written model directory under the requested name; a full disk removes the sibling, keeps the
previous directory and says how much space the save needs (fitlm.diskspace.DiskFullError).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
import torch.nn as nn

from fitlm import __version__, faults
from fitlm.atomic import atomic_dir
from fitlm.config import Config, DataConfig, ModelConfig, load_config, validate_dict
from fitlm.diskspace import disk_full_guard
from fitlm.models.hf import (
    DEFAULT_MAX_SHARD_BYTES,
    HFFormatError,
    model_from_hf_state_dict,
    read_hf_config,
    read_safetensors_dir,
    to_hf_state_dict,
)
from fitlm.models.safetensors_io import spec_bytes, write_safetensors_stream
from fitlm.models.streaming import stream_from_hf

FORMAT_VERSION = 1
MARKER = "fitlm.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


class ModelDirError(ValueError):
    """A path that is not a loadable model, or a directory that must not be overwritten."""


@dataclass
class LoadedModel:
    model: nn.Module  # in eval mode
    config: Config
    tokenizer_path: Path | None  # tokenizer.json beside the weights, if any
    source: str  # "fitlm" or "hf": which kind of directory it came from
    path: Path  # the directory the weights were read from


def default_config(model_cfg: ModelConfig) -> Config:
    """A default Config around a bare ModelConfig, kept valid (data.seq_length <= max_seq_len)."""
    return Config(model=model_cfg, data=DataConfig(seq_length=min(DataConfig().seq_length, model_cfg.max_seq_len)))


def is_fitlm_model_dir(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def _has_hf_weights(path: Path) -> bool:
    return (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()


def resolve_model_path(path: str | Path) -> tuple[str, Path]:
    """Classify a MODEL argument: ("fitlm", dir), ("hf", dir) or ("gguf", file). Raises ModelDirError."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelDirError(
            f"{p} does not exist; pass a fitlm model directory, a training output directory, "
            f"a Hugging Face directory or a GGUF file"
        )
    if p.is_file():
        if p.suffix == ".gguf":
            return "gguf", p
        if p.name in (MARKER, "config.yaml", "config.json", "model.safetensors"):
            p = p.parent  # a file inside a model directory stands for the directory
        else:
            raise ModelDirError(f"{p} is a file but not a GGUF model; pass the directory that holds the model")
    if is_fitlm_model_dir(p):
        return "fitlm", p
    if is_fitlm_model_dir(p / "model"):
        return "fitlm", p / "model"  # a training output directory
    if (p / "config.json").is_file():
        if _has_hf_weights(p):
            return "hf", p
        read_safetensors_dir(p)  # raises the precise error (pickles refused, or no weights)
    if (p / "checkpoints").is_dir():
        raise ModelDirError(
            f"{p} is a training output without model/ (the run did not finish); turn a checkpoint "
            f"into a model directory with `fitlm ckpt merge`, then pass that"
        )
    raise ModelDirError(
        f"{p} is not a model. Looked for {p / MARKER} (fitlm model directory), {p / 'model' / MARKER} "
        f"(training output), and {p / 'config.json'} with model.safetensors (Hugging Face directory)"
    )


def _check_writable_target(out_dir: Path) -> None:
    if out_dir.is_file():
        raise ModelDirError(f"{out_dir} is a file; pass a directory path for the model")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not is_fitlm_model_dir(out_dir):
        raise ModelDirError(
            f"{out_dir} exists, is not empty and is not a fitlm model directory; refusing to "
            f"replace it. Choose another --out path or empty it yourself"
        )


def _tokenizer_files(tokenizer_path: str | Path) -> dict[str, Path]:
    """Destination name -> source file for a tokenizer.json (plus companions beside it) or a directory."""
    src = Path(tokenizer_path)
    if src.is_file():
        files = {"tokenizer.json": src}
        files.update({n: src.parent / n for n in TOKENIZER_FILES[1:] if (src.parent / n).is_file()})
        return files
    if src.is_dir():
        files = {n: src / n for n in TOKENIZER_FILES if (src / n).is_file()}
        if files:
            return files
    raise ModelDirError(f"tokenizer {src} not found: pass a tokenizer.json file or a directory containing one")


def save_model_dir(
    model: nn.Module,
    cfg: Config | ModelConfig,
    out_dir: str | Path,
    tokenizer_path: str | Path | None = None,
    what: str = "model save",
) -> Path:
    """Write a fitlm model directory atomically; an existing fitlm model directory is replaced.

    A full disk raises fitlm.diskspace.DiskFullError (its text starts with `what`), after the partial
    directory is removed; a previous directory at `out_dir` is left as it was."""
    sd = to_hf_state_dict(model, cfg.model if isinstance(cfg, Config) else cfg)
    specs = {k: (v.dtype, tuple(v.shape)) for k, v in sd.items()}
    return write_model_dir(specs, sd.items(), cfg, out_dir, tokenizer_path, what)


def write_model_dir(
    specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    tensors: Iterable[tuple[str, torch.Tensor]],
    cfg: Config | ModelConfig,
    out_dir: str | Path,
    tokenizer_path: str | Path | None = None,
    what: str = "model save",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """`save_model_dir` from HF-named tensors that arrive one at a time (`specs`: each one's dtype and shape),
    so no process needs the whole model in memory (the final save of a sharded run streams block by block)."""
    if isinstance(cfg, ModelConfig):
        cfg = default_config(cfg)
    # Refuse now what load_config would refuse later: never write a directory that cannot be loaded.
    validate_dict(cfg.to_dict(), "the config passed to save_model_dir")
    out_dir = Path(out_dir).expanduser().absolute()
    _check_writable_target(out_dir)
    tok = _tokenizer_files(tokenizer_path) if tokenizer_path is not None else {}
    needed = sum(spec_bytes(s) for s in specs.values()) + sum(src.stat().st_size for src in tok.values()) + 64 * 1024
    # The guard outside the atomic block: the partial directory is gone before the error is raised.
    with (
        disk_full_guard(out_dir, needed, what),
        atomic_dir(out_dir, durable=True) as tmp,
    ):  # a previous model directory survives a failed write
        write_safetensors_stream(dict(specs), tensors, tmp, max_shard_bytes)
        faults.maybe_die("final", 0, 0)  # recovery tests: a power loss half-way through the save
        (tmp / "config.yaml").write_text(cfg.to_yaml())
        for name, src in tok.items():
            shutil.copyfile(src, tmp / name)
        info = {"format_version": FORMAT_VERSION, "fitlm_version": __version__, "torch_version": torch.__version__}
        (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    return out_dir


def _fitlm_dir_config(d: Path) -> Config:
    try:
        info = json.loads((d / MARKER).read_text())
    except ValueError as e:
        raise ModelDirError(f"{d / MARKER}: not valid JSON ({e}); the directory is damaged, save it again") from None
    version = info.get("format_version") if isinstance(info, dict) else None
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ModelDirError(
            f"{d / MARKER}: format_version {version!r} is not readable by this fitlm "
            f"(reads up to {FORMAT_VERSION}); upgrade fitlm"
        )
    return load_config(d / "config.yaml", written_by_fitlm=True)


Specs = dict[str, tuple[torch.dtype, tuple[int, ...]]]


@dataclass
class ModelSource:
    """A MODEL path opened without reading its weights: what `load_model_dir` knows before the weights, and
    `weights()` to stream them, so a caller that handles one block at a time never holds the model."""

    config: Config
    tokenizer_path: Path | None
    source: str  # "fitlm", "hf" or "gguf"
    path: Path
    gguf: Any = None  # the GGUF file's fitlm.models.gguf.GGUFTensors (its header parsed once)

    def weights(self, wanted: Callable[[str], bool] | None = None) -> tuple[Specs, Iterator[tuple[str, torch.Tensor]]]:
        """(fitlm name -> (stored dtype, shape), iterator of (fitlm name, tensor)), one source tensor read at a
        time (GGUF: dequantized to fp32); `wanted` as in fitlm.models.streaming.stream_from_hf."""
        if self.source == "gguf":
            from fitlm.models.gguf import stream_gguf

            return stream_gguf(self.gguf, wanted)[1:]
        return stream_from_hf(self.path, self.config.model, wanted)

    def hf_state_dict(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Every weight at once under HF names (the whole-model load)."""
        return self.gguf.state_dict() if self.source == "gguf" else read_safetensors_dir(self.path, device)


def open_model(path: str | Path) -> ModelSource:
    """Open a fitlm model directory, a training output (its model/), a Hugging Face directory or a GGUF file:
    the config, tokenizer and version checks of `load_model_dir`, no weights read."""
    kind, d = resolve_model_path(path)
    if kind == "gguf":
        from fitlm.models.gguf import GGUFTensors

        tensors = GGUFTensors(d)
        if "fitlm.export" in tensors.meta:  # written by `fitlm export`: warn now on an incompatible version
            from fitlm.models.metadata import check_metadata

            check_metadata(json.loads(tensors.meta["fitlm.export"]), str(d))
        return ModelSource(default_config(tensors.config), None, "gguf", d, tensors)
    if kind == "fitlm":
        cfg = _fitlm_dir_config(d)
    else:
        from fitlm.models.metadata import read_metadata

        read_metadata(d)  # an export by `fitlm export` carries a record: warn on an incompatible version
        cfg = default_config(read_hf_config(d))
    tok = d / "tokenizer.json"
    return ModelSource(cfg, tok if tok.is_file() else None, kind, d)


def read_model_config(path: str | Path) -> ModelConfig:
    """The model section behind a MODEL path, without reading any weights."""
    kind, d = resolve_model_path(path)
    if kind == "gguf":
        from fitlm.models.gguf import read_gguf_config

        return read_gguf_config(d)
    return load_config(d / "config.yaml", written_by_fitlm=True).model if kind == "fitlm" else read_hf_config(d)


def load_model_dir(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = torch.float32
) -> LoadedModel:
    """Load a fitlm model directory, a training output (its model/), a Hugging Face directory or a GGUF file
    (dequantized on the fly; `fitlm import` keeps the result, with its tokenizer)."""
    src = open_model(path)
    model = model_from_hf_state_dict(src.hf_state_dict(device), src.config.model, str(src.path), device, dtype)
    return LoadedModel(model.eval(), src.config, src.tokenizer_path, src.source, src.path)


__all__ = [
    "LoadedModel",
    "ModelSource",
    "open_model",
    "ModelDirError",
    "HFFormatError",
    "default_config",
    "is_fitlm_model_dir",
    "resolve_model_path",
    "read_model_config",
    "save_model_dir",
    "write_model_dir",
    "load_model_dir",
]
