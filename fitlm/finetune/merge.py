"""`fitlm merge`: fold a LoRA adapter into its base model's weights (W + scale·B·A), giving a plain model."""

from __future__ import annotations

from pathlib import Path

from fitlm.finetune.errors import FinetuneError
from fitlm.finetune.lora import merge_lora, untied_for, with_weights
from fitlm.finetune.peft_format import load_adapter
from fitlm.finetune.qlora import as_trained, read_recipe
from fitlm.models.io import load_model_dir, save_model_dir


def merge_model(model: str | Path, adapter: str | Path, out: str | Path) -> dict:
    """Load MODEL (any MODEL path), merge the PEFT adapter in fp32, save a fitlm model directory at OUT."""
    loaded = load_model_dir(model)
    if loaded.source == "fitlm" and loaded.config.finetune.adapters:
        raise FinetuneError(
            f"{loaded.path} was written by a LoRA run, so its weights already include that run's adapter; merging "
            f"again would add it twice. Pass the base model instead"
            + (f" (that run's model.init_from: {loaded.config.model.init_from})" if loaded.config.model.init_from else ""))
    spec, tensors = load_adapter(adapter)
    # A QLoRA adapter was trained on the 4-bit base: fold it into the base as that run computed with it.
    base = as_trained(loaded.model.state_dict(), read_recipe(adapter))
    merged = merge_lora(base, tensors, spec.scaling, source=str(adapter))
    config = untied_for(loaded.config, tensors)  # a tied head the adapter adapts comes out untied
    model = with_weights(loaded.model, config.model, merged)
    save_model_dir(model, config, out, tokenizer_path=loaded.tokenizer_path, what="fitlm merge")
    return {"model": str(loaded.path), "adapter": str(adapter), "out": str(Path(out)), "modules": len(spec.modules),
            "r": spec.r, "scaling": spec.scaling}
