"""Typed run configuration: YAML in, validated `Config` out, every error reported at once.

Each field's docstring is its user-facing help: `fitlm config docs` renders the README's config
reference from them, so the reference can never drift from the schema.
"""

from __future__ import annotations

import difflib
import json
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from fitlm import registry, rules
from fitlm.parallel_dims import ParallelDims, divisors

if typing.TYPE_CHECKING:
    from fitlm.models.family_spec import FamilySpec


class ConfigError(ValueError):
    """One or more problems with a configuration; `str()` lists them all, one per line."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        self.source = source
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{len(problems)} problem(s) with the configuration{where}:\n{lines}")


class _Section(BaseModel):
    # Attribute docstrings become field descriptions; unknown keys are errors, never ignored.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class LoraConfig(_Section):
    r: int = 8
    """LoRA rank: the inner dimension of the low-rank update B·A."""
    alpha: float = 16.0
    """LoRA scaling numerator; the update is scaled by alpha / r."""
    dropout: float = 0.0
    """Dropout applied to the LoRA branch input."""
    target_modules: list[str] = ["q_proj", "v_proj"]
    """Module names that get adapters (e.g. q_proj, v_proj), or ["all-linear"]."""


class RopeScalingConfig(_Section):
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


class ModelConfig(_Section):
    arch: str = "llama"
    """Registered model family (fitlm/models/<family>/); the README's model families table lists them all."""
    hidden_size: int = 256
    """Width of the residual stream."""
    num_layers: int = 4
    """Number of transformer blocks."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; must divide num_heads. null = num_heads (plain MHA)."""
    head_dim: int | None = None
    """Width of one attention head; null = hidden_size / num_heads (Qwen3 and Gemma set it independently)."""
    intermediate_size: int | None = None
    """MLP inner width. null = the family default (llama: 8/3·hidden rounded up to 256; gpt2: 4·hidden)."""
    vocab_size: int = 32000
    """Embedding rows; must be at least the tokenizer's vocabulary size."""
    max_seq_len: int = 2048
    """Longest sequence the model supports (RoPE table / learned position embeddings)."""
    rope_theta: float = 10000.0
    """RoPE base frequency (of the global-attention layers, for Gemma 3)."""
    rope_scaling: RopeScalingConfig | None = None
    """RoPE scaling of the global-attention layers; null = plain RoPE."""
    rope_local_theta: float | None = None
    """Gemma 3: RoPE base of the sliding-window layers (unscaled); null = rope_theta."""
    attention_bias: bool | None = None
    """Biases on q/k/v (and o, where the family has one); null = the family's default (qwen2 and gpt2 yes, others no)."""
    sliding_window: int | None = None
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
    num_experts: int | None = None
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
    """Weight of transformers' load-balancing loss in the training loss (read from the checkpoint; 0 = balancing off)."""

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


class DataConfig(_Section):
    train: str = "data/train"
    """Directory of packed training tokens (written by `fitlm data pack`)."""
    valid: str | None = None
    """Directory of packed validation tokens, or null for no evaluation."""
    seq_length: int = 2048
    """Tokens per training sample; must not exceed model.max_seq_len."""
    format: Literal["pretrain", "chat", "preference"] = "pretrain"
    """`pretrain`: plain text stream. `chat`: conversations with loss on assistant turns only. `preference`: (prompt, chosen, rejected) pairs packed with `fitlm data pack --format preference`, for `finetune.objective: dpo` or `simpo`; train.micro_batch_size counts pairs."""
    tokenizer: str | None = None
    """tokenizer.json to use; null = the one stored beside the packed training data."""
    document_mask: bool = True
    """Keep packed documents apart: block-causal attention and positions restarting per document. Labels never cross a document boundary either way."""
    max_length: int | None = None
    """Hard cap on tokens kept per document (the rest is dropped); null = no cap."""
    num_workers: int = 1
    """Loader threads assembling batches in the background (used when prefetch > 0)."""
    prefetch: int = 2
    """Batches prepared ahead of the training step; 0 = assemble each batch when asked."""


