"""`fitlm ckpt inspect`: what a checkpoint holds, read from its metadata and DCP's index (no tensor data)."""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fitlm.checkpoint import store
from fitlm.checkpoint.merge import resolve_checkpoint


def inspect_checkpoint(path: str | Path) -> dict:
    ckpt = resolve_checkpoint(path)
    meta = store.read_meta(ckpt)  # verifies every file's size
    md = store.read_dcp_metadata(ckpt)
    counts: dict[str, dict[str, int]] = {}
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        part = key.split(".", 1)[0]
        c = counts.setdefault(part, {"tensors": 0, "elements": 0, "bytes": 0})
        n = entry.size.numel()
        c["tensors"] += 1
        c["elements"] += n
        c["bytes"] += n * entry.properties.dtype.itemsize
    files = meta.get("files", {})
    siblings = [s for s, _ in store.list_checkpoints(ckpt.parent)]
    return {
        "path": str(ckpt),
        "step": meta["step"],
        "layout": meta["layout"],
        "complete": True,
        "created": meta.get("created"),
        "fitlm_version": meta.get("fitlm_version"),
        "torch_version": meta.get("torch_version"),
        "tokenizer_sha256": meta.get("tokenizer_sha256"),
        "bytes": sum(files.values()),
        "files": files,
        "contents": counts,
        "params": counts.get("model", {}).get("elements", 0),
        "extras": meta.get("extras", []),
        "checkpoints_in_run": siblings,
        "config": meta.get("config"),
    }
