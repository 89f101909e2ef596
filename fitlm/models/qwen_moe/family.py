"""The Qwen mixture-of-experts families: Qwen3-MoE (`qwen3_moe`) and Qwen1.5/Qwen2-MoE (`qwen2_moe`), their torch
`Family` records registered once here."""

from fitlm.models import counts
from fitlm.models.family import Family, GGUFNames, TPBlockPlan
from fitlm.models.llama.family import GGUF_LAYER, GGUF_TOP
from fitlm.models.moe_gguf import ROUTER, SHARED, moe_reader, moe_writer
from fitlm.models.qwen_moe import hf
from fitlm.models.qwen_moe.model import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from fitlm.models.qwen_moe.spec import QWEN2_MOE as QWEN2_MOE_SPEC
from fitlm.models.qwen_moe.spec import QWEN3_MOE as QWEN3_MOE_SPEC
from fitlm.registry import register_family

# LoRA adapts attention only on MoE models (fitlm.finetune.lora.resolve_targets says why).
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERT_LINEARS = ("gate_proj", "up_proj", "down_proj")  # LoRA on every expert (fitlm.finetune.expert_lora)


# llama.cpp's attention and norm names (its llama layer table without the dense MLP) plus the router
ATTENTION_GGUF = {k: v for k, v in GGUF_LAYER.items() if not k.startswith("ffn_") or k == "ffn_norm"}


QWEN3_MOE = register_family(
    Family(
        spec=QWEN3_MOE_SPEC,
        model_cls=Qwen3MoeForCausalLM,
        hf_architecture="Qwen3MoeForCausalLM",
        config_from_hf=hf.qwen3_moe_from_hf,
        config_to_hf=hf.qwen3_moe_to_hf,
        to_hf=hf.to_hf,
        from_hf=hf.from_hf,
        planner=counts.moe_planner(
            counts.with_qk_norm(counts.LLAMA_BYTES, counts.QK_NORM),
            qk_norm=True,
            bias=lambda cfg: bool(cfg.attention_bias),
        ),
        tp_plan=TPBlockPlan(),
        lora_linears=ATTENTION + EXPERT_LINEARS,
        gguf=GGUFNames(
            "qwen3moe",
            {**ATTENTION_GGUF, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", **ROUTER},
            GGUF_TOP,
            read_extra=moe_reader(normalized=True, expert_width=True, shared=False),
            write_extra=moe_writer("qwen3moe", normalized=True, expert_width=True, shared=False),
            experts=hf.NAMES,
        ),
    )
)

QWEN2_MOE = register_family(
    Family(
        spec=QWEN2_MOE_SPEC,
        model_cls=Qwen2MoeForCausalLM,
        hf_architecture="Qwen2MoeForCausalLM",
        config_from_hf=hf.qwen2_moe_from_hf,
        config_to_hf=hf.qwen2_moe_to_hf,
        to_hf=hf.to_hf,
        from_hf=hf.from_hf,
        planner=counts.moe_planner(bias=lambda cfg: cfg.attention_bias is not False),
        tp_plan=TPBlockPlan(),
        lora_linears=ATTENTION + EXPERT_LINEARS + ("shared_expert_gate",),
        gguf=GGUFNames(
            "qwen2moe",
            {**ATTENTION_GGUF, **ROUTER, **SHARED},
            GGUF_TOP,
            read_extra=moe_reader(normalized=False, expert_width=True, shared=True),
            write_extra=moe_writer("qwen2moe", normalized=False, expert_width=True, shared=True),
            experts=hf.NAMES,
        ),
    )
)
