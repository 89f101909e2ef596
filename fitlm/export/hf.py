"""`--format hf`: a standard Hugging Face directory (config, generation config, safetensors, tokenizer).

The layout is exactly what `transformers` writes for LlamaForCausalLM / GPT2LMHeadModel, so
transformers, vLLM and other HF-layout loaders read it without fitlm. The chat template is put into
tokenizer_config.json (`chat_template`), where `apply_chat_template` looks for it.
`fitlm export --format hf` streams (fitlm.export.source.open_for_export): the weights are read, merged with
an adapter, converted and written one block at a time, so no process holds the whole model.
The directory is written to a hidden sibling and renamed into place (fitlm.atomic): a failed export
(a full disk included) leaves no partial files and any previous export at `out` as it was.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from fitlm.atomic import atomic_dir
from fitlm.data.chat import resolve_template
from fitlm.data.tokenizer import Tokenizer
from fitlm.diskspace import disk_full_guard
from fitlm.export.errors import ExportError
from fitlm.export.source import StreamedModel, hf_weights
from fitlm.models.hf import DEFAULT_MAX_SHARD_BYTES, write_hf_configs
from fitlm.models.io import TOKENIZER_FILES, LoadedModel
from fitlm.models.metadata import build_metadata, write_metadata
from fitlm.models.safetensors_io import spec_bytes, write_safetensors_stream


def _check_out_dir(out: Path) -> None:
    if out.is_file():
        raise ExportError(f"--out {out} is a file; --format hf writes a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise ExportError(
            f"--out {out} exists and holds something other than an HF export; refusing to mix "
            f"files into it. Choose an empty or new directory"
        )


def _write_tokenizer(loaded: LoadedModel | StreamedModel, out: Path) -> dict[str, Any]:
    """Copy tokenizer files and put the chat template into tokenizer_config.json; return special ids."""
    src = loaded.tokenizer_path
    if src is None:
        return {"bos": None, "eos": None, "pad": None}
    for name in TOKENIZER_FILES:
        f = src.parent / name
        if f.is_file() and f.resolve() != (out / name).resolve():
            shutil.copyfile(f, out / name)
    tok = Tokenizer.from_file(src)
    cfg_file = out / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    cfg.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    for key in ("bos", "eos", "pad"):
        cfg.setdefault(f"{key}_token", tok.special_tokens[key])
    if tok.fitlm_convention:  # fitlm trained with BOS before every text; transformers must add it too
        cfg["add_bos_token"] = tok.add_bos
    if "chat_template" not in cfg:
        cfg["chat_template"] = resolve_template(None, src)[1]  # the training template, else chatml
    cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")
    return {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id, "stops": list(tok.stop_ids)}


def _tokenizer_bytes(loaded: LoadedModel | StreamedModel) -> int:
    src = loaded.tokenizer_path
    if src is None:
        return 0
    return sum((src.parent / n).stat().st_size for n in TOKENIZER_FILES if (src.parent / n).is_file())


def export_hf(
    source: LoadedModel | StreamedModel, out: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> dict:
    """Write the HF directory at `out`; shards (with model.safetensors.index.json) above max_shard_bytes.

    `source`: a loaded model, or one opened with fitlm.export.source.open_for_export, whose weights are read,
    converted and written one block at a time (what `fitlm export --format hf` does). Both write the same bytes."""
    out = Path(out).expanduser()
    _check_out_dir(out)
    meta = build_metadata("hf", source.path)  # before the swap: `out` may be the source itself
    specs, tensors = hf_weights(source)
    # Sized from the tensor table, before any weight is read.
    needed = sum(spec_bytes(s) for s in specs.values()) + _tokenizer_bytes(source) + 64 * 1024
    # The guard outside the atomic block: the partial directory is gone before the error is raised.
    with disk_full_guard(out, needed, "fitlm export --format hf"), atomic_dir(out, durable=True) as tmp:
        # The tokenizer first: its special ids go into config.json and generation_config.json (a
        # generation_config.json copied from a source directory is replaced below).
        ids = _write_tokenizer(source, tmp)
        write_safetensors_stream(specs, tensors, tmp, max_shard_bytes)
        dtype = str(next(iter(specs.values()))[0]).removeprefix("torch.")
        # every EOS / end-of-turn id the model stops at, as its config lists, goes into generation_config.json
        stops = {"eos_token_id": ids["stops"]} if len(ids.get("stops") or ()) > 1 else {}
        write_hf_configs(tmp, source.config.model, dtype, ids["bos"], ids["eos"], pad_token_id=ids["pad"], **stops)
        write_metadata(tmp, meta)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    return {
        "format": "hf",
        "out": str(out),
        "files": shards,
        "tokenizer": source.tokenizer_path is not None,
        "source_sha256": meta["source_sha256"],
    }