class ParallelConfig(_Section):
    data_parallel: int = 1
    """Data-parallel replicas (each reads a disjoint slice of every global batch)."""
    zero_stage: int = 0
    """0 = replicate everything; 1 = shard optimizer states; 2 = + gradients; 3 = + parameters."""
    tensor_parallel: int = 1
    """Tensor (model) parallel degree; must divide num_heads and num_kv_heads."""
    sequence_parallel: bool = False
    """Shard norms/dropout activations along the sequence across the tensor-parallel group."""
    pipeline_parallel: int = 1
    """Pipeline stages; layers are split between them."""
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    """Pipeline schedule."""
    micro_batch_num: int = 1
    """Pipeline chunks each micro batch is split into. All micro batches of a step go through one schedule run of micro_batch_num × gradient_accumulation_steps chunks, which must be at least pipeline_parallel; the bubble is (p-1)/(chunks+p-1) of the step."""
    pipeline_layers: list[int] | None = None
    """Blocks per pipeline stage, e.g. [5, 5, 5, 3] (one entry per virtual stage under interleaved_1f1b); null = balanced."""
    context_parallel: int = 1
    """Ranks each sequence is split over (long context): every rank holds 2 of 2 × context_parallel load-balanced chunks of each sequence (chunks r and 2C−1−r, so causal attention costs every rank the same) and attention all-gathers keys and values over the group, so document masks, sliding windows and global RoPE positions stay exact. data.seq_length must be a multiple of 2 × context_parallel. Composes with data parallel, ZeRO 0–3 (sharded over data_parallel × context_parallel) and tensor parallel, not with pipeline parallel; the global batch is still micro_batch_size × data_parallel × accumulation sequences."""
    gradient_sync: Literal["auto", "every_micro_batch", "last_micro_batch"] = "auto"
    """With gradient accumulation, when data-parallel gradients are reduced: `last_micro_batch` once per step (least traffic, but ZeRO-2/3 then hold whole unsharded gradients until the last micro batch); `every_micro_batch` (ZeRO-2/3 keep only their gradient shard, for accumulation × the reduce-scatter traffic); `auto` = every micro batch under ZeRO-2/3, the last otherwise. Under pipeline parallel gradients are reduced once per step whatever this says (the step's micro batches share one schedule run)."""
    expert_parallel: int = 1
    """Ranks each MoE layer's experts are split over (E / expert_parallel experts a rank), taken from the data-parallel ranks (it divides data_parallel and model.num_experts): each rank routes its own tokens and an all-to-all sends them to the ranks holding their experts and back. Attention, norms and embeddings stay data parallel; expert gradients are summed over the replicas of the same experts and scaled as every other gradient. Composes with ZeRO 0, 2 and 3 (experts stay whole per expert rank), recompute, precision levels and accumulation; fitlm/rules.py lists what it does not compose with."""
    timeout_s: int = 1800
    """Seconds a collective or barrier waits for the other ranks (gloo and nccl); past it the run stops with an error naming the rank that stopped responding and its phase. Raise it when one rank legitimately works alone that long (a large final save, a slow filesystem)."""

    @property
    def dims(self) -> ParallelDims:
        """The layout's dimensions and their derived predicates (fitlm.parallel_dims)."""
        return ParallelDims(
            dp=self.data_parallel,
            tp=self.tensor_parallel,
            pp=self.pipeline_parallel,
            zero_stage=self.zero_stage,
            cp=self.context_parallel,
            ep=self.expert_parallel,
        )

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def reduce_every_micro_batch(self) -> bool:
        """Whether gradients are reduced after every accumulation micro batch (see gradient_sync)."""
        return self.dims.reduce_every_micro_batch(self.gradient_sync)


class LossScalingConfig(_Section):
    initial_scale: float = 65536.0
    """Loss scale of the first step (dynamic scaling), a power of two."""
    growth_factor: float = 2.0
    """Multiply the scale by this after growth_interval steps without overflow."""
    backoff_factor: float = 0.5
    """Multiply the scale by this when a step overflows (that step is skipped)."""
    growth_interval: int = 1000
    """Overflow-free steps before the scale grows."""


class MemoryConfig(_Section):
    mixed_precision: Literal["O0", "O1", "O2", "O3"] = "O0"
    """O0 fp32; O1 fp32 params + autocast; O2 half compute, fp32 master/grads/optimizer; O3 all half."""
    half_dtype: Literal["bf16", "fp16"] = "bf16"
    """Half-precision type for O1-O3. fp16 uses loss scaling; bf16 does not need it."""
    loss_scale: Literal["dynamic"] | float = "dynamic"
    """fp16 loss scale: `dynamic` (grows and backs off, see loss_scaling), or a fixed number (static)."""
    loss_scaling: LossScalingConfig = LossScalingConfig()
    """Dynamic loss-scaling schedule (fp16 only)."""
    recompute: Literal["none", "full", "selective"] = "none"
    """Activation recompute: `full` recomputes whole blocks in backward; `selective` saves matmul and attention outputs and recomputes the cheap element-wise ops (norms, activations, RoPE)."""
    recompute_every_n_layers: int = 1
    """Recompute every n-th block only (1 = every block); trades memory for less recompute time."""
    cpu_offload: bool = False
    """Keep optimizer states (and with ZeRO-2/3 parameters and gradients too) in host memory; the optimizer steps on the CPU."""
    activation_offload: Literal[False, True, "blocks", "model"] = False
    """Move the tensors the forward saves for backward to host memory and back when backward needs them: `true`/`blocks` those of every decoder block (the bulk), `model` everything the forward saves (embedding and loss included). On CUDA the copies go to pinned memory on a side stream, overlapping compute; on a CPU device there is no other memory to move to and nothing changes. With recompute, only what recompute keeps (each block's input) is offloaded."""
    compile: bool = False
    """torch.compile the whole model with its loss (one process, DDP, ZeRO-1), or each block where FSDP2 (ZeRO-2/3), recompute, tensor or pipeline parallel wrap blocks (eager is the default, easier to debug)."""
    loss_chunk_size: int = 0
    """Tokens per chunk of the fused output-layer + cross-entropy, so the [tokens, vocab] logits never exist whole; 0 = plain."""
    attention_backward: Literal["sdpa", "matmul", "matmul_saved"] = "sdpa"
    """Attention in training on a CPU: `sdpa` is the fused kernel, forward and backward. `matmul` keeps SDPA's forward and recomputes the probabilities in 128-row query blocks for five batched matmuls, skipping the causally masked blocks: in bf16 with rows up to ~512 tokens attention takes ~0.6x the time, holding one block's scores. `matmul_saved` computes the forward too as blocked matmuls (fp32 scores) and keeps its fp32 probabilities for backward: ~0.4x SDPA's time up to ~1,024 tokens (bf16 or fp32), for 4 bytes per attended score per layer (B·H·T·(T/2 + 64) for rows of T tokens; `fitlm plan` counts them). bench/train_throughput.py measures them. GPUs and context parallel always use their own kernels."""


