"""The Qwen families: Qwen2 / Qwen2.5 (`qwen2`) and Qwen3 (`qwen3`), their torch `Family` records registered
once here."""

from fitlm.models import counts
from fitlm.models.family import Family, GGUFNames, TPBlockPlan
from fitlm.models.hf import same_names_from_hf, same_names_to_hf
from fitlm.models.llama.family import GGUF_LAYER, GGUF_TOP, LINEARS
from fitlm.models.qwen import hf
from fitlm.models.qwen.model import Qwen2ForCausalLM, Qwen3ForCausalLM
from fitlm.models.qwen.spec import QWEN2 as QWEN2_SPEC
from fitlm.models.qwen.spec import QWEN3 as QWEN3_SPEC
from fitlm.registry import register_family

QWEN2 = register_family(
    Family(
        spec=QWEN2_SPEC,
        model_cls=Qwen2ForCausalLM,
        hf_architecture="Qwen2ForCausalLM",
        config_from_hf=hf.qwen2_from_hf,
        config_to_hf=hf.qwen2_to_hf,
        to_hf=same_names_to_hf,
        from_hf=same_names_from_hf,
        planner=counts.rope_planner(bias=True),
        tp_plan=TPBlockPlan(),
        lora_linears=LINEARS,
        # llama.cpp's qwen2 adds attn_{q,k,v}.bias and does not permute q/k.
        gguf=GGUFNames("qwen2", GGUF_LAYER, GGUF_TOP),
    )
)

QWEN3 = register_family(
    Family(
        spec=QWEN3_SPEC,
        model_cls=Qwen3ForCausalLM,
        hf_architecture="Qwen3ForCausalLM",
        config_from_hf=hf.qwen3_from_hf,
        config_to_hf=hf.qwen3_to_hf,
        to_hf=same_names_to_hf,
        from_hf=same_names_from_hf,
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
    )
)
