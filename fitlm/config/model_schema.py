"""The model section of the schema: `ModelConfig` (the network's shape and its family, `model.arch`) and
`RopeScalingConfig`. A family's defaults (MLP width, sliding-window pattern) come from its torch-free spec
(fitlm.models.family_spec), so reading them imports no model code.

Each field's docstring is its user-facing help (docs/config.md is rendered from them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field

from fitlm import registry
from fitlm.config.base import Section

if TYPE_CHECKING:
    from fitlm.models.family_spec import FamilySpec


class RopeScalingConfig(Section):
    """RoPE frequency scaling, as transformers defines each type (its `rope_scaling` / `rope_parameters`)."""

    type: Literal["linear", "dynamic", "yarn", "llama3", "longrope"] = "linear"
    """`linear` (positions / factor), `dynamic` (NTK base growing past max_seq_len), `yarn`, `llama3` (Llama 3.1+), `longrope` (Phi-3 128k / Phi-3.5)."""
    factor: float | None = None
    """Context extension factor (yarn/longrope: null = max_seq_len / original_max_seq_len)."""
    original_max_seq_len: int | None = None
    """Context length of pretraining (llama3, yarn, longrope); null = model.max_seq_len."""
    low_freq_factor: float | None = None
    """llama3: wavelengths above original_max_seq_len / low_freq_factor are scaled by 1/factor."""
    high_freq_factor: float | None = None
    """llama3: wavelengths below original_max_seq_len / high_freq_factor are kept; between, interpolated."""
    beta_fast: float | None = None
    """yarn: rotations bounding extrapolation (null = 32)."""
    beta_slow: float | None = None
    """yarn: rotations bounding interpolation (null = 1)."""
    attention_factor: float | None = None
    """yarn/longrope: scale of cos/sin; null = the type's formula from factor (and mscale)."""
    mscale: float | None = None
    """yarn: numerator mscale of the attention factor (DeepSeek-style configs)."""
    mscale_all_dim: float | None = None
    """yarn: denominator mscale of the attention factor."""
    truncate: bool = True
    """yarn: round the correction range to whole dimensions."""
    short_factor: list[float] | None = None
    """longrope: per-frequency divisors used up to original_max_seq_len."""
    long_factor: list[float] | None = None
    """longrope: per-frequency divisors used once a sequence is longer than original_max_seq_len."""


