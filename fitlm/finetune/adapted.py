"""A MODEL, with a PEFT LoRA adapter merged in when one is given, streamed block by block (`fitlm merge`,
`fitlm export --format hf` and `--format gguf`, `fitlm import`).

`StreamedModel` reads nothing up front: its weights come one block at a time
(`fitlm.models.streaming.layer_group`: one transformer block, or the embedding, norm or head alone), each
cast to fp32 and merged with that block's own adapters (W + s·B·A) before the next block is read, so no
process holds the whole model. An adapter on a tied head is merged untied (`fitlm.finetune.lora.untied_for`).
`fitlm import` keeps the stored dtypes instead (`keep_dtype`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import torch

from fitlm.config import Config
from fitlm.finetune.lora import LoraSpec, merge_lora, untied_for
from fitlm.finetune.peft_format import load_adapter
from fitlm.finetune.qlora import as_trained, read_recipe
from fitlm.models.hf import model_keys
from fitlm.models.io import ModelSource, Specs
from fitlm.models.streaming import grouped, layer_group, meta_like, stream_to_hf
from fitlm.progress import counted

Tensors = dict[str, torch.Tensor]


@dataclass
class Adapter:
    """A PEFT LoRA adapter to merge: its directory (named in errors), spec and A/B tensors by fitlm FQN."""

    path: Path
    spec: LoraSpec
    tensors: Tensors
    recipe: dict[str, int] | None = None  # QLoRA: the base as the adapter was trained on it (fitlm_qlora.json)

    @property
    def scaling(self) -> float:
        return self.spec.scaling

    def merge(self, weights: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor] | None = None) -> Tensors:
        """`weights` with the adapter's `tensors` (default: all of them) merged in; a QLoRA adapter's base
        weights first quantized and dequantized as its run computed with them (not for the meta shape check)."""
        if not any(t.is_meta for t in weights.values()):
            weights = as_trained(weights, self.recipe)
        return merge_lora(weights, self.tensors if tensors is None else tensors, self.scaling, source=str(self.path))


def read_adapter(path: str | Path) -> Adapter:
    """A PEFT adapter directory (LoraError, a ValueError, on a malformed one) and its QLoRA recipe, if any."""
    spec, tensors = load_adapter(path)
    return Adapter(Path(path), spec, tensors, read_recipe(path))


@dataclass
class StreamedModel:
    """A MODEL opened for streaming: config and tokenizer now, weights (adapter merged) on demand."""

    model: ModelSource
    adapter: Adapter | None = None
    keep_dtype: bool = False  # weights as stored (`fitlm import`: bf16 stays bf16); merging an adapter casts to fp32

    def __post_init__(self):
        if self.keep_dtype and self.adapter is not None:
            raise ValueError("StreamedModel: an adapter is merged in fp32; keep_dtype is for a model without one")

    @property
    def config(self) -> Config:
        # a tied head the adapter adapts comes out untied (fitlm.finetune.lora.untied_for)
        return untied_for(self.model.config, self.adapter.tensors) if self.adapter else self.model.config

    @property
    def tokenizer_path(self) -> Path | None:
        return self.model.tokenizer_path

    @property
    def path(self) -> Path:
        return self.model.path

    def specs(self) -> Specs:
        """Every weight as the whole-model load holds it: floating tensors in fp32 (load_model_dir's cast), or as
        stored with `keep_dtype`."""
        specs, _ = self.model.weights()
        if self.keep_dtype:
            return specs
        return {k: (torch.float32 if dtype.is_floating_point else dtype, shape) for k, (dtype, shape) in specs.items()}

    def blocks(self) -> Iterator[Tensors]:
        """One block's fp32 weights (as stored with `keep_dtype`) at a time (fitlm names), its adapters merged; how
        many have passed is shown on stderr (fitlm.progress.counted)."""
        names = grouped(model_keys(self.config.model))
        return counted(self._blocks(names), len(names), "weights (blocks)")

    def _blocks(self, names: dict[str, list[str]]) -> Iterator[Tensors]:
        group_of = {n: g for g, ns in names.items() for n in ns}
        adapters: dict[str, Tensors] = {}
        for k, t in self.adapter.tensors.items() if self.adapter else ():
            adapters.setdefault(layer_group(k.rsplit(".lora_", 1)[0] + ".weight"), {})[k] = t
        pending: dict[str, Tensors] = {}
        _, stream = self.model.weights()
        # Source files list a block's tensors together (safetensors sort by name, GGUF by block): a block is
        # handed on as soon as it is complete, and whatever order a file uses, nothing is merged half.
        for name, t in stream:
            group = group_of[name]
            block = pending.setdefault(group, {})
            block[name] = t.float() if t.is_floating_point() and not self.keep_dtype else t
            if len(block) == len(names[group]):
                del pending[group]
                # a QLoRA recipe may name weights of a block without adapters (an untargeted Linear)
                yield self.adapter.merge(block, adapters.get(group, {})) if self.adapter else block
        assert not pending, f"{self.path}: incomplete blocks {sorted(pending)[:3]}"  # stream_from_hf checked names

    def hf_weights(self) -> tuple[Specs, Iterator[tuple[str, torch.Tensor]]]:
        """(HF name -> (dtype, shape), iterator of (HF name, tensor)), block by block."""
        specs = self.specs()
        if self.adapter is not None:
            # Every adapter's shape against the base, on meta tensors: a mismatch is refused before anything is
            # read or written, as the whole-model merge refused it.
            self.adapter.merge(meta_like(specs), {k: v.to("meta") for k, v in self.adapter.tensors.items()})
        return stream_to_hf(specs, self.config.model, self.blocks())
