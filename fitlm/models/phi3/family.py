"""The Phi-3 family (Phi-3-mini/medium, Phi-3.5-mini): its torch `Family`, registered once here."""

from fitlm.models import counts
from fitlm.models.family import Family, GGUFNames, TPBlockPlan
from fitlm.models.hf import same_names_from_hf, same_names_to_hf
from fitlm.models.llama.family import GGUF_TOP
from fitlm.models.phi3 import hf
from fitlm.models.phi3.model import Phi3ForCausalLM, fuse_state_dict, split_fused, split_state_dict
from fitlm.models.phi3.spec import SPEC
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


def _to_hf(sd, cfg, source: str = "state dict"):
    return same_names_to_hf(fuse_state_dict(sd), cfg, source)


FAMILY = register_family(
    Family(
        spec=SPEC,
        model_cls=Phi3ForCausalLM,
        hf_architecture="Phi3ForCausalLM",
        config_from_hf=hf.config_from_hf,
        config_to_hf=hf.config_to_hf,
        to_hf=_to_hf,
        from_hf=same_names_from_hf,
        planner=counts.rope_planner(fused=True),
        # Tensor parallel splits the fused matrices first (split_fused): a row shard of [q; k; v] would mix heads.
        tp_plan=TPBlockPlan(),
        prepare_tensor_parallel=split_fused,
        prepare_state_dict=split_state_dict,
        lora_linears=LINEARS,
        gguf=GGUFNames("phi3", GGUF_LAYER, GGUF_TOP),
    )
)
