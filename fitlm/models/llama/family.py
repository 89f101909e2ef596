"""The Llama family (Llama 1-3.x, Mistral, SmolLM, TinyLlama ...): its torch `Family`, registered once here."""

from fitlm.models import counts
from fitlm.models.family import Family, GGUFNames, TPBlockPlan
from fitlm.models.hf import same_names_from_hf, same_names_to_hf
from fitlm.models.llama import hf
from fitlm.models.llama.model import LlamaForCausalLM
from fitlm.models.llama.spec import SPEC
from fitlm.registry import register_family

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# llama.cpp's names (gguf-py constants.py, MODEL_TENSORS[LLM_ARCH_LLAMA]).
GGUF_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

FAMILY = register_family(
    Family(
        spec=SPEC,
        model_cls=LlamaForCausalLM,
        hf_architecture="LlamaForCausalLM",
        config_from_hf=hf.config_from_hf,
        config_to_hf=hf.config_to_hf,
        to_hf=same_names_to_hf,
        from_hf=same_names_from_hf,
        planner=counts.rope_planner(bias=lambda cfg: bool(cfg.attention_bias)),
        tp_plan=TPBlockPlan(),
        lora_linears=LINEARS,
        gguf=GGUFNames("llama", GGUF_LAYER, GGUF_TOP, permute_qk=True),
    )
)
