"""What the planner reads from a config: the config itself, plus the knobs the search turns, and exact
parameter counts.

Why a record beside the pydantic `Config`: `fitlm plan --search` and the OOM diagnosis evaluate tens of
thousands of variants, and a `dataclasses.replace` of a few knobs is far cheaper than a validated
model copy. So the knobs they turn (layout, batch split, memory options, fine-tuning method) are fields,
each named by its config key in KNOBS, which both reads them (`from_config`) and writes a variant back
(`to_overrides`); everything else (the model's shape, the sequence, the half type) is read from the
config itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from fitlm.config import PAIR_OBJECTIVES, Config, ModelConfig
from fitlm.parallel_dims import ParallelDims
from fitlm.rules import flatten

LEVELS = ("O0", "O1", "O2", "O3")
# Setup field -> the config key it stands for.
KNOBS = {
    "dp": "parallel.data_parallel",
    "tp": "parallel.tensor_parallel",
    "pp": "parallel.pipeline_parallel",
    "sp": "parallel.sequence_parallel",
    "zero": "parallel.zero_stage",
    "schedule": "parallel.pipeline_schedule",
    "chunks": "parallel.micro_batch_num",
    "gradient_sync": "parallel.gradient_sync",
    "mbs": "train.micro_batch_size",
    "accum": "train.gradient_accumulation_steps",
    "level": "memory.mixed_precision",
    "recompute": "memory.recompute",
    "recompute_every": "memory.recompute_every_n_layers",
    "offload": "memory.cpu_offload",
    "loss_chunk": "memory.loss_chunk_size",
    "method": "finetune.method",
    "lora_r": "finetune.lora.r",
    "lora_targets": "finetune.lora.target_modules",
    "freeze_layers": "finetune.freeze_layers",
    "freeze_embeddings": "finetune.freeze_embeddings",
    "seq": "data.seq_length",
    "cp": "parallel.context_parallel",
    "act_offload": "memory.activation_offload",
    "objective": "finetune.objective",
    "ep": "parallel.expert_parallel",
}


@dataclass(frozen=True)
class ModelCounts:
    """The family unit's planner counts (fitlm.models.family.PlannerCounts) evaluated for one model."""

    block_params: int  # one block, norms and biases included
    embedding_params: int  # token (and position) embeddings
    head_norm_params: int  # the final norm
    linears: tuple[tuple[str, int, int], ...]  # (name, in, out) of a block's matmuls
    input_groups: tuple[tuple[str, ...], ...]  # linears that read the same saved input
    block_bytes: tuple[tuple[float, float, float, float, float], ...]  # per level in LEVELS order
    outside_bytes: tuple[tuple[float, float], ...]
    rope_tables: int  # cos/sin table pairs kept as buffers (Gemma 3: global and local)
    finetune_activations: bool  # LoRA/freeze activation savings follow the pre-norm Llama block
    sliding: bool  # some blocks use sliding-window attention (a masked SDPA)
    softcap: bool  # attention scores soft-capped (Gemma 2): eager attention keeps [H, T, S] tensors
    # An MoE model: the width of the rows a token's MLP activations cover (k routed experts' width, plus a shared
    # expert's); 0 for a dense block (model.ffn_size). And its dense blocks among the routed ones
    # (model.mlp_only_layers, decoder_sparse_step): how many, and their counts (`dense`, the same but the block).
    routed_ffn: int = 0
    dense_layers: int = 0
    dense: "ModelCounts | None" = None

    @classmethod
    def of(cls, m: ModelConfig) -> "ModelCounts":
        pc = m.family.planner
        counts = cls._of(m, pc.block(m))
        if not m.moe:
            return counts
        routed_ffn = (m.num_experts_per_tok or 1) * m.expert_ffn_size + (m.shared_expert_intermediate_size or 0)
        counts = replace(counts, routed_ffn=routed_ffn)
        dense_layers = sum(not m.sparse_layer(i) for i in range(m.num_layers))
        if dense_layers and pc.dense_block is not None:
            counts = replace(counts, dense_layers=dense_layers, dense=cls._of(m, pc.dense_block(m)))
        return counts

    @classmethod
    def _of(cls, m: ModelConfig, block) -> "ModelCounts":
        pc = m.family.planner
        return cls(
            block.params,
            pc.embedding_params(m),
            pc.head_norm_params(m),
            block.linears,
            block.input_groups,
            tuple(pc.block_bytes[lv] for lv in LEVELS),
            tuple(pc.outside_bytes[lv] for lv in LEVELS),
            (2 if m.local_rope else 1) if pc.rope else 0,
            pc.activation_finetune,
            any(m.layer_type(i) == "sliding" for i in range(m.num_layers)),
            m.attn_logit_softcap is not None,
        )


