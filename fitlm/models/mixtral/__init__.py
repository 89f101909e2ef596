"""The Mixtral family unit (Mixtral 8x7B, 8x22B and their fine-tunes): registered once here."""

from fitlm.models import counts
from fitlm.models.family import Family, TPBlockPlan, llama_ffn
from fitlm.models.mixtral import hf
from fitlm.models.mixtral.model import MixtralForCausalLM
from fitlm.models.qwen_moe import ATTENTION, MOE_FEATURES
from fitlm.registry import register_family

FAMILY = register_family(
    Family(
        name="mixtral",
        model_cls=MixtralForCausalLM,
        hf_model_types=("mixtral",),
        hf_architecture="MixtralForCausalLM",
        config_from_hf=hf.config_from_hf,
        config_to_hf=hf.config_to_hf,
        to_hf=hf.to_hf,
        from_hf=hf.from_hf,
        default_ffn=llama_ffn,
        planner=counts.moe_planner(),
        tp_plan=TPBlockPlan(),
        lora_linears=ATTENTION,
        validate=hf.validate,
        features=("sliding window", MOE_FEATURES[0], "top-k weights renormalized"),
        tensor_parallel=False,
        pipeline_parallel=False,
        moe=True,
    )
)