class ModelConfig(Section):
    arch: str = "llama"
    """Registered model family (fitlm/models/<family>/); the README's model families table lists them all."""
    hidden_size: Annotated[int, Field(ge=1)] = 256
    """Width of the residual stream."""
    num_layers: Annotated[int, Field(ge=1)] = 4
    """Number of transformer blocks."""
    num_heads: Annotated[int, Field(ge=1)] = 4
    """Attention heads."""
    num_kv_heads: Annotated[int | None, Field(ge=1)] = None
    """Key/value heads for grouped-query attention; must divide num_heads. null = num_heads (plain MHA)."""
    head_dim: Annotated[int | None, Field(ge=1)] = None
    """Width of one attention head; null = hidden_size / num_heads (Qwen3 and Gemma set it independently)."""
    intermediate_size: int | None = None
    """MLP inner width. null = the family default (llama: 8/3·hidden rounded up to 256; gpt2: 4·hidden)."""
    vocab_size: Annotated[int, Field(ge=1)] = 32000
    """Embedding rows; must be at least the tokenizer's vocabulary size."""
    max_seq_len: Annotated[int, Field(ge=1)] = 2048
    """Longest sequence the model supports (RoPE table / learned position embeddings)."""
    rope_theta: float = 10000.0
    """RoPE base frequency (of the global-attention layers, for Gemma 3)."""
    rope_scaling: RopeScalingConfig | None = None
    """RoPE scaling of the global-attention layers; null = plain RoPE."""
    rope_local_theta: float | None = None
    """Gemma 3: RoPE base of the sliding-window layers (unscaled); null = rope_theta."""
    attention_bias: bool | None = None
    """Biases on q/k/v (and o, where the family has one); null = the family's default (qwen2 and gpt2 yes, others no)."""
    sliding_window: Annotated[int | None, Field(ge=1)] = None
    """Keys a sliding-window layer sees (itself included); null = no sliding-window layers."""
    layer_types: list[Literal["full", "sliding"]] | None = None
    """Attention of each block with sliding_window set; null = the family's pattern (gemma2 alternates, gemma3 five sliding then one full, others all sliding)."""
    query_pre_attn_scalar: int | None = None
    """Attention scores are scaled by query_pre_attn_scalar^-1/2 (Gemma); null = head_dim."""
    attn_logit_softcap: float | None = None
    """Gemma 2: attention scores become cap·tanh(score/cap); null = none."""
    final_logit_softcap: float | None = None
    """Gemma 2: logits become cap·tanh(logit/cap); null = none."""
    tie_embeddings: bool = False
    """Share the input embedding matrix with the output projection."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm (llama) or LayerNorm (gpt2)."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    init_from: str | None = None
    """Start from these weights: a fitlm model directory, a Hugging Face safetensors directory or a GGUF file."""
    # mixture of experts (the families qwen3_moe, qwen2_moe, mixtral), under transformers' names
    num_experts: Annotated[int | None, Field(ge=1)] = None
    """Routed experts of each MoE layer (HF num_experts; Mixtral's num_local_experts); null = a dense model."""
    num_experts_per_tok: int = 2
    """Experts each token is sent to (top-k of the router's softmax)."""
    moe_intermediate_size: int | None = None
    """Inner width of one expert; null = model.intermediate_size."""
    norm_topk_prob: bool | None = None
    """Renormalize the top-k routing weights to sum to 1; null = the family's rule (mixtral yes, qwen*_moe as their HF default, no)."""
    decoder_sparse_step: int = 1
    """Every n-th block is an MoE block (blocks i with (i+1) % n == 0); the others keep a dense MLP."""
    mlp_only_layers: list[int] = []
    """Blocks that keep a dense MLP of model.intermediate_size whatever decoder_sparse_step says."""
    shared_expert_intermediate_size: int | None = None
    """qwen2_moe: width of the shared expert every token goes through (gated by a sigmoid); null = none."""
    router_aux_loss_coef: float = 0.001
    """Weight of transformers' load-balancing loss in the training loss under model.moe_balance: aux_loss (read from the checkpoint; 0 = no auxiliary term). Not read under aux_free or none."""
    moe_balance: Literal["aux_loss", "aux_free", "none"] = "aux_loss"
    """How the experts' load is balanced in training. `aux_loss`: transformers' load-balancing loss, weighted by router_aux_loss_coef, added to the loss. `aux_free`: DeepSeek-V3's auxiliary-loss-free balancing (torchtitan's load_balance_coeff): a per-expert bias b_e is added to the routing probabilities to choose the top-k experts only (the weights of the experts' outputs stay the unbiased probabilities) and after each optimizer step b_e += router_bias_update_rate · sign(mean load − load_e), the loads counted over the step's tokens on every rank, so every rank holds the same bias; the bias is kept in checkpoints, not in the saved model/ or exports (Hugging Face's Qwen-MoE and Mixtral have no routing bias: a saved model routes by the unbiased probabilities). `none`: neither (e.g. for DPO)."""
    router_bias_update_rate: Annotated[float, Field(gt=0)] = 0.001
    """model.moe_balance: aux_free: the bias update speed u of each optimizer step (DeepSeek-V3: 0.001)."""
    capacity_factor: Annotated[float | None, Field(gt=0)] = None
    """Expert capacity (MindSpore Transformers' capacity_factor): each expert takes at most ceil(capacity_factor · N · k / E) of the N·k (token, expert) slots of one MoE layer's forward, N the tokens of that forward on one rank (micro_batch_size × seq_length / context_parallel), or on the ep group's ranks together under expert parallel; the earliest tokens first. A dropped slot adds nothing to its token, which keeps its other experts and the residual; metrics log the dropped fraction (`dropped_tokens`). null = dropless (every slot computed)."""

    @property
    def moe(self) -> bool:
        """A mixture-of-experts model (model.num_experts set)."""
        return bool(self.num_experts)

    def sparse_layer(self, i: int) -> bool:
        """Block i routes its tokens to experts (transformers' rule of decoder_sparse_step and mlp_only_layers)."""
        return self.moe and i not in self.mlp_only_layers and (i + 1) % max(1, self.decoder_sparse_step) == 0

    @property
    def expert_ffn_size(self) -> int:
        """model.moe_intermediate_size resolved (model.intermediate_size when null)."""
        return self.moe_intermediate_size or self.ffn_size

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_size(self) -> int:
        """model.head_dim resolved (hidden_size / num_heads when null)."""
        return self.head_dim or self.hidden_size // max(1, self.num_heads)

    @property
    def spec(self) -> FamilySpec:
        """What config validation knows of the family `arch` (fitlm.models.family_spec.FamilySpec; torch-free)."""
        return registry.get_spec(self.arch)

    @property
    def family(self):
        """The registered torch family of `arch` (fitlm.models.family.Family): imports its model code."""
        return registry.get_family(self.arch)

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size or self.spec.default_ffn(self.hidden_size)

    @property
    def local_rope(self) -> bool:
        """Sliding-window blocks rotate with their own base (Gemma 3's rope_local_theta): a second RoPE table."""
        return self.rope_local_theta is not None and any(
            self.layer_type(i) == "sliding" for i in range(self.num_layers)
        )

    def layer_type(self, i: int) -> str:
        """ "full" or "sliding": the attention of block i."""
        if self.sliding_window is None:
            return "full"
        if self.layer_types is not None:
            return self.layer_types[i]
        return self.spec.default_layer_type(i)
