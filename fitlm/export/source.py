"""The model to export: any MODEL path, with a LoRA adapter merged in first when one is given.

Exports hold plain weights only: runtimes (llama.cpp, onnxruntime, vLLM) know nothing of adapters.
"""

from __future__ import annotations

from pathlib import Path

from fitlm.export.errors import ExportError
from fitlm.models.io import LoadedModel, load_model_dir


def load_for_export(model: str | Path, adapter: str | Path | None = None) -> LoadedModel:
    """Load MODEL in fp32; merge `adapter` (PEFT directory) into it, refusing one made for another base."""
    loaded = load_model_dir(model)
    if adapter is None:
        return loaded
    from fitlm.finetune.lora import merge_lora
    from fitlm.finetune.peft_format import load_adapter

    if loaded.source == "fitlm" and loaded.config.finetune.method == "lora":
        raise ExportError(f"{loaded.path} was written by a LoRA run and already includes its adapter; "
                          f"export it without --adapter, or pass the base model with --adapter")
    spec, tensors = load_adapter(adapter)  # LoraError (a ValueError) on a malformed adapter
    merged = merge_lora(loaded.model.state_dict(), tensors, spec.scaling, source=str(adapter))
    loaded.model.load_state_dict(merged)
    return loaded
