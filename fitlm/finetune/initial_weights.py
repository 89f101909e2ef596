"""The weights a run starts from, as a stream of (name, full tensor), one tensor at a time.

Without model.init_from: the seeded initialisation (`fitlm.models.init_replay`: the numbers
`build_model` draws after `torch.manual_seed(train.seed)`). With it: the weights read from the model
directory tensor by tensor (`fitlm.models.streaming`). Then LoRA's fresh adapters, drawn after the
base as they were when the whole model was built first. `fitlm.parallel.materialize` copies each
rank's slice out of the stream into a model built on the meta device.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterable, Iterator

import torch
import torch.nn as nn

from fitlm.config import Config
from fitlm.finetune.lora import lora_weights
from fitlm.models.init_replay import seeded_weights
from fitlm.models.io import resolve_model_path
from fitlm.models.streaming import layer_group, stream_from_hf

Weights = Iterator[tuple[str, torch.Tensor]]


def base_weights(cfg: Config, groups: set[str] | None = None) -> Weights:
    """The base model's weights under the module's own names. `groups`: the blocks (`layer_group`) this
    rank holds; a source tensor feeding none of them is not read (a pipeline stage's share)."""
    m = cfg.model
    if not m.init_from:
        return seeded_weights(m, cfg.train.seed)
    kind, path = resolve_model_path(m.init_from)
    wanted = None if groups is None else (lambda name: layer_group(name) in groups)
    if kind == "gguf":
        from fitlm.models.gguf import stream_gguf

        # One tensor read and dequantized at a time, in fp32 as a whole-model GGUF load gives them.
        return stream_gguf(path, wanted)[2]
    return stream_from_hf(path, m, wanted)[1]


def initial_weights(
    cfg: Config, model: nn.Module, prepare: Callable | None = None
) -> Callable[[set[str] | None], Iterable[tuple[str, torch.Tensor]]]:
    """`groups -> weights` for `fitlm.parallel.materialize`, for `model` as apply_finetune left it on the meta
    device (its adapters are listed now). `prepare`: the family's `prepare_state_dict` when the model was
    split for tensor parallel (Phi-3's fused projections), applied to each weight as it arrives."""
    adapters = lora_weights(model)

    def weights(groups: set[str] | None) -> Weights:
        torch.manual_seed(cfg.train.seed)  # adapters draw after a load as after a seeded build
        stream = itertools.chain(base_weights(cfg, groups), adapters)
        if prepare is None:
            return stream
        return (pair for name, t in stream for pair in prepare({name: t}, cfg.model).items())

    return weights
