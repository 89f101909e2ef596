"""The Phi-3 family unit (Phi-3-mini/medium, Phi-3.5-mini), registered once here."""

from fitlm.models import counts
from fitlm.models.family import Family, GGUFNames, TPBlockPlan, llama_ffn
from fitlm.models.hf import same_names_from_hf, same_names_to_hf
from fitlm.models.llama import GGUF_TOP
from fitlm.models.phi3 import hf
from fitlm.models.phi3.model import Phi3ForCausalLM, fuse_state_dict, split_fused, split_state_dict
from fitlm.registry import register_family

LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
GGUF_LAYER = {
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _layer_types_uniform(cfg) -> list[str]:
    if cfg.sliding_window is not None and len({cfg.layer_type(i) for i in range(cfg.num_layers)}) > 1:
        return ["model.layer_types: phi3 slides every layer or none; leave layer_types null"]
    return []


def _to_hf(sd, cfg, source: str = "state dict"):
    return same_names_to_hf(fuse_state_dict(sd), cfg, source)


FAMILY = register_family(
    Family(
        name="phi3",
        model_cls=Phi3ForCausalLM,
        hf_model_types=("phi3",),
        hf_architecture="Phi3ForCausalLM",
        config_from_hf=hf.config_from_hf,
        config_to_hf=hf.config_to_hf,
        to_hf=_to_hf,
        from_hf=same_names_from_hf,
        default_ffn=llama_ffn,
        planner=counts.rope_planner(fused=True),
        # Tensor parallel splits the fused matrices first (split_fused): a row shard of [q; k; v] would mix heads.
        tp_plan=TPBlockPlan(),
        prepare_tensor_parallel=split_fused,
        prepare_state_dict=split_state_dict,
        lora_linears=LINEARS,
        validate=_layer_types_uniform,
        gguf=GGUFNames("phi3", GGUF_LAYER, GGUF_TOP),
        features=("fused qkv_proj and gate_up_proj (HF/PEFT names)", "LongRoPE"),
    )
)
