"""`fitlm merge`: fold a LoRA adapter into its base model's weights (W + scale·B·A), giving a plain model.

Streamed block by block (fitlm.finetune.adapted.StreamedModel): each block is read, cast to fp32, merged with
its own adapters and written before the next is read, so merging a 7B base needs a block of memory, not 28 GB.
"""

from __future__ import annotations

from pathlib import Path

from fitlm.finetune.adapted import StreamedModel, read_adapter
from fitlm.finetune.errors import FinetuneError
from fitlm.models.io import open_model, write_model_dir


def merge_model(model: str | Path, adapter: str | Path, out: str | Path) -> dict:
    """MODEL (any MODEL path) with the PEFT adapter merged in fp32 (a QLoRA adapter onto the base as its run
    computed with it), written as a fitlm model directory at OUT."""
    src = open_model(model)
    if src.source == "fitlm" and src.config.finetune.adapters:
        raise FinetuneError(
            f"{src.path} was written by a LoRA run, so its weights already include that run's adapter; merging "
            f"again would add it twice. Pass the base model instead"
            + (f" (that run's model.init_from: {src.config.model.init_from})" if src.config.model.init_from else "")
        )
    lora = read_adapter(adapter)
    merged = StreamedModel(src, lora)
    specs, tensors = merged.hf_weights()  # an adapter made for another base is refused here, before any write
    write_model_dir(specs, tensors, merged.config, out, tokenizer_path=src.tokenizer_path, what="fitlm merge")
    return {
        "model": str(src.path),
        "adapter": str(adapter),
        "out": str(Path(out)),
        "modules": len(lora.spec.modules),
        "r": lora.spec.r,
        "scaling": lora.scaling,
    }
