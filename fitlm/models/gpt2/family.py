"""The GPT-2 family: its torch `Family`, registered once here."""

from fitlm.models.family import BlockShape, Family, PlannerCounts, TPBlockPlan
from fitlm.models.gpt2 import hf
from fitlm.models.gpt2.model import GPT2LMHeadModel
from fitlm.models.gpt2.spec import SPEC
from fitlm.registry import register_family

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")


def _block(cfg) -> BlockShape:
    h, f = cfg.hidden_size, cfg.ffn_size
    linears = (
        ("q_proj", h, h),
        ("k_proj", h, h),
        ("v_proj", h, h),
        ("o_proj", h, h),
        ("up_proj", h, f),
        ("down_proj", f, h),
    )
    # biases of the four attention projections and both MLP linears, two LayerNorms (weight + shift)
    return BlockShape(linears, (("q_proj", "k_proj", "v_proj"), ("up_proj",)), 4 * h + f + h + 4 * h)


# LayerNorm saves its input and fp32 mean/rstd, no RoPE, plain MHA, 2-matrix GELU MLP:
# replicated x, n1, x1, n2; q, attention output; k, v; GELU input and output.
PLANNER = PlannerCounts(
    block=_block,
    embedding_params=lambda cfg: (cfg.vocab_size + cfg.max_seq_len) * cfg.hidden_size,
    head_norm_params=lambda cfg: 2 * cfg.hidden_size,
    block_bytes={"O0": (16, 8, 8, 8, 0), "O1": (16, 4, 4, 4, 0), "O2": (8, 4, 4, 4, 0), "O3": (8, 4, 4, 4, 0)},
    # the final LayerNorm's input and output (+4: its fp32 statistics); no RoPE tables
    outside_bytes={"O0": (12, 0), "O1": (8, 0), "O2": (8, 0), "O3": (8, 0)},
    rope=False,
    activation_finetune=False,
)

FAMILY = register_family(
    Family(
        spec=SPEC,
        model_cls=GPT2LMHeadModel,
        hf_architecture="GPT2LMHeadModel",
        config_from_hf=hf.config_from_hf,
        config_to_hf=hf.config_to_hf,
        to_hf=hf.to_hf,
        from_hf=hf.from_hf,
        planner=PLANNER,
        tp_plan=TPBlockPlan(),
        lora_linears=LINEARS,
    )
)
