"""`--format gguf`: one llama.cpp-family file (llama architecture) with weights, config and tokenizer.

The inverse of fitlm/models/gguf.py (the importer): same tensor names, q/k rows permuted into
llama.cpp's RoPE layout, the tokenizer as llama.cpp names it (fitlm/export/gguf_tokenizer.py). Matrices are
stored as f32, f16 or q8_0 (via gguf.quants); 1-D tensors (norms) stay f32, as llama.cpp's converter does.
The export record is stored inside the file under the key `fitlm.export` (JSON). An Ollama Modelfile
is written beside the file (fitlm/export/modelfile.py).
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from fitlm.atomic import atomic_file
from fitlm.diskspace import disk_full_guard
from fitlm.export.errors import ExportError
from fitlm.export.gguf_quant import BITS_PER_WEIGHT, KQUANTS, quantize
from fitlm.export.gguf_tokenizer import add_tokenizer
from fitlm.export.source import StreamedModel, hf_weights
from fitlm.models.gguf import gguf_metadata, gguf_tensors
from fitlm.models.io import LoadedModel, Specs
from fitlm.models.metadata import build_metadata, check_metadata

DTYPES = ("f32", "f16", "q8_0", *KQUANTS)


def EXPORTABLE(family) -> bool:  # noqa: N802  (read by fitlm.docs for the README families table)
    """Families `--format gguf` writes: those with llama.cpp names (fitlm.models.family.GGUFNames)."""
    return family.gguf is not None


META_KEY = "fitlm.export"


def _add_value(writer, key: str, value) -> None:
    """One metadata entry with llama.cpp's types: integers uint32, reals float32, text string."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_string(key, str(value))


