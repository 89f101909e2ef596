"""What the planner needs from a config, as one small frozen record, plus exact parameter counts.

Why not the pydantic `Config` itself: the search evaluates tens of thousands of variants, and a
`dataclasses.replace` on this record is ~100x cheaper than a validated model copy.
"""

from __future__ import annotations

from dataclasses import dataclass

from fitlm.config import Config, ModelConfig, reduces_every_micro_batch

LEVELS = ("O0", "O1", "O2", "O3")


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

    @classmethod
    def of(cls, m: ModelConfig) -> "ModelCounts":
        pc = m.family.planner
        block = pc.block(m)
        return cls(block.params, pc.embedding_params(m), pc.head_norm_params(m), block.linears, block.input_groups,
                   tuple(pc.block_bytes[lv] for lv in LEVELS), tuple(pc.outside_bytes[lv] for lv in LEVELS),
                   (2 if m.local_rope else 1) if pc.rope else 0, pc.activation_finetune)


@dataclass(frozen=True)
class Setup:
    arch: str
    counts: ModelCounts
    h: int  # hidden size
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    head_dim: int
    vocab: int
    max_seq_len: int
    tied: bool
    seq: int  # tokens per sample
    mbs: int  # micro batch size (sequences)
    accum: int
    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: bool = False
    zero: int = 0
    schedule: str = "1f1b"
    chunks: int = 1  # parallel.micro_batch_num
    level: str = "O0"
    half: str = "bf16"
    recompute: str = "none"
    recompute_every: int = 1
    offload: bool = False
    loss_chunk: int = 0
    doc_mask: bool = True
    method: str = "full"  # finetune.method: full, lora, freeze (fitlm.plan.finetune does the accounting)
    lora_r: int = 8
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    freeze_layers: float = 0.0
    freeze_embeddings: bool = False
    pretrained: bool = False  # model.init_from is set: fine-tuning, so LoRA/freeze are remedies too
    gradient_sync: str = "auto"  # parallel.gradient_sync
    sliding: bool = False  # some blocks use sliding-window attention (a masked SDPA)
    softcap: bool = False  # attention scores soft-capped (Gemma 2): eager attention keeps [H, T, S] tensors

    @property
    def sync_every(self) -> bool:
        """Gradients reduced after every accumulation micro batch (the trainer's rule, fitlm.config)."""
        return reduces_every_micro_batch(self.gradient_sync, self.zero, self.dp)

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
        return self.dp * self.tp * self.pp

    @property
    def global_batch(self) -> int:
        return self.mbs * self.dp * self.accum

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq


def from_config(cfg: Config) -> Setup:
    m, p, mem, t, f = cfg.model, cfg.parallel, cfg.memory, cfg.train, cfg.finetune
    return Setup(arch=m.arch, counts=ModelCounts.of(m), h=m.hidden_size, layers=m.num_layers, heads=m.num_heads,
                 kv_heads=m.kv_heads, ffn=m.ffn_size, head_dim=m.head_size, vocab=m.vocab_size, max_seq_len=m.max_seq_len, tied=m.tie_embeddings,
                 seq=cfg.data.seq_length, mbs=t.micro_batch_size, accum=t.gradient_accumulation_steps,
                 dp=p.data_parallel, tp=p.tensor_parallel, pp=p.pipeline_parallel, sp=p.sequence_parallel,
                 zero=p.zero_stage, schedule=p.pipeline_schedule, chunks=p.micro_batch_num,
                 level=mem.mixed_precision, half=mem.half_dtype, recompute=mem.recompute,
                 recompute_every=mem.recompute_every_n_layers, offload=mem.cpu_offload,
                 loss_chunk=mem.loss_chunk_size, doc_mask=cfg.data.document_mask, method=f.method,
                 lora_r=f.lora.r, lora_targets=tuple(f.lora.target_modules), freeze_layers=f.freeze_layers,
                 freeze_embeddings=f.freeze_embeddings, pretrained=bool(m.init_from),
                 gradient_sync=p.gradient_sync,
                 sliding=any(m.layer_type(i) == "sliding" for i in range(m.num_layers)),
                 softcap=m.attn_logit_softcap is not None)


def to_overrides(s: Setup) -> dict:
    """The config keys a Setup changes, as nested dicts (for writing the best layout as YAML)."""
    return {
        "parallel": {"data_parallel": s.dp, "tensor_parallel": s.tp, "pipeline_parallel": s.pp,
                     "sequence_parallel": s.sp, "zero_stage": s.zero, "pipeline_schedule": s.schedule,
                     "micro_batch_num": s.chunks,
                     "gradient_sync": s.gradient_sync},
        "memory": {"mixed_precision": s.level, "recompute": s.recompute, "cpu_offload": s.offload,
                   "loss_chunk_size": s.loss_chunk},
        "train": {"micro_batch_size": s.mbs, "gradient_accumulation_steps": s.accum},
    }


def layer_params(s: Setup) -> int:
    """One block's parameters, as the family unit counts them (matmuls, norms, biases)."""
    return s.counts.block_params


def embedding_params(s: Setup) -> int:
    return s.counts.embedding_params


def head_params(s: Setup) -> int:
    """Output projection plus final norm; a tied head adds no parameter of its own."""
    return s.counts.head_norm_params + (0 if s.tied else s.vocab * s.h)


def total_params(s: Setup) -> int:
    return embedding_params(s) + s.layers * layer_params(s) + head_params(s)


def matmul_params(s: Setup) -> int:
    """Parameters in a matmul per token (as fitlm.train.metrics counts them): all but the embedding
    lookups; the output projection counts even when tied."""
    return s.layers * layer_params(s) + s.vocab * s.h


def stage_layers(s: Setup) -> int:
    """Blocks on the most loaded (first) pipeline rank: ceil(L/pp)."""
    return -(-s.layers // s.pp)
