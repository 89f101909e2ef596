"""What a model family is: one record holding everything that differs between families.

Each folder under fitlm/models/ (llama/, qwen/, gemma/, phi3/, gpt2/ ...) states what the config schema
needs in its torch-free `spec.py` (`FamilySpec`, fitlm.models.family_spec) and builds its `Family`
records around those specs in its `family.py`, registered once (`fitlm.registry.register_family`);
nothing outside fitlm/models/ asks which family a model is. Adding a family: see docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from fitlm.config import ModelConfig
from fitlm.models.family_spec import FamilySpec
from fitlm.models.hf import StateDict
from fitlm.models.moe_hf import ExpertNames


@dataclass(frozen=True)
class GGUFNames:
    """How llama.cpp names this family: `general.architecture`, tensor names, metadata quirks.

    `layer` maps llama.cpp's per-block tensor base (`attn_q`) to fitlm's module path in a block
    (`self_attn.q_proj`); `top` does the same outside the blocks. `permute_qk`: llama.cpp's converter
    permutes q/k rows for its `llama` architecture only. `norm_offset`: Gemma's converter stores
    RMSNorm weights as 1 + w. `head_is_embedding`: the architecture's loader has no separate output head.
    """

    arch: str
    layer: Mapping[str, str]
    top: Mapping[str, str]
    permute_qk: bool = False
    norm_offset: float = 0.0
    # llama.cpp's architecture reads no output.weight (its head is token_embd): an untied model has no GGUF form.
    head_is_embedding: bool = False
    # Family metadata beyond the common keys: read(get) -> ModelConfig fields, where get(key, default)
    # reads "<arch>.<key>"; write(cfg) -> {key: value} written as "<arch>.<key>".
    read_extra: Callable[[Callable], dict] = lambda get: {}
    write_extra: Callable[[ModelConfig], dict] = lambda cfg: {}
    # MoE: how the family's HF checkpoints name a layer's per-expert weights; llama.cpp stacks them as
    # blk.N.ffn_{gate,up,down}_exps ([E, out, in], as fitlm holds them).
    experts: ExpertNames | None = None


@dataclass(frozen=True)
class BlockShape:
    """One block's parameter-bearing pieces, as the planner counts them (per block, unsharded).

    `linears`: (name, in, out) of every matmul a LoRA may target, under the family's own module names;
    `input_groups`: linears that read the same input (their saved input is shared); `extra_params`:
    norms, biases and other parameters outside those matmuls.
    """

    linears: tuple[tuple[str, int, int], ...]
    input_groups: tuple[tuple[str, ...], ...]
    extra_params: int

    @property
    def params(self) -> int:
        return sum(i * o for _, i, o in self.linears) + self.extra_params


@dataclass(frozen=True)
class PlannerCounts:
    """What `fitlm plan` needs to know about a family beyond the config's sizes.

    `block(cfg)`: the block's linears and parameters; `embedding_params(cfg)` / `head_norm_params(cfg)`:
    the token (and position) embeddings and the final norm; `block_bytes[level]`: saved activation
    bytes per token of one block as coefficients of (replicated h, head-sharded h, kv, ffn, head_dim),
    counted from the tensors its backward keeps (see fitlm.plan.analytic); `outside_bytes[level]`:
    the final norm and RoPE gathers as (h, head_dim) coefficients; `rope`: has cos/sin tables;
    `activation_finetune`: LoRA/freeze savings per block follow the pre-norm Llama block's rules;
    `dense_block(cfg)`: an MoE family's dense block among routed ones.
    """

    block: Callable[[ModelConfig], BlockShape]
    embedding_params: Callable[[ModelConfig], int]
    head_norm_params: Callable[[ModelConfig], int]
    block_bytes: Mapping[str, tuple[float, float, float, float, float]]
    outside_bytes: Mapping[str, tuple[float, float]]
    rope: bool = True
    activation_finetune: bool = True
    # An MoE family's dense block, which blocks among the routed ones keep (model.mlp_only_layers,
    # decoder_sparse_step); None: every block is `block`.
    dense_block: Callable[[ModelConfig], BlockShape] | None = None


@dataclass(frozen=True)
class TPBlockPlan:
    """A block's tensor-parallel roles by module path (fitlm.parallel.tensor_parallel turns them into styles).

    `norms` act on the residual stream (replicated, or on sequence shards); `inputs` are sub-blocks whose
    first argument is gathered to the full sequence; `colwise` / `rowwise` are the Megatron split;
    `head_norms` act per head on [B,T,heads,D] (Qwen3/Gemma 3 q/k norms: sharded over heads, weight replicated);
    `post_norms` normalise a sub-block's output before the residual add (Gemma), so they return plain tensors.
    Paths a block does not have are skipped.
    """

    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    inputs: tuple[str, ...] = ("self_attn", "mlp")
    colwise: tuple[str, ...] = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
    )
    rowwise: tuple[str, ...] = ("self_attn.o_proj", "mlp.down_proj")
    head_norms: tuple[str, ...] = ("self_attn.q_norm", "self_attn.k_norm")
    post_norms: tuple[str, ...] = ()  # norms on a sub-block's output, added to the residual (Gemma): local output


@dataclass(frozen=True)
class Family:
    """A family's torch side around its spec: `spec` holds the name, HF model types, defaults, refusals and
    flags config validation reads (so they are stated once); the rest is what building, converting,
    planning and splitting the model needs."""

    spec: FamilySpec  # name (model.arch), HF model types, MLP width and layer pattern, validate, TP/PP/MoE
    model_cls: type  # plain nn.Module, built as model_cls(ModelConfig)
    hf_architecture: str  # config.json "architectures" entry written on export
    config_from_hf: Callable[[Mapping[str, Any], str], ModelConfig]
    config_to_hf: Callable[[ModelConfig], dict[str, Any]] | None
    to_hf: Callable[..., StateDict]  # (fitlm state dict, cfg[, source]) -> HF names and layouts
    from_hf: Callable[..., StateDict]  # (HF state dict, cfg, source) -> complete fitlm state dict
    planner: PlannerCounts
    tp_plan: TPBlockPlan
    lora_linears: tuple[str, ...]  # leaf names of a block's linears ("all-linear" and the defaults)
    gguf: GGUFNames | None = None
    # Module surgery before tensor parallel (Phi-3 splits its fused projections); fitlm.parallel.apply also runs
    # it in every other layout except LoRA, so checkpoints reshard. Names then differ from HF's: `to_hf`
    # accepts both forms.
    prepare_tensor_parallel: Callable[[Any], None] | None = None
    # The same surgery on weights: (state dict under the module's names, cfg) -> the prepared module's names.
    # A model built on the meta device is prepared before it holds weights, so its weights arrive through this.
    prepare_state_dict: Callable[[StateDict, ModelConfig], StateDict] | None = None