def _encode(w: np.ndarray, dtype: str):
    """(array, raw_dtype) for GGUFWriter.add_tensor."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if w.ndim == 1 or dtype == "f32":
        return w.astype(np.float32), None
    if dtype == "f16":
        return w.astype(np.float16), None
    if w.shape[-1] % 32:
        return w.astype(np.float16), None  # q8_0 needs rows in blocks of 32; keep such a tensor f16
    return quantize(w.astype(np.float32), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0


def _file_type(dtype: str) -> int:
    from gguf import LlamaFileType

    return {"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16, "q8_0": LlamaFileType.MOSTLY_Q8_0}[dtype]


def _gguf_bytes(specs: Specs, dtype: str, source: LoadedModel | StreamedModel) -> int:
    """About the size of the file: matrices at `dtype` (q8_0: 34 bytes per 32 weights), vectors f32,
    plus the vocabulary (about the size of tokenizer.json)."""
    per = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32, **{k: b / 8 for k, b in BITS_PER_WEIGHT.items()}}[dtype]
    weights = sum(math.prod(shape) * (4.0 if len(shape) == 1 else per) for _, shape in specs.values())
    vocab = source.tokenizer_path.stat().st_size if source.tokenizer_path is not None else 0
    return int(weights) + vocab + 64 * 1024


def _spill(writer, name: str, data: np.ndarray, raw) -> None:
    """Register one encoded tensor with the writer and append its bytes (padded to GGUF's alignment) to the spill
    file, as GGUFWriter.add_tensor does with use_temp_file -- but through file.write, so that a full disk raises
    ENOSPC (numpy's tofile reports it without an errno, which would hide the disk-full message)."""
    writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=raw)
    # (numpy's stubs give ndarray the buffer protocol's __buffer__ on Python 3.12+ only)
    writer.temp_file.write(memoryview(np.ascontiguousarray(data)).cast("B"))  # type: ignore[arg-type]
    writer.write_padding(writer.temp_file, data.nbytes)


def _close_quietly(writer) -> None:
    """Close the writer's files (the spill file too, so a failed export frees its space now); after a failed
    write (a full disk) their buffered bytes cannot be written either, and the caller deletes the file, so that
    second error is not the one to report."""
    if writer.temp_file is not None:
        try:
            writer.temp_file.close()
        except OSError:
            pass
    try:
        writer.close()
    except OSError:
        for f in writer.fout or ():
            try:
                f.close()
            except OSError:
                pass
        writer.fout = None


def _check(cfg, dtype: str) -> None:
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not supported for GGUF; choose one of {', '.join(DTYPES)}")
    if cfg.family.gguf is None:
        raise ExportError(
            f"GGUF export: model.arch {cfg.arch!r} has no llama.cpp architecture; export it with --format hf"
        )
    if cfg.family.gguf.head_is_embedding and not cfg.tie_embeddings:
        raise ExportError(
            f"GGUF export: llama.cpp's {cfg.family.gguf.arch} architecture has no output head of its "
            f"own (it reuses token_embd), and this model's head is untied (tie_embeddings: false, as "
            f"an adapter on lm_head makes it); export it with --format hf, or train the adapter "
            f"without lm_head"
        )


def _write(source: LoadedModel | StreamedModel, tensors, tmp: Path, dtype: str, tokenizer: bool, meta: dict) -> str:
    """Write the GGUF file `tmp` (f32 | f16 | q8_0) from the (HF name, tensor) iterator `tensors`; returns the
    vocabulary written (gguf_tokenizer.add_tokenizer)."""
    from gguf import GGUFWriter

    cfg = source.config.model
    writer = GGUFWriter(str(tmp), cfg.family.gguf.arch, use_temp_file=True)
    # unlinked at once: nothing is left behind (gguf types temp_file as the SpooledTemporaryFile it would make)
    writer.temp_file = tempfile.TemporaryFile(dir=tmp.parent)  # type: ignore[assignment]
    try:
        writer.add_name(source.path.name)
        for key, value in gguf_metadata(cfg).items():
            _add_value(writer, key, value)
        writer.add_file_type(_file_type(dtype))
        writer.add_string(META_KEY, json.dumps(meta))
        vocabulary = add_tokenizer(writer, source.tokenizer_path if tokenizer else None)
        for name, w in gguf_tensors(tensors, cfg):
            data, raw = _encode(w.numpy(), dtype)
            _spill(writer, name, data, raw)
            del w, data
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except BaseException:
        _close_quietly(writer)
        raise
    writer.close()  # its last flush can still find the disk full: that error must leave
    return vocabulary


def export_gguf(
    source: LoadedModel | StreamedModel, out: str | Path, dtype: str = "f16", tokenizer: bool = True
) -> dict:
    """Write a GGUF file at `out` in `dtype` (f32 | f16 | q8_0 | q4_k_m | q5_k_m | q6_k), with the model's
    tokenizer unless `tokenizer` is False (fitlm.export.gguf_tokenizer: a tokenizer llama.cpp cannot name is
    refused, and nothing is left at `out`).

    `source`: a loaded model, or one opened with fitlm.export.source.open_for_export, whose weights are read,
    converted and encoded one block at a time (what `fitlm export --format gguf` does). GGUF lists every tensor
    before the data, so the encoded tensors go to an anonymous spill file beside `out` until the table is
    written, then are copied in: the disk holds the model twice for a moment, the memory a block. A k-quant is
    written at f16 beside `out` first, then quantized by llama.cpp (fitlm/export/gguf_quant.py)."""
    cfg = source.config.model
    _check(cfg, dtype)
    out = Path(out).expanduser()
    if out.is_dir():
        raise ExportError(f"--out {out} is a directory; --format gguf writes one file, e.g. {out / 'model.gguf'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = build_metadata("gguf", source.path, {"dtype": dtype})
    kquant = dtype in KQUANTS
    written = "f16" if kquant else dtype
    # The guard outside the atomic block: the partial file is gone before the error is raised. Twice the file
    # (the spilled tensors and the file they are copied into), plus the k-quant made from it.
    specs, tensors = hf_weights(source)
    need = 2 * _gguf_bytes(specs, written, source) + (_gguf_bytes(specs, dtype, source) if kquant else 0)
    with disk_full_guard(out, need, "fitlm export --format gguf"), atomic_file(out) as tmp:
        if kquant:
            with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
                f16 = Path(scratch) / "f16.gguf"
                vocabulary = _write(source, tensors, f16, "f16", tokenizer, meta)
                quantize(f16, tmp, dtype)
        else:
            vocabulary = _write(source, tensors, tmp, dtype, tokenizer, meta)
    from fitlm.export.modelfile import write_modelfile

    modelfile = write_modelfile(source, out)  # for `ollama create` (fitlm/export/modelfile.py)
    return {
        "format": "gguf",
        "out": str(out),
        "dtype": dtype,
        "bytes": out.stat().st_size,
        "tokenizer": vocabulary != "none",
        "vocabulary": vocabulary,
        "source_sha256": meta["source_sha256"],
        "modelfile": str(modelfile),
    }


def read_export_metadata(path: str | Path) -> dict[str, Any] | None:
    """The export record inside a GGUF file (warns on an incompatible version), or None."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get(META_KEY)
    if field is None:
        return None
    meta = json.loads(field.contents())
    check_metadata(meta, str(path))
    return meta