class DpoConfig(_Section):
    beta: float = 0.1
    """DPO's β: how far the policy may move from the reference; the loss is −log σ(β · (chosen log-ratio − rejected log-ratio))."""
    reference: str | None = None
    """The frozen reference model: null = the starting model (LoRA: the base with adapters off; full/freeze: a frozen copy), or a model directory (HF or fitlm) with the same tokenizer."""


PAIR_OBJECTIVES = ("dpo", "simpo")  # finetune.objective values that train on preference pairs (2 rows a sample)


class SimpoConfig(_Section):
    beta: float = 2.0
    """SimPO's β: the scale of the rewards β · (average log-prob of the response per token); the loss is −log σ(β · (chosen average − rejected average) − γ). 2.0 is the SimPO paper's value (TRL's CPOConfig defaults beta to 0.1, for its other losses)."""
    gamma: float = 0.5
    """SimPO's γ: the target reward margin between chosen and rejected (TRL's `simpo_gamma`, whose default 0.5 is used here)."""


class FinetuneConfig(_Section):
    method: Literal["full", "lora", "qlora", "freeze"] = "full"
    """`full` trains everything; `lora` trains adapters only; `qlora` trains adapters on a frozen base whose linear layers are stored in 4-bit NF4 (needs torchao: pip install 'fitlm[qlora]'); `freeze` freezes the bottom layers."""
    lora: LoraConfig = LoraConfig()
    """LoRA settings (used when method is `lora` or `qlora`)."""
    freeze_layers: float = 0.0
    """Fraction of the bottom layers frozen when method is `freeze` (0.0-1.0; floor(fraction × layers) blocks)."""
    freeze_embeddings: bool = False
    """With method `freeze`: also freeze the token (and position) embeddings, and with them a tied output head."""
    objective: Literal["sft", "dpo", "simpo"] = "sft"
    """`sft`: next-token cross-entropy on the target tokens. `dpo`: Direct Preference Optimization on `data.format: preference` pairs (settings in finetune.dpo). `simpo`: SimPO on the same pairs, without a reference model (settings in finetune.simpo)."""
    dpo: DpoConfig = DpoConfig()
    """DPO settings (used when objective is `dpo`)."""
    simpo: SimpoConfig = SimpoConfig()
    """SimPO settings (used when objective is `simpo`)."""

    @property
    def pairs(self) -> bool:
        """The objective trains on preference pairs (`dpo`, `simpo`): 2 rows per sample."""
        return self.objective in PAIR_OBJECTIVES

    @property
    def adapters(self) -> bool:
        """LoRA adapters are what trains (`lora`, or `qlora` on its 4-bit base)."""
        return self.method in ("lora", "qlora")


class GuardsConfig(_Section):
    nonfinite: Literal["skip", "stop", "rollback"] = "skip"
    """Loss or gradient norm NaN/Inf: `skip` the update (gradients dropped), `stop` with an error before the update, or `rollback`: skip, and after rollback_after bad steps in a row reload the last checkpoint."""
    spike: Literal["none", "warn", "skip", "stop", "rollback"] = "warn"
    """Loss or gradient-norm spike (see loss_spike_sigma, grad_spike_sigma): `warn` logs it and applies the update; `skip`, `stop`, `rollback` as for nonfinite; `none` does not look."""
    loss_spike_sigma: float = 6.0
    """A loss above the running mean by this many standard deviations is a spike; 0 = loss spikes not checked."""
    grad_spike_sigma: float = 10.0
    """A gradient norm (before clipping) above its running mean by this many standard deviations is a spike; 0 = not checked."""
    window: int = 100
    """Accepted steps the running mean and standard deviation are taken over."""
    warmup_steps: int = 100
    """Accepted steps observed before spikes are checked (early training is noisy by nature)."""
    rollback_after: int = 3
    """With `rollback`: bad steps in a row (each skipped) before the last checkpoint is reloaded."""
    max_rollbacks: int = 3
    """Rollbacks allowed in one run; the next bad streak after them stops the run."""