@dataclass(frozen=True)
class Setup:
    cfg: Config = field(compare=False, repr=False)  # the planned config; the knobs below override its keys
    counts: ModelCounts = field(repr=False)
    mbs: int = 1  # micro batch size (sequences)
    accum: int = 1
    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: bool = False
    zero: int = 0
    schedule: str = "1f1b"
    chunks: int = 1  # parallel.micro_batch_num
    level: str = "O0"
    recompute: str = "none"
    recompute_every: int = 1
    offload: bool = False
    loss_chunk: int = 0
    method: str = "full"  # finetune.method: full, lora, qlora, freeze (fitlm.plan.finetune does the accounting)
    lora_r: int = 8
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    freeze_layers: float = 0.0
    freeze_embeddings: bool = False
    gradient_sync: str = "auto"  # parallel.gradient_sync
    seq: int = 1  # data.seq_length: tokens per sample (a knob for `fitlm plan --max-seq`)
    cp: int = 1  # parallel.context_parallel: ranks each sequence is split over (fitlm.plan.context_parallel)
    act_offload: bool | str = False  # memory.activation_offload: False, True, "blocks" or "model"
    objective: str = "sft"  # finetune.objective: "sft", "dpo", "simpo" (these two: micro batches of pairs) or "grpo"
    ep: int = 1  # parallel.expert_parallel: ranks each MoE layer's experts are split over (fitlm.plan.expert_parallel)
    # Under expert parallel: the routed rows a rank's experts receive per MoE layer over the balanced share (N·k, its
    # own tokens' slots); 1 is balanced routing, the plan's; fitlm.plan.routing sets a worst case. Not a config key.
    imbalance: float = 1.0
    # Where the planned run's tensors live: "accelerator" (CUDA and the catalog's devices), or "cpu" (`--device
    # cpu`), where activation offload has no other memory to move to and changes nothing. Not a config key: the
    # plan's device says it (`on_device`).
    device_kind: str = field(default="accelerator", compare=False)

    # Read from the config itself: what no planner variant changes.
    @property
    def arch(self) -> str:
        return self.cfg.model.arch

    @property
    def h(self) -> int:
        """Hidden size."""
        return self.cfg.model.hidden_size

    @property
    def layers(self) -> int:
        return self.cfg.model.num_layers

    @property
    def heads(self) -> int:
        return self.cfg.model.num_heads

    @property
    def kv_heads(self) -> int:
        return self.cfg.model.kv_heads

    @property
    def ffn(self) -> int:
        """The MLP width a token's saved activations cover: a dense block's intermediate size, or a routed block's
        k experts' widths (`ModelCounts.routed_ffn`)."""
        return self.counts.routed_ffn or self.cfg.model.ffn_size

    @property
    def head_dim(self) -> int:
        return self.cfg.model.head_size

    @property
    def vocab(self) -> int:
        return self.cfg.model.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.cfg.model.max_seq_len

    @property
    def tied(self) -> bool:
        return self.cfg.model.tie_embeddings

    @property
    def half(self) -> str:
        return self.cfg.memory.half_dtype

    @property
    def doc_mask(self) -> bool:
        return self.cfg.data.document_mask

    @property
    def pretrained(self) -> bool:
        """model.init_from is set: fine-tuning, so LoRA/freeze are remedies too."""
        return bool(self.cfg.model.init_from)

    @property
    def dpo_reference(self) -> str | None:
        """finetune.dpo.reference: the model directory DPO's frozen reference is read from (None: the start)."""
        return self.cfg.finetune.dpo.reference

    @property
    def pairs(self) -> bool:
        """The objective trains on preference pairs (DPO, SimPO: fitlm.plan.finetune)."""
        return self.objective in PAIR_OBJECTIVES

    @property
    def rows(self) -> int:
        """Sequences per micro batch: train.micro_batch_size, which counts pairs under DPO and SimPO (chosen +
        rejected)."""
        return self.mbs * (2 if self.pairs else 1)

    @property
    def sliding(self) -> bool:
        return self.counts.sliding

    @property
    def softcap(self) -> bool:
        return self.counts.softcap

    @property
    def dims(self) -> ParallelDims:
        """The layout's dimensions and predicates, as the trainer derives them (fitlm.parallel_dims)."""
        return ParallelDims(dp=self.dp, tp=self.tp, pp=self.pp, zero_stage=self.zero, cp=self.cp, ep=self.ep)

    @property
    def sync_every(self) -> bool:
        """Gradients reduced after every accumulation micro batch (the trainer's rule)."""
        return self.dims.reduce_every_micro_batch(self.gradient_sync)

    @property
    def step_chunks(self) -> int:
        """Pipeline chunks per optimizer step: all micro batches of a step share one schedule run."""
        return max(1, self.chunks) * self.accum

    @property
    def local_seq(self) -> float:
        """Tokens of each sequence on this rank: T, or T/C under context parallel."""
        return self.seq / self.cp

    @property
    def offload_mode(self) -> str:
        """memory.activation_offload as it acts here: "none", "blocks" (true) or "model"; "none" on a CPU device."""
        if not self.act_offload or self.device_kind == "cpu":
            return "none"
        return "model" if self.act_offload == "model" else "blocks"

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def q(self) -> int:
        """Query width H·D (the hidden size unless head_dim is set independently)."""
        return self.heads * self.head_dim

    def level_bytes(self) -> tuple[float, float, float, float, float]:
        return self.counts.block_bytes[LEVELS.index(self.level)]

    @property
    def world(self) -> int:
        return self.dims.world_size

    @property
    def global_batch(self) -> int:
        return self.mbs * self.dp * self.accum

    @property
    def tokens_per_step(self) -> int:
        """Tokens the step trains on: both rows of every DPO or SimPO pair."""
        return self.rows * self.dp * self.accum * self.seq


