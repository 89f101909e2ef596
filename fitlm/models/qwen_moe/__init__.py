"""The Qwen mixture-of-experts family units: Qwen3-MoE (`qwen3_moe`) and Qwen1.5/Qwen2-MoE (`qwen2_moe`)."""

from fitlm.models import counts
from fitlm.models.family import Family, GGUFNames, TPBlockPlan, llama_ffn
from fitlm.models.llama import GGUF_LAYER, GGUF_TOP
from fitlm.models.moe_gguf import ROUTER, SHARED, moe_reader, moe_writer
from fitlm.models.qwen_moe import hf
from fitlm.models.qwen_moe.model import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from fitlm.registry import register_family

# LoRA adapts attention only on MoE models (fitlm.finetune.lora.resolve_targets says why).
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MOE_FEATURES = ("mixture of experts: fp32 top-k router, stacked experts, dropless", "dense layers among sparse ones")


# llama.cpp's attention and norm names (its llama layer table without the dense MLP) plus the router
ATTENTION_GGUF = {k: v for k, v in GGUF_LAYER.items() if not k.startswith("ffn_") or k == "ffn_norm"}


def _no_shared_expert(cfg) -> list[str]:
    if cfg.shared_expert_intermediate_size:
        return ["model.shared_expert_intermediate_size: qwen3_moe has no shared expert (qwen2_moe has); set it null"]
    return []


def _needs_shared_expert(cfg) -> list[str]:
    if not cfg.shared_expert_intermediate_size:
        return ["model.shared_expert_intermediate_size: every qwen2_moe has a shared expert; give its width (e.g. 4·I)"]
    return []


QWEN3_MOE = register_family(
    Family(
        name="qwen3_moe",
        model_cls=Qwen3MoeForCausalLM,
        hf_model_types=("qwen3_moe",),
        hf_architecture="Qwen3MoeForCausalLM",
        config_from_hf=hf.qwen3_moe_from_hf,
        config_to_hf=hf.qwen3_moe_to_hf,
        to_hf=hf.to_hf,
        from_hf=hf.from_hf,
        default_ffn=llama_ffn,
        planner=counts.moe_planner(
            counts.with_qk_norm(counts.LLAMA_BYTES, counts.QK_NORM),
            qk_norm=True,
            bias=lambda cfg: bool(cfg.attention_bias),
        ),
        tp_plan=TPBlockPlan(),
        lora_linears=ATTENTION,
        validate=_no_shared_expert,
        gguf=GGUFNames(
            "qwen3moe",
            {**ATTENTION_GGUF, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", **ROUTER},
            GGUF_TOP,
            read_extra=moe_reader(normalized=True, expert_width=True, shared=False),
            write_extra=moe_writer("qwen3moe", normalized=True, expert_width=True, shared=False),
            experts=hf.NAMES,
        ),
        features=("per-head q/k RMSNorm", *MOE_FEATURES),
        tensor_parallel=False,
        pipeline_parallel=False,
        moe=True,
    )
)

QWEN2_MOE = register_family(
    Family(
        name="qwen2_moe",
        model_cls=Qwen2MoeForCausalLM,
        hf_model_types=("qwen2_moe",),
        hf_architecture="Qwen2MoeForCausalLM",
        config_from_hf=hf.qwen2_moe_from_hf,
        config_to_hf=hf.qwen2_moe_to_hf,
        to_hf=hf.to_hf,
        from_hf=hf.from_hf,
        default_ffn=llama_ffn,
        planner=counts.moe_planner(bias=lambda cfg: cfg.attention_bias is not False),
        tp_plan=TPBlockPlan(),
        lora_linears=ATTENTION,
        validate=_needs_shared_expert,
        gguf=GGUFNames(
            "qwen2moe",
            {**ATTENTION_GGUF, **ROUTER, **SHARED},
            GGUF_TOP,
            read_extra=moe_reader(normalized=False, expert_width=True, shared=True),
            write_extra=moe_writer("qwen2moe", normalized=False, expert_width=True, shared=True),
            experts=hf.NAMES,
        ),
        features=("q/k/v biases", "sigmoid-gated shared expert", *MOE_FEATURES),
        tensor_parallel=False,
        pipeline_parallel=False,
        moe=True,
    )
)