class ObserveConfig(_Section):
    """train.observe: what watches a run (docs/troubleshooting.md); none of it changes what is learned."""

    guards: GuardsConfig = GuardsConfig()
    """What happens on a NaN/Inf or spiking loss or gradient norm (docs/troubleshooting.md)."""
    consistency_interval: int = 100
    """Every this many steps compare a checksum of the weights of data-parallel replicas and stop if they differ; 0 = off. Not checked under ZeRO-2/3 (each rank holds a different shard)."""
    balance_threshold: float = 1.5
    """Warn when one data-parallel rank's real (target) tokens or longest document exceed the mean of the other ranks by this factor over a log interval; 0 = off."""
    data_wait_warn: float = 0.1
    """Warn when waiting for input batches takes more than this share of the step time (at most every 10th log line); 0 = off."""
    tensorboard: Literal["auto"] | bool = "auto"
    """Write the metrics also as TensorBoard scalars under output_dir/tensorboard/: `auto` = when tensorboard is installed."""
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] | None = None
    """Run trackers that get every metrics.jsonl scalar, guard/warning messages and the resolved config: any of `tensorboard` (output_dir/tensorboard/), `wandb` (offline by default: output_dir/wandb/, `wandb sync` later), `mlflow` (output_dir/mlruns/ unless mlflow_tracking_uri). null = TensorBoard as `tensorboard` says. A tracker failing mid-run is dropped with a warning; training goes on."""
    wandb_project: str = "fitlm"
    """W&B project of the run (with report_to: [wandb]); the run is named after output_dir."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """W&B mode: `offline` writes under output_dir/wandb/ with no network (upload later with `wandb sync`); `online` needs `wandb login`."""
    mlflow_tracking_uri: str | None = None
    """MLflow store or server (`sqlite:///mlflow.db`, `http://host:5000`, `file:///path`); null = $MLFLOW_TRACKING_URI, else the file store output_dir/mlruns/."""
    mlflow_experiment: str = "fitlm"
    """MLflow experiment the run is logged under (created when missing); the run is named after output_dir."""
    profile_steps: list[int] | None = None
    """[first, last] optimizer steps to record with the torch profiler; a Chrome trace per rank goes to output_dir/profile/. null = off."""
    oom_snapshot: bool = False
    """CUDA only: record allocator history and, on out of memory, dump a snapshot to output_dir/memory_snapshot_rank{R}.pickle (open it at pytorch.org/memory_viz)."""


class TrainConfig(_Section):
    micro_batch_size: int = 8
    """Sequences per forward/backward on each data-parallel rank."""
    gradient_accumulation_steps: int = 1
    """Micro batches accumulated per optimizer step."""
    max_steps: int = 1000
    """Optimizer steps to train."""
    lr: float = 3e-4
    """Peak learning rate (after warmup)."""
    min_lr: float = 3e-5
    """Learning rate at the end of the schedule."""
    warmup_steps: int = 100
    """Linear warmup steps from 0 to lr."""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay from lr to min_lr after warmup."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not applied to norms, biases and embeddings)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    seed: int = 1234
    """Seed for initialisation and data order; runs with equal seeds are identical."""
    log_interval: int = 10
    """Write a metrics.jsonl line every this many steps."""
    eval_interval: int = 100
    """Evaluate on data.valid every this many steps (and at the end); 0 disables."""
    eval_steps: int = 10
    """Global batches (micro_batch_size × data_parallel × gradient_accumulation_steps sequences each) per evaluation."""
    early_stopping_patience: int = 0
    """Stop when the validation loss has not improved for this many evaluations in a row (needs data.valid and eval_interval); 0 = never stop early."""
    lr_scaling: Literal["none", "sqrt"] = "none"
    """`sqrt`: multiply lr and min_lr by sqrt(global batch / lr_reference_batch) and warmup_steps by the same factor."""
    lr_reference_batch: int | None = None
    """Global batch (sequences) that lr and warmup_steps were tuned for; null = micro_batch_size × data_parallel (no accumulation)."""
    output_dir: str = "runs/default"
    """Where metrics.jsonl, checkpoints/ and the final model/ go."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Compute device; `auto` takes CUDA when present."""
    host_allocator: Literal["reuse", "system"] = "reuse"
    """Host memory when training on the CPU: `reuse` makes glibc's malloc keep freed memory for the next step instead of returning it to the kernel and faulting it in again (~22,500 page faults and ~25% of a small model's step on a 2-core CPU; set once the model is loaded, one arena for all threads, so the peak resident size is unchanged; memory freed during training is not given back to the system until the run ends); `system` leaves malloc as it is. No effect on GPU training, under ZeRO-2/3 (whose gathers return each freed unit to keep a rank's host peak near its shard) or without glibc."""
    peak_tflops: float | None = None
    """Device peak TFLOP/s for MFU; null = the known peak of the GPU, or on CPU the best GEMM measured on this machine (cached in $FITLM_CACHE_DIR, default ~/.cache/fitlm, so a busy start-up does not inflate MFU). Pin it when MFU reads above 100%."""
    progress: bool = True
    """Show a live progress bar."""
    observe: ObserveConfig = ObserveConfig()
    """The run's observers: NaN/spike guards, replica checksums, input balance, TensorBoard, profiler window, OOM snapshot."""


class CheckpointConfig(_Section):
    interval: int = 0
    """Save a resumable checkpoint every this many steps; 0 = only the final model."""
    keep_last: int = 3
    """Complete checkpoints kept on disk; older ones are deleted after each new one is complete."""
    resume: str = "auto"
    """`auto` continues from the latest complete checkpoint in output_dir (a fresh run when there is none); `never` refuses a used output_dir; a checkpoint directory path starts from that checkpoint (any layout) when output_dir has none of its own."""
    verify: bool = True
    """At resume, check every checkpoint file against the CRC-32 recorded when it was saved (reads the checkpoint once, split across ranks); a damaged checkpoint is reported with its file and the previous complete one is used instead."""
    on_save_error: Literal["stop", "continue"] = "stop"
    """When a checkpoint save fails for lack of disk space: `stop` (after removing the partial files; the previous checkpoint stays the latest) or `continue` training and try again at the next interval."""
    async_save: bool = False
    """Write checkpoints in a background thread (torch.distributed.checkpoint.async_save): the loop only waits for the copy to host memory; see bench/checkpoint.py for the measured step-time overhead."""


