"""`fitlm import`: a pretrained model from elsewhere -> a fitlm model directory with its tokenizer.

Sources: a Hugging Face safetensors directory (llama, mistral, SmolLM-style llama, gpt2) or a GGUF
file. Nothing from the source is executed: safetensors and GGUF are data formats. Pickled `.bin`
weights are refused, unless `weights_only=True` is asked for explicitly, which makes torch's
unpickler accept tensors and plain containers only.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from fitlm.finetune.errors import FinetuneError
from fitlm.models.hf import model_from_hf_state_dict, read_hf_config
from fitlm.models.io import TOKENIZER_FILES, LoadedModel, default_config, load_model_dir, resolve_model_path, \
    save_model_dir

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
            raise FinetuneError(f"{f}: refused by torch.load(weights_only=True) ({type(e).__name__}: {e}); "
                                f"it holds more than tensors, so fitlm will not load it") from None
    cfg = read_hf_config(d)
    model = model_from_hf_state_dict(sd, cfg, str(d), "cpu", None)
    return LoadedModel(model, default_config(cfg), None, "hf", d)


def import_model(src: str | Path, out: str | Path, weights_only: bool = False) -> dict:
    """Convert SRC into a fitlm model directory at OUT; returns a summary (kind, params, tokenizer)."""
    src = Path(src).expanduser()
    tok_dir: Path | None = None
    note = None
    with tempfile.TemporaryDirectory() as tmp:
        if weights_only and src.is_dir() and not (src / "model.safetensors").is_file():
            loaded, kind = _load_pickled_weights_only(src), "hf-pickle"
            tok_dir = src
        else:
            kind, path = resolve_model_path(src)
            if kind == "gguf":
                from fitlm.data.gguf_tokenizer import UnsupportedTokenizer, write_gguf_tokenizer
                from fitlm.data.tokenizer import Tokenizer
                from fitlm.models.gguf import read_gguf

                mcfg, sd, meta = read_gguf(path)
                model = model_from_hf_state_dict(sd, mcfg, str(path), "cpu", None)
                loaded = LoadedModel(model, default_config(mcfg), None, "gguf", path)
                try:  # tokenizer.json + its specials, add_bos_token, stop ids and chat template
                    write_gguf_tokenizer(meta, Path(tmp), str(path))
                    Tokenizer.from_file(Path(tmp))  # what was written must load (names are real tokens)
                    tok_dir = Path(tmp)
                except UnsupportedTokenizer as e:
                    note = f"{e}; the weights were imported without a tokenizer"
            else:
                loaded = load_model_dir(path, dtype=None)  # keep the stored dtype (bf16 stays bf16)
                tok_dir = path
        if tok_dir is not None and not any((tok_dir / n).is_file() for n in TOKENIZER_FILES):
            tok_dir = None
        save_model_dir(loaded.model, loaded.config, out, tokenizer_path=tok_dir)
    params = sum(p.numel() for p in {id(p): p for p in loaded.model.parameters()}.values())
    summary = {"source": str(src), "kind": kind, "out": str(Path(out)), "arch": loaded.config.model.arch,
               "params": params, "tokenizer": tok_dir is not None}
    return {**summary, "tokenizer_note": note} if note else summary
