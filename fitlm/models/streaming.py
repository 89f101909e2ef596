"""Weights one tensor (or one block) at a time, through the families' own whole-model adapters.

A family converts between its module's names and Hugging Face's with a function over a complete
state dict (`Family.from_hf` / `to_hf`: renames, GPT-2's fused c_attn split or joined, a tied head
stored once). Streaming reuses those functions unchanged: every tensor is present, but only the
current ones are real and all others are meta tensors (shape and dtype, no storage, no cost); the
outputs that come back real are exactly what the current tensors become. So a load holds one source
block at a time (a tensor outside the blocks: the embedding and head, a model's largest), and so does a save,
with every family's rules in one place.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from fitlm.config import ModelConfig
from fitlm.models.hf import HFFormatError, from_hf_state_dict, read_safetensors_dir, to_hf_state_dict
from fitlm.models.safetensors_io import SafetensorsReader

StateDict = dict[str, torch.Tensor]
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def layer_group(name: str) -> str:
    """The unit weights are converted and moved in: a block ("3" for every model.layers.3.* weight, which
    a family's adapter may combine: GPT-2 fuses q/k/v), or the weight itself outside the blocks (the
    embeddings, final norm and head convert one by one, and are a model's largest tensors)."""
    m = _LAYER.match(name)
    return m.group(1) if m else name


def meta_like(specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> StateDict:
    return {k: torch.empty(shape, dtype=dtype, device="meta") for k, (dtype, shape) in specs.items()}


def real_part(
    convert: Callable[[StateDict], StateDict], meta_sd: Mapping[str, torch.Tensor], real: Mapping[str, torch.Tensor]
) -> StateDict:
    """What `real` becomes under `convert` (a whole-state-dict adapter), the rest standing in as meta."""
    return {k: v for k, v in convert({**meta_sd, **real}).items() if v.device.type != "meta"}


def hf_source(path: str | Path) -> dict[str, SafetensorsReader]:
    """HF weight name -> the reader of the file holding it, for model.safetensors or an indexed set of shards."""
    path = Path(path)
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        reader = SafetensorsReader(single)
        return {name: reader for name in reader.entries}
    if not index.is_file():
        read_safetensors_dir(path)  # raises the precise error (pickles refused, or no weights)
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError) as e:
        raise HFFormatError(f"{index}: not a valid safetensors index ({e}); re-save the model") from None
    readers: dict[str, SafetensorsReader] = {}
    out: dict[str, SafetensorsReader] = {}
    for name, shard in weight_map.items():
        if Path(shard).name != shard:  # shard names come from the directory's own file: never outside it
            raise HFFormatError(f"{index}: shard name {shard!r} is not a plain file name; refusing to read it")
        if shard not in readers:
            if not (path / shard).is_file():
                raise HFFormatError(f"{index} names shard {shard}, which is missing; download it again")
            readers[shard] = SafetensorsReader(path / shard)
        if name not in readers[shard].entries:
            raise HFFormatError(f"{index} places {name!r} in {shard}, which does not hold it; re-save the model")
        out[name] = readers[shard]
    return out


def stream_from_hf(
    path: str | Path, cfg: ModelConfig, wanted: Callable[[str], bool] | None = None
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], Iterator[tuple[str, torch.Tensor]]]:
    """(fitlm name -> (stored dtype, shape), iterator of (fitlm name, tensor in its stored dtype)) for an HF or
    fitlm model directory, reading one source tensor at a time (`stream_source`)."""
    return stream_source(hf_source(path), cfg, str(path), wanted)


def stream_source(
    source: Mapping[str, Any], cfg: ModelConfig, label: str, wanted: Callable[[str], bool] | None = None
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], Iterator[tuple[str, torch.Tensor]]]:
    """(fitlm name -> (dtype, shape), iterator of (fitlm name, tensor)) from `source`: HF weight name -> a reader
    with `spec(name)` (dtype, shape) and `read(name)` (the tensor), such as a SafetensorsReader or a GGUF file's
    `fitlm.models.gguf.GGUFTensors`; one block's source tensors are read at a time (one tensor outside the
    blocks), through the family's HF adapter.

    `wanted(fitlm_name)`: a source tensor none of whose outputs is wanted is not read at all (a pipeline
    stage skips the other stages' blocks). The mapping is checked whole before anything is read: a missing
    or unexpected weight is an HFFormatError naming it (and `label`), as the whole-model load says."""
    meta_sd = meta_like({k: r.spec(k) for k, r in source.items()})

    def convert(sd: StateDict) -> StateDict:
        return from_hf_state_dict(sd, cfg, label)

    specs = {k: (v.dtype, tuple(v.shape)) for k, v in convert(meta_sd).items()}

    def produce() -> Iterator[tuple[str, torch.Tensor]]:
        # A block's tensors convert together: an MoE family stacks a layer's per-expert tensors into one.
        for names in grouped(n for n in source if not n.endswith("rotary_emb.inv_freq")).values():
            if wanted is not None:
                # Unread storage (torch.empty touches no page) tells which outputs these tensors feed.
                empty = {n: torch.empty(source[n].spec(n)[1], dtype=source[n].spec(n)[0]) for n in names}
                if not any(wanted(k) for k in real_part(convert, meta_sd, empty)):
                    continue
            yield from real_part(convert, meta_sd, {n: source[n].read(n) for n in names}).items()

    return specs, produce()


def stream_to_hf(
    specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], cfg: ModelConfig, groups: Iterable[StateDict]
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], Iterator[tuple[str, torch.Tensor]]]:
    """(HF name -> (dtype, shape), iterator of (HF name, tensor)) from fitlm weights given group by group
    (`specs`: every fitlm weight's dtype and shape; each group holds tensors the adapter converts together,
    e.g. one block: GPT-2 fuses a block's q/k/v, Phi-3 its split projections)."""
    meta_sd = meta_like(specs)

    def convert(sd: StateDict) -> StateDict:
        return to_hf_state_dict(sd, cfg)

    hf_specs = {k: (v.dtype, tuple(v.shape)) for k, v in convert(meta_sd).items()}

    def produce() -> Iterator[tuple[str, torch.Tensor]]:
        for group in groups:
            yield from real_part(convert, meta_sd, group).items()

    return hf_specs, produce()


def grouped(names: Iterable[str]) -> dict[str, list[str]]:
    """Names by block (`layer_group`), in first-seen order."""
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(layer_group(n), []).append(n)
    return out