class Config(_Section):
    model: ModelConfig = ModelConfig()
    """The network."""
    data: DataConfig = DataConfig()
    """Where tokens come from."""
    parallel: ParallelConfig = ParallelConfig()
    """How work is split across devices."""
    memory: MemoryConfig = MemoryConfig()
    """Precision, recompute, offload, compile."""
    finetune: FinetuneConfig = FinetuneConfig()
    """What is trained."""
    train: TrainConfig = TrainConfig()
    """Optimisation and logging."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Saving and resuming."""

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# --------------------------------------------------------------------------- loading


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, turning parse errors into a ConfigError that names the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"config file {path} does not exist: pass the path of a YAML file"], str(path))
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError([f"malformed YAML{where}: {problem}; fix the syntax there"], str(path)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            [f"the top level must be a mapping of sections (model:, data:, ...), got {type(data).__name__}"], str(path)
        )
    return data


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a","b","c"], value parsed as YAML, so 1e-4, true, [x, y] work)."""
    if "=" not in item:
        raise ConfigError([f"--set {item!r} needs the form key.path=value, e.g. --set train.lr=1e-4"])
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    # YAML 1.1 reads 1e-4 as a string; numbers written that way are meant as numbers.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            pass
    return [k for k in key.strip().split(".") if k], value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            if not isinstance(node.get(k), dict):
                node[k] = {}
            node = node[k]
        node[keys[-1]] = value
    return data


# Names users bring from the HF Trainer, DeepSpeed and MindSpore configs, which spelling cannot match.
KEY_ALIASES = {
    "learning_rate": "lr",
    "max_grad_norm": "grad_clip",
    "lr_scheduler_type": "lr_schedule",
    "per_device_train_batch_size": "micro_batch_size",
    "micro_batch_size_per_gpu": "micro_batch_size",
    "gradient_accumulation": "gradient_accumulation_steps",
    "warmup": "warmup_steps",
    "train_iters": "max_steps",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "max_position_embeddings": "max_seq_len",
}


def _closest(name: str, choices: list[str]) -> str | None:
    if KEY_ALIASES.get(name) in choices:
        return KEY_ALIASES[name]
    hit = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return hit[0] if hit else None


def _schema_errors(err: ValidationError) -> list[str]:
    out = []
    for e in err.errors():
        loc = [str(x) for x in e["loc"]]
        key = ".".join(loc)
        if e["type"] == "extra_forbidden":
            model: type[BaseModel] = Config
            for part in loc[:-1]:
                ann = model.model_fields.get(part)
                if ann is None or not (isinstance(ann.annotation, type) and issubclass(ann.annotation, BaseModel)):
                    break
                model = ann.annotation
            valid = list(model.model_fields)
            guess = _closest(loc[-1], valid)
            hint = f"did you mean {'.'.join(loc[:-1] + [guess])}?" if guess else f"valid keys here: {', '.join(valid)}"
            out.append(f"{key}: unknown key; {hint}")
        else:
            got = e.get("input")
            got_s = json.dumps(got) if isinstance(got, (int, float, str, bool, type(None))) else type(got).__name__
            out.append(f"{key}: {e['msg']} (got {got_s}); set it in the YAML or with --set {key}=...")
    return out


def semantic_errors(cfg: Config) -> list[str]:
    """Cross-field rules that no single field can check. Each message names the key and the fix."""
    m, p = cfg.model, cfg.parallel
    errs = range_errors(cfg) + shape_errors(m) + rope_scaling_errors(m) + moe_errors(m)
    errs += expert_parallel_errors(m, p) + family_errors(m, p) + sequence_errors(cfg)
    if not 0.0 <= cfg.finetune.freeze_layers <= 1.0:
        errs.append(f"finetune.freeze_layers: must be a fraction between 0 and 1 (got {cfg.finetune.freeze_layers})")
    errs += objective_errors(cfg)
    t = cfg.train
    if t.min_lr > t.lr:
        errs.append(f"train.min_lr: {t.min_lr} is above train.lr={t.lr}; the schedule decays from lr down to min_lr")
    errs += memory_errors(cfg) + observe_errors(cfg)
    if p.zero_stage not in (0, 1, 2, 3):
        errs.append(f"parallel.zero_stage: must be 0, 1, 2 or 3 (got {p.zero_stage})")
    if p.timeout_s < 1:
        errs.append(
            f"parallel.timeout_s: must be a positive number of seconds (got {p.timeout_s}); "
            "set it to how long a collective may wait for a slow rank, e.g. 1800 (the default)"
        )
    return errs + rules.violations(rules.flatten(cfg.model_dump()))  # what composes with what (fitlm.rules)


