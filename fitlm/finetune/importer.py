"""`fitlm import`: a pretrained model from elsewhere -> a fitlm model directory with its tokenizer.

Sources: a Hugging Face safetensors directory (llama, mistral, SmolLM-style llama, gpt2) or a GGUF
file. Nothing from the source is executed: safetensors and GGUF are data formats. Pickled `.bin`
weights are refused, unless `weights_only=True` is asked for explicitly, which makes torch's
unpickler accept tensors and plain containers only.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch

from fitlm.finetune.adapted import StreamedModel
from fitlm.finetune.errors import FinetuneError
from fitlm.models.hf import model_from_hf_state_dict, read_hf_config
from fitlm.models.io import (
    TOKENIZER_FILES,
    LoadedModel,
    ModelSource,
    default_config,
    open_model,
    save_model_dir,
    write_model_dir,
)

PICKLE_NAMES = ("pytorch_model.bin", "model.bin", "pytorch_model.pt")


def _load_pickled_weights_only(d: Path) -> LoadedModel:
    """A `pytorch_model.bin` directory read with torch.load(weights_only=True): tensors and containers only."""
    files = [d / n for n in PICKLE_NAMES if (d / n).is_file()] or sorted(d.glob("pytorch_model-*.bin"))
    if not files or not (d / "config.json").is_file():
        raise FinetuneError(f"{d}: --weights-only reads pytorch_model*.bin beside a config.json; neither was found")
    sd = {}
    for f in files:
        try:
            sd.update(torch.load(f, map_location="cpu", weights_only=True))
        except Exception as e:  # noqa: BLE001 - the unpickler refused something: say so, never retry unsafely
            raise FinetuneError(
                f"{f}: refused by torch.load(weights_only=True) ({type(e).__name__}: {e}); "
                f"it holds more than tensors, so fitlm will not load it"
            ) from None
    cfg = read_hf_config(d)
    model = model_from_hf_state_dict(sd, cfg, str(d), "cpu", None)
    return LoadedModel(model, default_config(cfg), None, "hf", d)


def import_model(src: str | Path, out: str | Path, weights_only: bool = False) -> dict:
    """Convert SRC into a fitlm model directory at OUT; returns a summary (kind, params, tokenizer).

    Safetensors directories and GGUF files stream block by block (fitlm.finetune.adapted.StreamedModel, stored
    dtypes kept; GGUF dequantized to fp32): a block in memory, not the model."""
    src = Path(src).expanduser()
    tok_dir: Path | None = None
    note = None
    with tempfile.TemporaryDirectory() as tmp:
        if weights_only and src.is_dir() and not (src / "model.safetensors").is_file():
            loaded, kind = _load_pickled_weights_only(src), "hf-pickle"
            if any((src / n).is_file() for n in TOKENIZER_FILES):
                tok_dir = src
            save_model_dir(loaded.model, loaded.config, out, tokenizer_path=tok_dir)
            params = sum(p.numel() for p in {id(p): p for p in loaded.model.parameters()}.values())
            config = loaded.config
        else:
            source = open_model(src)
            kind = source.source
            if kind == "gguf":
                tok_dir, note = _gguf_tokenizer(source, Path(tmp))
            elif any((source.path / n).is_file() for n in TOKENIZER_FILES):
                tok_dir = source.path
            specs, tensors = StreamedModel(source, keep_dtype=True).hf_weights()
            write_model_dir(specs, tensors, source.config, out, tokenizer_path=tok_dir)
            params = sum(math.prod(shape) for _, shape in specs.values())  # HF names: a tied head stored once
            config = source.config
    summary = {
        "source": str(src),
        "kind": kind,
        "out": str(Path(out)),
        "arch": config.model.arch,
        "params": params,
        "tokenizer": tok_dir is not None,
    }
    return {**summary, "tokenizer_note": note} if note else summary


def _gguf_tokenizer(source: ModelSource, tmp: Path) -> tuple[Path | None, str | None]:
    """The GGUF file's tokenizer written as tokenizer.json (+ its specials, add_bos_token, stop ids and chat
    template) under `tmp`, or (None, why not)."""
    from fitlm.data.gguf_tokenizer import UnsupportedTokenizer, write_gguf_tokenizer
    from fitlm.data.tokenizer import Tokenizer

    try:
        write_gguf_tokenizer(source.gguf.meta, tmp, str(source.path))
        Tokenizer.from_file(tmp)  # what was written must load (names are real tokens)
        return tmp, None
    except UnsupportedTokenizer as e:
        return None, f"{e}; the weights were imported without a tokenizer"
