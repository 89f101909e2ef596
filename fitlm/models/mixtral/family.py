"""The Mixtral family (Mixtral 8x7B, 8x22B and their fine-tunes): its torch `Family`, registered once here."""

from fitlm.models import counts
from fitlm.models.family import Family, GGUFNames, TPBlockPlan
from fitlm.models.llama.family import GGUF_TOP
from fitlm.models.mixtral import hf
from fitlm.models.mixtral.model import MixtralForCausalLM
from fitlm.models.mixtral.spec import SPEC
from fitlm.models.moe_gguf import moe_reader, moe_writer
from fitlm.models.qwen_moe.family import ATTENTION, ATTENTION_GGUF
from fitlm.registry import register_family

FAMILY = register_family(
    Family(
        spec=SPEC,
        model_cls=MixtralForCausalLM,
        hf_architecture="MixtralForCausalLM",
        config_from_hf=hf.config_from_hf,
        config_to_hf=hf.config_to_hf,
        to_hf=hf.to_hf,
        from_hf=hf.from_hf,
        planner=counts.moe_planner(),
        tp_plan=TPBlockPlan(),
        lora_linears=ATTENTION + ("w1", "w3", "w2"),  # the experts by their HF names (fitlm.finetune.expert_lora)
        # llama.cpp reads Mixtral as its `llama` architecture with experts (q/k rows permuted, as for Llama);
        # a GGUF file of that architecture with an expert_count is imported as mixtral.
        gguf=GGUFNames(
            "llama",
            {**ATTENTION_GGUF, "ffn_gate_inp": "block_sparse_moe.gate"},
            GGUF_TOP,
            permute_qk=True,
            read_extra=moe_reader(normalized=None, expert_width=False, shared=False),
            write_extra=moe_writer("llama", normalized=None, expert_width=False, shared=False),
            experts=hf.NAMES,
        ),
    )
)