def range_errors(cfg: Config) -> list[str]:
    """Counts that must be at least 1, and amounts that must not be negative."""
    m, d, p, t = cfg.model, cfg.data, cfg.parallel, cfg.train
    positive = {
        "model.hidden_size": m.hidden_size,
        "model.num_layers": m.num_layers,
        "model.num_heads": m.num_heads,
        "model.vocab_size": m.vocab_size,
        "model.max_seq_len": m.max_seq_len,
        "data.seq_length": d.seq_length,
        "train.micro_batch_size": t.micro_batch_size,
        "train.gradient_accumulation_steps": t.gradient_accumulation_steps,
        "train.max_steps": t.max_steps,
        "train.log_interval": t.log_interval,
        "parallel.data_parallel": p.data_parallel,
        "parallel.tensor_parallel": p.tensor_parallel,
        "parallel.pipeline_parallel": p.pipeline_parallel,
        "parallel.context_parallel": p.context_parallel,
        "parallel.expert_parallel": p.expert_parallel,
        "parallel.micro_batch_num": p.micro_batch_num,
        "checkpoint.keep_last": cfg.checkpoint.keep_last,
    }
    nonneg: dict[str, float] = {
        "train.warmup_steps": t.warmup_steps,
        "train.eval_interval": t.eval_interval,
        "train.grad_clip": t.grad_clip,
        "train.weight_decay": t.weight_decay,
        "train.eval_steps": t.eval_steps,
        "checkpoint.interval": cfg.checkpoint.interval,
    }
    return [f"{key}: must be at least 1 (got {v})" for key, v in positive.items() if v < 1] + [
        f"{key}: must not be negative (got {v})" for key, v in nonneg.items() if v < 0
    ]


def shape_errors(m: ModelConfig) -> list[str]:
    """Heads, head size, grouped-query heads, sliding window and layer types that cannot build a model."""
    errs: list[str] = []
    if m.num_kv_heads is not None and m.num_kv_heads < 1:
        errs.append(f"model.num_kv_heads: must be at least 1 or null (got {m.num_kv_heads})")
    if m.num_heads >= 1 and m.head_dim is None and m.hidden_size % m.num_heads:
        errs.append(
            f"model.hidden_size: {m.hidden_size} is not divisible by model.num_heads={m.num_heads}; "
            f"pick a hidden_size that is a multiple of num_heads (e.g. {m.num_heads * max(1, round(m.hidden_size / m.num_heads))}) "
            f"or set model.head_dim"
        )
    if m.head_dim is not None and m.head_dim < 1:
        errs.append(f"model.head_dim: must be at least 1 or null (got {m.head_dim})")
    if m.num_kv_heads and m.num_heads >= 1 and m.num_kv_heads >= 1 and m.num_heads % m.num_kv_heads:
        errs.append(
            f"model.num_kv_heads: {m.num_heads} heads cannot be grouped into {m.num_kv_heads} kv heads; "
            f"num_kv_heads must divide num_heads (valid: {divisors(m.num_heads)})"
        )
    if m.sliding_window is not None and m.sliding_window < 1:
        errs.append(f"model.sliding_window: must be at least 1 token or null (got {m.sliding_window})")
    if m.layer_types is not None and len(m.layer_types) != m.num_layers:
        errs.append(
            f"model.layer_types: lists {len(m.layer_types)} blocks but model.num_layers={m.num_layers}; "
            f"give one entry per block or null for the family's pattern"
        )
    return errs


def family_errors(m: ModelConfig, p: ParallelConfig) -> list[str]:
    """model.arch: a registered family, what the family itself cannot build, dense vs MoE, pipeline support."""
    if m.arch not in registry.model_names():
        return [f"model.arch: unknown family {m.arch!r}; registered: {', '.join(registry.model_names())}"]
    if m.num_heads < 1 or m.num_layers < 1:
        return []
    spec = m.spec
    errs = list(spec.validate(m))  # what the family itself cannot build (e.g. gpt2 has no GQA)
    routed = [s.name for s in registry.specs() if s.moe]
    if m.moe and not spec.moe:
        errs.append(
            f"model.num_experts: arch {m.arch!r} is dense; leave num_experts null, or use an MoE family "
            f"({', '.join(routed)})"
        )
    elif spec.moe and not m.moe:
        errs.append(f"model.num_experts: arch {m.arch!r} is a mixture of experts; set num_experts (e.g. 8)")
    if p.pipeline_parallel > 1 and not spec.pipeline_parallel:
        errs.append(
            f"parallel.pipeline_parallel: model.arch={m.arch!r} cannot be pipeline-parallel yet; set it to 1 "
            f"and shard with data_parallel and zero_stage 3"
        )
    return errs


def sequence_errors(cfg: Config) -> list[str]:
    """data.seq_length against the model's context and context parallel's chunks."""
    d, m, cp = cfg.data, cfg.model, cfg.parallel.context_parallel
    errs = []
    if cp > 1 and d.seq_length % (2 * cp):
        errs.append(
            f"data.seq_length: {d.seq_length} cannot be split into the 2 × parallel.context_parallel = {2 * cp} "
            f"equal chunks context parallel balances over its ranks; use a multiple of {2 * cp} "
            f"(e.g. {max(2 * cp, d.seq_length // (2 * cp) * 2 * cp)}) or another context_parallel"
        )
    if d.seq_length > m.max_seq_len:
        errs.append(
            f"data.seq_length: {d.seq_length} exceeds model.max_seq_len={m.max_seq_len}; "
            f"lower data.seq_length or raise model.max_seq_len"
        )
    return errs


