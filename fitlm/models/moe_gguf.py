"""llama.cpp's names and metadata for the MoE families (qwen3moe, qwen2moe, and Mixtral as `llama` with experts).

Tensors: the router `blk.N.ffn_gate_inp`, the stacked experts `blk.N.ffn_{gate,up,down}_exps` ([E, out, in],
fitlm.models.gguf stacks HF's per-expert tensors) and Qwen2-MoE's shared expert `ffn_{gate,up,down}_shexp` with
its gate `ffn_gate_inp_shexp`. Metadata: `expert_count`, `expert_used_count`, `expert_feed_forward_length`,
`expert_shared_feed_forward_length`.

llama.cpp's graphs fix what the HF configs leave open, so what they cannot express is refused at export (a
GGUFError naming the key): every block routes (no `mlp_only_layers`, `decoder_sparse_step` 1); qwen3moe and
Mixtral renormalize the top-k weights, qwen2moe does not.
"""

from __future__ import annotations

from typing import Any, Callable

from fitlm.config import ModelConfig
from fitlm.models.gguf import GGUFError

ROUTER = {"ffn_gate_inp": "mlp.gate"}
SHARED = {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


def moe_writer(arch: str, normalized: bool | None, expert_width: bool, shared: bool) -> Callable[[ModelConfig], dict]:
    """write_extra of an MoE family: the expert keys, after refusing what `arch`'s graph cannot express.
    `normalized`: whether the graph renormalizes the top-k weights (None: the family has no choice, Mixtral);
    `expert_width`: the architecture has its own expert_feed_forward_length (Mixtral's experts are n_ff wide)."""

    def write(cfg: ModelConfig) -> dict[str, Any]:
        problems = []
        dense = [i for i in range(cfg.num_layers) if not cfg.sparse_layer(i)]
        if dense:
            problems.append(
                f"blocks {dense} keep a dense MLP (model.mlp_only_layers / decoder_sparse_step), and llama.cpp's "
                f"{arch} graph routes every block"
            )
        if normalized is not None and bool(cfg.norm_topk_prob) != normalized:
            problems.append(
                f"model.norm_topk_prob is {bool(cfg.norm_topk_prob)}, and llama.cpp's {arch} graph "
                f"{'always renormalizes' if normalized else 'never renormalizes'} the top-k weights"
            )
        if problems:
            raise GGUFError(f"GGUF export: {'; '.join(problems)}; export this model with --format hf")
        out: dict[str, Any] = {"expert_count": cfg.num_experts, "expert_used_count": cfg.num_experts_per_tok}
        if expert_width:
            out["expert_feed_forward_length"] = cfg.expert_ffn_size
        if shared:
            out["expert_shared_feed_forward_length"] = cfg.shared_expert_intermediate_size
        return out

    return write


def moe_reader(normalized: bool | None, expert_width: bool, shared: bool) -> Callable[[Callable], dict]:
    """read_extra of an MoE family: ModelConfig fields from the expert keys (`get(key, default)`); arguments
    as `moe_writer`'s."""

    def read(get: Callable) -> dict[str, Any]:
        out: dict[str, Any] = {
            "num_experts": int(get("expert_count")),
            "num_experts_per_tok": int(get("expert_used_count")),
        }
        if normalized is not None:
            out["norm_topk_prob"] = normalized
        if expert_width:
            out["moe_intermediate_size"] = int(get("expert_feed_forward_length"))
        if shared:
            out["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length"))
        return out

    return read
