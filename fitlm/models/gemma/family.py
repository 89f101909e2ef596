"""The Gemma families: Gemma 2 (`gemma2`) and Gemma 3 text (`gemma3`), their torch `Family` records registered
once here."""

from fitlm.models import counts
from fitlm.models.family import Family, GGUFNames, TPBlockPlan
from fitlm.models.gemma import hf
from fitlm.models.gemma.model import Gemma2ForCausalLM, Gemma3ForCausalLM
from fitlm.models.gemma.spec import GEMMA2 as GEMMA2_SPEC
from fitlm.models.gemma.spec import GEMMA3 as GEMMA3_SPEC
from fitlm.models.hf import HFFormatError, same_names_from_hf, same_names_to_hf
from fitlm.models.llama.family import GGUF_TOP, LINEARS
from fitlm.registry import register_family

TP = TPBlockPlan(
    norms=("input_layernorm", "pre_feedforward_layernorm"),
    post_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
)
# llama.cpp's gemma2/gemma3 names: the MLP's pre-norm is ffn_norm, the post-norms are *_post_norm.
GGUF_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def _gguf_read(get, largest_layers: int) -> dict:
    """Gemma's metadata beyond the common keys. llama.cpp has no query_pre_attn_scalar key: it scales by
    head_dim, except for the 27B models (hidden/heads); fitlm's own exports also write the exact value."""
    heads, hidden, layers = get("attention.head_count"), get("embedding_length"), get("block_count")
    default = hidden // heads if layers == largest_layers else get("attention.key_length", hidden // heads)
    out: dict[str, int | float] = {"query_pre_attn_scalar": int(get("attention.query_pre_attn_scalar", default))}
    for ours, key in (
        ("attn_logit_softcap", "attn_logit_softcapping"),
        ("final_logit_softcap", "final_logit_softcapping"),
    ):
        if get(key):
            out[ours] = float(get(key))
    return out


def _llama_cpp_scalar(cfg, largest_layers: int) -> int:
    """The score scale llama.cpp's gemma2/gemma3 graphs use (they read no key for it): head_dim, except at the
    27B size (hidden / heads)."""
    return cfg.hidden_size // cfg.num_heads if cfg.num_layers == largest_layers else cfg.head_size


def _gguf_writer(largest_layers: int):
    def write(cfg) -> dict:
        scalar = cfg.query_pre_attn_scalar or cfg.head_size
        if scalar != _llama_cpp_scalar(cfg, largest_layers):
            raise HFFormatError(
                f"GGUF export: model.query_pre_attn_scalar is {scalar}, but llama.cpp's Gemma graphs "
                f"scale attention scores by {_llama_cpp_scalar(cfg, largest_layers)}^-1/2 (the head size; "
                "hidden/heads at the 27B size) and read no key for it, so llama.cpp would compute other "
                "logits; export with --format hf, or train with query_pre_attn_scalar equal to the head "
                "size"
            )
        return _gguf_write(cfg, scalar)

    return write


def _gguf_write(cfg, scalar: int) -> dict:
    out: dict[str, int | float] = {"attention.query_pre_attn_scalar": scalar}
    if cfg.attn_logit_softcap:
        out["attn_logit_softcapping"] = float(cfg.attn_logit_softcap)
    if cfg.final_logit_softcap:
        out["final_logit_softcapping"] = float(cfg.final_logit_softcap)
    if cfg.rope_local_theta is not None:
        out["rope.freq_base_swa"] = float(cfg.rope_local_theta)
    return out


def _gguf_read3(get) -> dict:
    return {**_gguf_read(get, 62), "rope_local_theta": float(get("rope.freq_base_swa", 10000.0))}


GEMMA2 = register_family(
    Family(
        spec=GEMMA2_SPEC,
        model_cls=Gemma2ForCausalLM,
        hf_architecture="Gemma2ForCausalLM",
        config_from_hf=hf.gemma2_from_hf,
        config_to_hf=hf.gemma2_to_hf,
        to_hf=same_names_to_hf,
        from_hf=same_names_from_hf,
        planner=counts.rope_planner(counts.GEMMA_BYTES, norms=4),
        tp_plan=TP,
        lora_linears=LINEARS,
        gguf=GGUFNames(
            "gemma2",
            GGUF_LAYER,
            GGUF_TOP,
            norm_offset=1.0,
            head_is_embedding=True,
            read_extra=lambda get: _gguf_read(get, 46),
            write_extra=_gguf_writer(46),
        ),
    )
)

GEMMA3 = register_family(
    Family(
        spec=GEMMA3_SPEC,
        model_cls=Gemma3ForCausalLM,
        hf_architecture="Gemma3ForCausalLM",
        config_from_hf=hf.gemma3_from_hf,
        config_to_hf=hf.gemma3_to_hf,
        to_hf=same_names_to_hf,
        from_hf=hf.gemma3_from_hf_state_dict,
        planner=counts.rope_planner(
            counts.with_qk_norm(counts.GEMMA_BYTES, counts.QK_NORM_UNIT_OFFSET), norms=4, qk_norm=True
        ),
        tp_plan=TP,
        lora_linears=LINEARS,
        gguf=GGUFNames(
            "gemma3",
            {**GGUF_LAYER, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
            GGUF_TOP,
            norm_offset=1.0,
            read_extra=_gguf_read3,
            write_extra=_gguf_writer(62),
        ),
    )
)