def objective_errors(cfg: Config) -> list[str]:
    """The training objective and the data it needs: DPO and SimPO read preference pairs, and only they do."""
    f, fmt = cfg.finetune, cfg.data.format
    errs = []
    if f.pairs and fmt != "preference":
        errs.append(
            f"finetune.objective: {f.objective} trains on preference pairs but data.format is {fmt!r}; pack "
            "(prompt, chosen, rejected) rows with `fitlm data pack --format preference` and set "
            "data.format: preference"
        )
    if fmt == "preference" and not f.pairs:
        errs.append(
            f"data.format: preference pairs need finetune.objective: dpo or simpo (it is {f.objective!r}); "
            "set finetune.objective: dpo (or simpo), or pack the data with --format chat for supervised "
            "fine-tuning"
        )
    if f.dpo.beta <= 0:
        errs.append(f"finetune.dpo.beta: must be positive (got {f.dpo.beta}); 0.1 is the usual value")
    if f.simpo.beta <= 0:
        errs.append(f"finetune.simpo.beta: must be positive (got {f.simpo.beta}); 2.0 is the SimPO paper's value")
    return errs


def expert_parallel_errors(m: ModelConfig, p: ParallelConfig) -> list[str]:
    """parallel.expert_parallel against the model's experts and the data-parallel ranks it is carved out of."""
    ep = p.expert_parallel
    if ep <= 1:
        return []
    if not m.num_experts:
        return [
            f"parallel.expert_parallel: {ep} splits the experts of an MoE model, but model.arch={m.arch!r} has none "
            "(model.num_experts is null); set expert_parallel: 1"
        ]
    errs = []
    if p.data_parallel % ep:
        errs.append(
            f"parallel.expert_parallel: {ep} ranks are taken from the data-parallel ranks, so it must divide "
            f"parallel.data_parallel={p.data_parallel}; use one of {divisors(p.data_parallel)}"
        )
    if m.num_experts % ep:
        errs.append(
            f"parallel.expert_parallel: {ep} ranks cannot split model.num_experts={m.num_experts} experts "
            f"evenly; use one of {divisors(m.num_experts)}"
        )
    return errs


def moe_errors(m: ModelConfig) -> list[str]:
    """The expert counts of an MoE model section; which families route is each family's own check."""
    if m.num_experts is None:
        return []
    errs = []
    if m.num_experts < 1:
        errs.append(f"model.num_experts: must be at least 1, or null for a dense model (got {m.num_experts})")
    elif not 1 <= m.num_experts_per_tok <= m.num_experts:
        errs.append(
            f"model.num_experts_per_tok: each token goes to 1..num_experts={m.num_experts} experts "
            f"(got {m.num_experts_per_tok})"
        )
    if m.decoder_sparse_step < 1:
        errs.append(f"model.decoder_sparse_step: must be at least 1 (got {m.decoder_sparse_step})")
    outside = [i for i in m.mlp_only_layers if not 0 <= i < m.num_layers]
    if outside:
        errs.append(f"model.mlp_only_layers: {outside} are not blocks of a {m.num_layers}-layer model")
    if m.router_aux_loss_coef < 0:
        errs.append(f"model.router_aux_loss_coef: must not be negative (got {m.router_aux_loss_coef}); 0 turns it off")
    return errs


def rope_scaling_errors(m: ModelConfig) -> list[str]:
    """What a model.rope_scaling section lacks to be computed."""
    sc = m.rope_scaling
    if sc is None:
        return []
    errs = []
    if sc.type in ("linear", "dynamic", "llama3") and not sc.factor:
        errs.append(f"model.rope_scaling.factor: type {sc.type!r} needs a factor (e.g. 8.0)")
    if sc.type == "longrope":
        half = m.head_size // 2
        for key in ("short_factor", "long_factor"):
            values = getattr(sc, key)
            if values is None or len(values) != half:
                errs.append(
                    f"model.rope_scaling.{key}: longrope needs head_dim/2 = {half} values "
                    f"(got {None if values is None else len(values)})"
                )
    return errs


def memory_errors(cfg: Config) -> list[str]:
    """Ranges in the memory section and of the learning-rate scaling (what composes with what: fitlm.rules)."""
    mem, t = cfg.memory, cfg.train
    errs = []
    if mem.recompute_every_n_layers < 1:
        errs.append(f"memory.recompute_every_n_layers: must be at least 1 (got {mem.recompute_every_n_layers})")
    if mem.loss_chunk_size < 0:
        errs.append(f"memory.loss_chunk_size: must be 0 (off) or a positive token count (got {mem.loss_chunk_size})")
    if not isinstance(mem.loss_scale, str) and mem.loss_scale <= 0:
        errs.append(f"memory.loss_scale: a static scale must be positive (got {mem.loss_scale}); or use dynamic")
    ls = mem.loss_scaling
    if ls.initial_scale <= 0 or ls.growth_factor < 1 or not 0 < ls.backoff_factor < 1 or ls.growth_interval < 1:
        errs.append(
            "memory.loss_scaling: needs initial_scale > 0, growth_factor >= 1, 0 < backoff_factor < 1 "
            f"and growth_interval >= 1 (got {ls.model_dump()})"
        )
    if t.lr_reference_batch is not None and t.lr_reference_batch < 1:
        errs.append(f"train.lr_reference_batch: must be at least 1 sequence or null (got {t.lr_reference_batch})")
    return errs


