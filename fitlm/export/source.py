"""The model to export: any MODEL path, with a LoRA adapter merged in first when one is given.

Exports hold plain weights only: runtimes (llama.cpp, onnxruntime, vLLM) know nothing of adapters.
`open_for_export` (what `--format hf` and `--format gguf` use) reads nothing up front: its weights stream block
by block (fitlm.finetune.adapted.StreamedModel, which `fitlm merge` and `fitlm import` stream too), so no process
holds the whole model. `load_for_export` loads the whole model (the ONNX export traces a module; `fitlm serve`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch

from fitlm.config import Config
from fitlm.export.errors import ExportError
from fitlm.finetune.adapted import Adapter, StreamedModel, read_adapter
from fitlm.finetune.lora import untied_for, with_weights
from fitlm.models.hf import to_hf_state_dict
from fitlm.models.io import LoadedModel, Specs, load_model_dir, open_model


def _adapter(source_kind: str, cfg: Config, path: Path, adapter: str | Path | None) -> Adapter | None:
    if adapter is None:
        return None
    if source_kind == "fitlm" and cfg.finetune.adapters:
        raise ExportError(
            f"{path} was written by a LoRA run and already includes its adapter; "
            f"export it without --adapter, or pass the base model with --adapter"
        )
    return read_adapter(adapter)


def load_for_export(model: str | Path, adapter: str | Path | None = None) -> LoadedModel:
    """Load MODEL in fp32; merge `adapter` (PEFT directory) into it, refusing one made for another base."""
    loaded = load_model_dir(model)
    lora = _adapter(loaded.source, loaded.config, loaded.path, adapter)
    if lora is None:
        return loaded
    config = untied_for(loaded.config, lora.tensors)  # a tied head the adapter adapts is exported untied
    return replace(
        loaded, model=with_weights(loaded.model, config.model, lora.merge(loaded.model.state_dict())), config=config
    )


def open_for_export(model: str | Path, adapter: str | Path | None = None) -> StreamedModel:
    """MODEL (and `adapter`) opened, checked and ready to stream; no weight is read yet."""
    src = open_model(model)
    return StreamedModel(src, _adapter(src.source, src.config, src.path, adapter))


def hf_weights(source: LoadedModel | StreamedModel) -> tuple[Specs, Iterator[tuple[str, torch.Tensor]]]:
    """(HF name -> (dtype, shape), iterator of (HF name, tensor)) of a loaded model or a streamed one."""
    if isinstance(source, StreamedModel):
        return source.hf_weights()
    sd = to_hf_state_dict(source.model, source.config.model)
    return {k: (v.dtype, tuple(v.shape)) for k, v in sd.items()}, iter(sd.items())