def from_config(cfg: Config) -> Setup:
    values = flatten(cfg.model_dump())
    knobs = {name: values[key] for name, key in KNOBS.items()}
    knobs["lora_targets"] = tuple(knobs["lora_targets"])
    if knobs["objective"] == "grpo":  # trained on its rollouts: rows as long as the longest prompt and completion
        knobs["seq"] = cfg.finetune.grpo.row_length(cfg.data.seq_length)
    return Setup(cfg=cfg, counts=ModelCounts.of(cfg.model), **knobs)


def on_device(s: Setup, device_name: str) -> Setup:
    """`s` planned for the named device: on `cpu` the tensors are on the host already (device_kind "cpu")."""
    return replace(s, device_kind="cpu" if device_name == "cpu" else "accelerator")


def to_overrides(s: Setup) -> dict[str, dict[str, Any]]:
    """The config keys a Setup's knobs stand for, as nested dicts (for writing the best layout as YAML)."""
    out: dict[str, Any] = {}
    for name, key in KNOBS.items():
        *sections, leaf = key.split(".")
        node = out
        for section in sections:
            node = node.setdefault(section, {})
        value = getattr(s, name)
        node[leaf] = list(value) if isinstance(value, tuple) else value
    return out


def param_bytes(s: Setup) -> int:
    """Bytes of a parameter (and of its gradient and each AdamW moment): fp32, or half at O3."""
    return 2 if s.level == "O3" else 4


def act_bytes(s: Setup) -> int:
    """Bytes of a saved activation: fp32 at O0, half above."""
    return 4 if s.level == "O0" else 2


def residual_bytes(s: Setup) -> int:
    """Bytes of the residual stream: fp32 at O0 and O1 (O1 keeps it in fp32), half above."""
    return 4 if s.level in ("O0", "O1") else 2


def block_kinds(s: Setup) -> tuple[tuple[int, Setup], ...]:
    """(how many blocks, a Setup counting one of them) per kind of block: every block for a dense model; an MoE
    model's routed blocks and the dense ones among them (their own linears, parameters and MLP width)."""
    dense = s.counts.dense
    if dense is None:
        return ((s.layers, s),)
    return ((s.layers - s.counts.dense_layers, s), (s.counts.dense_layers, replace(s, counts=dense)))