def observe_errors(cfg: Config) -> list[str]:
    """Ranges of the run's observers (train.observe: guards, consistency, balance, profiler window)."""
    t, g = cfg.train.observe, cfg.train.observe.guards
    errs: list[str] = []
    v: float  # (int settings first, then float ones)
    for key, v, least in (("window", g.window, 2), ("rollback_after", g.rollback_after, 1)):
        if v < least:
            errs.append(f"train.observe.guards.{key}: must be at least {least} (got {v})")
    nonneg = {
        "train.observe.guards.warmup_steps": g.warmup_steps,
        "train.observe.guards.max_rollbacks": g.max_rollbacks,
        "train.observe.guards.loss_spike_sigma": g.loss_spike_sigma,
        "train.observe.guards.grad_spike_sigma": g.grad_spike_sigma,
        "train.observe.consistency_interval": t.consistency_interval,
        "train.observe.balance_threshold": t.balance_threshold,
        "train.observe.data_wait_warn": t.data_wait_warn,
    }
    for key, v in nonneg.items():
        if v < 0:
            errs.append(f"{key}: must not be negative (got {v})")
    if 0 < t.balance_threshold <= 1:
        errs.append(
            f"train.observe.balance_threshold: a factor above 1 (e.g. 1.5) or 0 to turn it off (got {t.balance_threshold})"
        )
    ps = t.profile_steps
    if ps is not None and (len(ps) != 2 or ps[0] < 1 or ps[1] < ps[0]):
        errs.append(
            f"train.observe.profile_steps: needs [first, last] with 1 <= first <= last, e.g. [10, 12] (got {ps})"
        )
    return errs


# Keys that moved to a section by concern: a config that still uses the old key is refused naming the new one.
MOVED_KEYS = {f"train.{k}": f"train.observe.{k}" for k in ObserveConfig.model_fields}


def _without_moved_keys(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`data` without keys that moved (so the rest is still checked), and one error per moved key."""
    errs: list[str] = []
    train = data.get("train")
    if not isinstance(train, dict):
        return data, errs
    for old, new in MOVED_KEYS.items():
        key = old.split(".", 1)[1]
        if key in train:
            errs.append(
                f"{old}: moved to {new} (the run's observers have their own section); write it under "
                f"train: observe: in the YAML, or `--set {new}=...`"
            )
    return {**data, "train": {k: v for k, v in train.items() if f"train.{k}" not in MOVED_KEYS}}, errs


def upgrade_moved_keys(data: dict[str, Any]) -> dict[str, Any]:
    """A config that fitlm itself wrote before keys moved (a model directory's or a checkpoint's config.yaml),
    with each old key moved to its new place: files fitlm wrote stay readable; users get told (validate_dict)."""
    train = data.get("train")
    if not isinstance(train, dict) or not any(f"train.{k}" in MOVED_KEYS for k in train):
        return data
    observe = dict(train.get("observe") or {})
    kept = {}
    for k, v in train.items():
        if f"train.{k}" in MOVED_KEYS:
            observe.setdefault(k, v)
        else:
            kept[k] = v
    return {**data, "train": {**kept, "observe": observe}}


def validate_dict(data: dict[str, Any], source: str | None = None, written_by_fitlm: bool = False) -> Config:
    """Validate a raw mapping; raises ConfigError listing every problem found. `written_by_fitlm`: a config
    fitlm wrote (model directory, checkpoint) whose moved keys are upgraded instead of refused."""
    data, moved = _without_moved_keys(upgrade_moved_keys(data) if written_by_fitlm else data)
    try:
        cfg = Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(moved + _schema_errors(e), source) from None
    errs = moved + semantic_errors(cfg)
    if errs:
        raise ConfigError(errs, source)
    return cfg


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, written_by_fitlm: bool = False
) -> Config:
    """Load `path` (YAML), apply `--set` overrides, validate. Raises ConfigError with all problems.
    `written_by_fitlm`: the config.yaml of a model directory or run (see validate_dict)."""
    data = load_yaml(path) if path is not None else {}
    apply_overrides(data, list(overrides or []))
    return validate_dict(data, str(path) if path is not None else None, written_by_fitlm)


# --------------------------------------------------------------------------- reference docs


def config_reference_markdown() -> str:
    """The README's config reference, rendered from the field docstrings."""

    def fmt(v: Any) -> str:
        if isinstance(v, BaseModel):
            return ""
        return "`" + json.dumps(v) + "`" if not isinstance(v, str) else f"`{v}`"

    lines = ["| key | default | meaning |", "| --- | --- | --- |"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            ann = field.annotation
            key = f"{prefix}{name}"
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, key + ".")
                continue
            default = field.get_default(call_default_factory=True)
            desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
            lines.append(f"| `{key}` | {fmt(default)} | {desc} |")
            # An optional section (e.g. model.rope_scaling: null or a mapping): its keys, when given.
            for arg in typing.get_args(ann):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    walk(arg, key + ".")

    walk(Config, "")
    return "\n".join(lines) + "\n"
