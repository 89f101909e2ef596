"""The model to export: any MODEL path, with a LoRA adapter merged in first when one is given.

Exports hold plain weights only: runtimes (llama.cpp, onnxruntime, vLLM) know nothing of adapters.
`open_for_export` (what `--format hf` uses) reads nothing up front: its weights stream block by block
(`fitlm.models.streaming.layer_group`: one transformer block, or the embedding, norm or head alone),
each cast to fp32, merged with that block's adapters and handed on before the next block is read, so
no process holds the whole model. `load_for_export` loads the whole model (GGUF and ONNX exports,
which quantize or trace a module).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Mapping

import torch

from fitlm.config import Config
from fitlm.export.errors import ExportError
from fitlm.finetune.lora import untied_for, with_weights
from fitlm.models.hf import model_keys, to_hf_state_dict
from fitlm.models.io import LoadedModel, ModelSource, load_model_dir, open_model
from fitlm.models.streaming import grouped, layer_group, meta_like, stream_to_hf

Specs = dict[str, tuple[torch.dtype, tuple[int, ...]]]
Tensors = dict[str, torch.Tensor]


@dataclass
class Adapter:
    """A PEFT LoRA adapter to merge: its directory (named in errors), scaling and A/B tensors by fitlm FQN."""

    path: Path
    scaling: float
    tensors: Tensors
    recipe: dict[str, int] | None = None  # QLoRA: the base as the adapter was trained on it (fitlm_qlora.json)

    def merge(self, weights: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor] | None = None
              ) -> Tensors:
        """`weights` with the adapter's `tensors` (default: all of them) merged in; a QLoRA adapter's base
        weights first quantized and dequantized as its run computed with them (not for the meta shape check)."""
        from fitlm.finetune.lora import merge_lora
        from fitlm.finetune.qlora import as_trained

        if not any(t.is_meta for t in weights.values()):
            weights = as_trained(weights, self.recipe)
        return merge_lora(weights, self.tensors if tensors is None else tensors, self.scaling, source=str(self.path))


def _adapter(source_kind: str, cfg: Config, path: Path, adapter: str | Path | None) -> Adapter | None:
    if adapter is None:
        return None
    from fitlm.finetune.peft_format import load_adapter

    if source_kind == "fitlm" and cfg.finetune.adapters:
        raise ExportError(f"{path} was written by a LoRA run and already includes its adapter; "
                          f"export it without --adapter, or pass the base model with --adapter")
    from fitlm.finetune.qlora import read_recipe

    spec, tensors = load_adapter(adapter)  # LoraError (a ValueError) on a malformed adapter
    return Adapter(Path(adapter), spec.scaling, tensors, read_recipe(adapter))


def load_for_export(model: str | Path, adapter: str | Path | None = None) -> LoadedModel:
    """Load MODEL in fp32; merge `adapter` (PEFT directory) into it, refusing one made for another base."""
    loaded = load_model_dir(model)
    lora = _adapter(loaded.source, loaded.config, loaded.path, adapter)
    if lora is None:
        return loaded
    config = untied_for(loaded.config, lora.tensors)  # a tied head the adapter adapts is exported untied
    return replace(loaded, model=with_weights(loaded.model, config.model, lora.merge(loaded.model.state_dict())),
                   config=config)


@dataclass
class StreamedModel:
    """A MODEL opened for a streaming export: config and tokenizer now, weights (adapter merged) on demand."""

    model: ModelSource
    adapter: Adapter | None

    @property
    def config(self) -> Config:
        # a tied head the adapter adapts is exported untied (fitlm.finetune.lora.untied_for)
        return untied_for(self.model.config, self.adapter.tensors) if self.adapter else self.model.config

    @property
    def tokenizer_path(self) -> Path | None:
        return self.model.tokenizer_path

    @property
    def path(self) -> Path:
        return self.model.path

    def fp32_specs(self) -> Specs:
        """Every weight as the whole-model load holds it: floating tensors in fp32 (load_model_dir's cast)."""
        specs, _ = self.model.weights()
        return {k: (torch.float32 if dtype.is_floating_point else dtype, shape) for k, (dtype, shape) in specs.items()}

    def blocks(self) -> Iterator[Tensors]:
        """One block's fp32 weights at a time (fitlm names), its adapters merged."""
        names = grouped(model_keys(self.config.model))
        group_of = {n: g for g, ns in names.items() for n in ns}
        adapters: dict[str, Tensors] = {}
        for k, t in (self.adapter.tensors.items() if self.adapter else ()):
            adapters.setdefault(layer_group(k.rsplit(".lora_", 1)[0] + ".weight"), {})[k] = t
        pending: dict[str, Tensors] = {}
        _, stream = self.model.weights()
        # Source files list a block's tensors together (safetensors sort by name, GGUF by block): a block is
        # handed on as soon as it is complete, and whatever order a file uses, nothing is merged half.
        for name, t in stream:
            group = group_of[name]
            block = pending.setdefault(group, {})
            block[name] = t.float() if t.is_floating_point() else t
            if len(block) == len(names[group]):
                del pending[group]
                # a QLoRA recipe may name weights of a block without adapters (an untargeted Linear)
                yield self.adapter.merge(block, adapters.get(group, {})) if self.adapter else block
        assert not pending, f"{self.path}: incomplete blocks {sorted(pending)[:3]}"  # stream_from_hf checked names

    def hf_weights(self) -> tuple[Specs, Iterator[tuple[str, torch.Tensor]]]:
        specs = self.fp32_specs()
        if self.adapter is not None:
            # Every adapter's shape against the base, on meta tensors: a mismatch is refused before anything is
            # read or written, as the whole-model merge refused it.
            self.adapter.merge(meta_like(specs), {k: v.to("meta") for k, v in self.adapter.tensors.items()})
        return stream_to_hf(specs, self.config.model, self.blocks())


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
