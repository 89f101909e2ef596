"""The Qwen family units: Qwen2 / Qwen2.5 (`qwen2`) and Qwen3 (`qwen3`), registered once here."""

from fitlm.models import counts
from fitlm.models.family import Family, GGUFNames, TPBlockPlan, llama_ffn
from fitlm.models.hf import same_names_from_hf, same_names_to_hf
from fitlm.models.llama import GGUF_LAYER, GGUF_TOP, LINEARS
from fitlm.models.qwen import hf
from fitlm.models.qwen.model import Qwen2ForCausalLM, Qwen3ForCausalLM
from fitlm.registry import register_family


def _refuse_bias_off(cfg) -> list[str]:
    if cfg.attention_bias is False:
        return ["model.attention_bias: qwen2 always has q/k/v biases; leave it null (or use arch llama)"]
    return []


QWEN2 = register_family(
    Family(
        name="qwen2",
        model_cls=Qwen2ForCausalLM,
        hf_model_types=("qwen2",),
        hf_architecture="Qwen2ForCausalLM",
        config_from_hf=hf.qwen2_from_hf,
        config_to_hf=hf.qwen2_to_hf,
        to_hf=same_names_to_hf,
        from_hf=same_names_from_hf,
        default_ffn=llama_ffn,
        planner=counts.rope_planner(bias=True),
        tp_plan=TPBlockPlan(),
        lora_linears=LINEARS,
        validate=_refuse_bias_off,
        # llama.cpp's qwen2 adds attn_{q,k,v}.bias and does not permute q/k.
        gguf=GGUFNames("qwen2", GGUF_LAYER, GGUF_TOP),
        features=("q/k/v biases",),
    )
)

QWEN3 = register_family(
    Family(
        name="qwen3",
        model_cls=Qwen3ForCausalLM,
        hf_model_types=("qwen3",),
        hf_architecture="Qwen3ForCausalLM",
        config_from_hf=hf.qwen3_from_hf,
        config_to_hf=hf.qwen3_to_hf,
        to_hf=same_names_to_hf,
        from_hf=same_names_from_hf,
        default_ffn=llama_ffn,
        planner=counts.rope_planner(
            counts.with_qk_norm(counts.LLAMA_BYTES, counts.QK_NORM),
            qk_norm=True,
            bias=lambda cfg: bool(cfg.attention_bias),
        ),
        tp_plan=TPBlockPlan(),
        lora_linears=LINEARS,
        gguf=GGUFNames(
            "qwen3", {**GGUF_LAYER, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}, GGUF_TOP
        ),
        features=("per-head q/k RMSNorm", "head_dim independent of hidden_size"),
    )
)
