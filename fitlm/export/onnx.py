"""`--format onnx`: a logits-only graph (input_ids [B,T] int64 -> logits [B,T,V] float32), no KV cache.

Static export fixes batch and sequence length (smallest, fastest graph); --dynamic-shape marks both
axes dynamic. The graph recomputes the whole prefix per call (no KV cache input/output): fine for
scoring and short prompts, slower than `fitlm generate` for long generations.
The TorchScript exporter (dynamo=False) is used: it handles fitlm's plain modules without extra deps.
The export record and the static shape are stored in the model's metadata_props, so `run_onnx` can
refuse a wrong shape with a clear message instead of onnxruntime's opaque one.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from fitlm.atomic import atomic_file
from fitlm.diskspace import disk_full_guard, tensor_bytes
from fitlm.export.errors import ExportError, ONNXShapeError
from fitlm.models.io import LoadedModel
from fitlm.models.metadata import build_metadata, check_metadata

META_KEY = "fitlm.export"
OPSET = 17


class _LogitsOnly(nn.Module):
    """input_ids -> logits, with no optional arguments for the tracer to trip over."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)


def _sdpa_for_onnx(sdpa: Callable) -> Callable:
    """SDPA with grouped-query heads expanded: the TorchScript exporter has no `enable_gqa` conversion."""

    def wrapped(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        rep = int(q.shape[1]) // int(k.shape[1])  # head counts are static: fold them to Python ints
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)

    return wrapped


def export_onnx(
    loaded: LoadedModel, out: str | Path, dynamic_shape: bool = False, batch_size: int = 1, seq_len: int | None = None
) -> dict:
    """Write an ONNX file; static shape [batch_size, seq_len] (default: the model's max_seq_len)."""
    try:
        import onnx
    except ImportError:
        raise ExportError(
            "ONNX export needs the optional packages: pip install 'fitlm[export]' (onnx and onnxruntime)"
        ) from None
    cfg = loaded.config.model
    seq_len = seq_len or cfg.max_seq_len
    if not 1 <= seq_len <= cfg.max_seq_len:
        raise ExportError(f"--seq-len {seq_len} must be between 1 and model.max_seq_len ({cfg.max_seq_len})")
    out = Path(out).expanduser()
    if out.is_dir():
        raise ExportError(f"--out {out} is a directory; --format onnx writes one file, e.g. {out / 'model.onnx'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    example = torch.zeros(batch_size, seq_len, dtype=torch.long)
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "logits": {0: "batch", 1: "sequence"}} if dynamic_shape else None
    sdpa = _sdpa_for_onnx(F.scaled_dot_product_attention)
    shape = None if dynamic_shape else [batch_size, seq_len]
    meta = build_metadata(
        "onnx",
        loaded.path,
        {"dynamic_shape": dynamic_shape, "input_shape": shape, "max_seq_len": cfg.max_seq_len, "opset": OPSET},
    )
    # Initializers are stored as float32; the guard outside the atomic block: the partial file is gone first.
    needed = tensor_bytes(loaded.model.state_dict().values(), float_itemsize=4)
    with (
        disk_full_guard(out, needed + 1024 * 1024, "fitlm export --format onnx"),
        atomic_file(out) as tmp,
    ):  # never a half-written file at `out`
        with torch.no_grad(), warnings.catch_warnings(), mock.patch.object(F, "scaled_dot_product_attention", sdpa):
            warnings.simplefilter("ignore")  # tracer warnings about Python ints in shape checks
            torch.onnx.export(
                _LogitsOnly(loaded.model.eval()),
                (example,),
                str(tmp),
                input_names=["input_ids"],
                output_names=["logits"],
                dynamic_axes=axes,
                opset_version=OPSET,
                dynamo=False,
            )
        proto = onnx.load(str(tmp))
        entry = proto.metadata_props.add()
        entry.key, entry.value = META_KEY, json.dumps(meta)
        onnx.save(proto, str(tmp))
    return {
        "format": "onnx",
        "out": str(out),
        "dynamic_shape": dynamic_shape,
        "input_shape": shape,
        "bytes": out.stat().st_size,
        "source_sha256": meta["source_sha256"],
    }


def _session(path: Path):
    try:
        import onnxruntime as ort
    except ImportError:
        raise ExportError("running ONNX needs onnxruntime: pip install 'fitlm[export]'") from None
    if not path.is_file():
        raise ExportError(f"{path} does not exist; export one with `fitlm export MODEL --format onnx --out {path}`")
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def read_export_metadata(session_or_path: Any) -> dict[str, Any] | None:
    """The export record of an ONNX file or session (warns on an incompatible version), or None."""
    session = _session(Path(session_or_path)) if isinstance(session_or_path, (str, Path)) else session_or_path
    raw = session.get_modelmeta().custom_metadata_map.get(META_KEY)
    if raw is None:
        return None
    meta = json.loads(raw)
    check_metadata(meta, "ONNX model")
    return meta


def run_onnx(path: str | Path, input_ids: np.ndarray | torch.Tensor) -> np.ndarray:
    """Logits [B,T,V] of `input_ids` [B,T] in onnxruntime; a static export refuses another shape clearly."""
    path = Path(path)
    session = _session(path)
    ids = np.asarray(input_ids.cpu() if isinstance(input_ids, torch.Tensor) else input_ids, dtype=np.int64)
    if ids.ndim != 2:
        raise ONNXShapeError(f"input_ids must be 2-D [batch, sequence]; got shape {list(ids.shape)}")
    meta = read_export_metadata(session) or {}
    expected = meta.get("input_shape")
    if expected is not None and list(ids.shape) != list(expected):
        raise ONNXShapeError(
            f"{path} was exported with a static input shape {expected} but got {list(ids.shape)}; "
            f"pad/trim the input to that shape, or re-export with `--dynamic-shape`"
        )
    limit = meta.get("max_seq_len")
    if limit is not None and ids.shape[1] > limit:
        raise ONNXShapeError(f"{path}: sequence length {ids.shape[1]} exceeds the model's max_seq_len {limit}")
    return session.run(["logits"], {"input_ids": ids})[0]