def routed_layers(s: Setup) -> int:
    """Blocks that route their tokens to experts (0 for a dense model)."""
    return (s.layers - s.counts.dense_layers) if s.cfg.model.moe else 0


def per_block(s: Setup, count) -> float:
    """The mean over the model's blocks of `count(setup of one block)`: L times it is the model's sum (exactly,
    however the routed and dense blocks are spread; a pipeline stage's share of it is its blocks' mean)."""
    return sum(n * count(one) for n, one in block_kinds(s)) / s.layers


def layer_params(s: Setup) -> float:
    """One block's parameters, as the family unit counts them (matmuls, norms, biases); an MoE model's mean
    over its routed and dense blocks."""
    return per_block(s, lambda one: one.counts.block_params)


def embedding_params(s: Setup) -> int:
    return s.counts.embedding_params


def head_params(s: Setup) -> int:
    """Output projection plus final norm; a tied head adds no parameter of its own."""
    return s.counts.head_norm_params + (0 if s.tied else s.vocab * s.h)


def total_params(s: Setup) -> int:
    return embedding_params(s) + round(s.layers * layer_params(s)) + head_params(s)


def active_block_params(s: Setup) -> float:
    """One block's parameters that a token's matmuls use: all of a dense block's; of an MoE block's E stacked
    experts, the k the token is routed to (as fitlm.models.flops counts them). The mean over the blocks."""

    def active(one: Setup) -> float:
        experts = sum(i * o for name, i, o in one.counts.linears if name.startswith("experts."))
        e = one.cfg.model.num_experts
        params = one.counts.block_params
        return params - experts + experts * one.cfg.model.num_experts_per_tok // e if experts and e else params

    return per_block(s, active)


def matmul_params(s: Setup) -> int:
    """Parameters in a matmul per token (as fitlm.models.flops counts them for the trainer's MFU): all but the
    embedding lookups (norms included), and of the experts the routed ones; the output projection counts even
    when tied."""
    return round(s.layers * active_block_params(s)) + s.counts.head_norm_params + s.vocab * s.h


def stage_layers(s: Setup) -> int:
    """Blocks on the most loaded (first) pipeline rank: ceil(L/pp)."""
    return -(-s.layers // s.pp)


def stage_range(s: Setup, first: bool) -> range:
    """The blocks of the first or the last pipeline stage, as fitlm.parallel.pipeline.split_layers balances them
    (the earlier stages take the extra block: the last holds floor(L/pp)); all of them without pipeline parallel.
    Interleaved schedules: ceil(L/pp) at either end (their ranks' blocks are not contiguous)."""
    if s.pp == 1:
        return range(s.layers)
    n = stage_layers(s) if first or s.schedule == "interleaved_1f1b" else s.layers // s.pp
    return range(n) if first else range(s.layers - n, s.layers)


def stage_kinds(s: Setup, first: bool) -> tuple[tuple[int, Setup], ...]:
    """`block_kinds` over the first or the last pipeline stage's own blocks: how many of them route (or are dense
    for a dense model) and how many are an MoE model's dense blocks (model.mlp_only_layers, decoder_sparse_step),
    where in the model they sit."""
    blocks, dense = stage_range(s, first), s.counts.dense
    if dense is None:
        return ((len(blocks), s),)
    n = sum(not s.cfg.model.sparse_layer(i) for i in blocks)
    return ((len(blocks) - n, s), (n, replace(s, counts=dense)))


def stage_routed(s: Setup, first: bool = True) -> int:
    """Blocks of the first (most loaded) or the last pipeline stage that route their tokens to experts."""
    return stage_kinds(s, first)[0][0] if s.cfg.model.moe else 0


def stage_mean(s: Setup, first: bool, count) -> float:
    """The mean of `count(setup of one block)` over the stage's blocks (`per_block` without pipeline parallel): a
    pipeline stage holds the blocks it holds, not L/pp of the model's mean (an MoE model's dense block sits on one)."""
    if s.pp == 1:
        return per_block(s, count)
    return sum(n * count(one) for n, one in stage_kinds(s, first)) / len(stage_range(s, first))
