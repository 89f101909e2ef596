"""The run configuration's schema: `Config` and its sections (data, parallel, memory, finetune, train with its
observers, checkpoint); the model section is fitlm.config.model_schema.

Each field's docstring is its user-facing help: `fitlm config docs` renders docs/config.md's config
reference from them, so the reference can never drift from the schema.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import Field

from fitlm.config.base import Section
from fitlm.config.model_schema import ModelConfig
from fitlm.parallel_dims import ParallelDims


class LoraConfig(Section):
    r: int = 8
    """LoRA rank: the inner dimension of the low-rank update B·A."""
    alpha: float = 16.0
    """LoRA scaling numerator; the update is scaled by alpha / r."""
    dropout: float = 0.0
    """Dropout applied to the LoRA branch input."""
    target_modules: list[str] = ["q_proj", "v_proj"]
    """Module names that get adapters (e.g. q_proj, v_proj), or ["all-linear"]."""


class DataConfig(Section):
    train: str = "data/train"
    """Directory of packed training tokens (written by `fitlm data pack`)."""
    valid: str | None = None
    """Directory of packed validation tokens, or null for no evaluation."""
    seq_length: Annotated[int, Field(ge=1)] = 2048
    """Tokens per training sample; must not exceed model.max_seq_len."""
    format: Literal["pretrain", "chat", "preference", "prompts"] = "pretrain"
    """`pretrain`: plain text stream. `chat`: conversations with loss on assistant turns only. `preference`: (prompt, chosen, rejected) pairs packed with `fitlm data pack --format preference`, for `finetune.objective: dpo` or `simpo`; train.micro_batch_size counts pairs. `prompts`: prompts whose completions are sampled during training (rows of `prompt` or `messages` plus the reward functions' columns, packed with `fitlm data pack --format prompts`), for `finetune.objective: grpo`."""
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


class ParallelConfig(Section):
    data_parallel: Annotated[int, Field(ge=1)] = 1
    """Data-parallel replicas (each reads a disjoint slice of every global batch)."""
    zero_stage: Annotated[int, Field(ge=0, le=3)] = 0
    """0 = replicate everything; 1 = shard optimizer states; 2 = + gradients; 3 = + parameters."""
    tensor_parallel: Annotated[int, Field(ge=1)] = 1
    """Tensor (model) parallel degree; must divide num_heads and num_kv_heads."""
    sequence_parallel: bool = False
    """Shard norms/dropout activations along the sequence across the tensor-parallel group."""
    pipeline_parallel: Annotated[int, Field(ge=1)] = 1
    """Pipeline stages; layers are split between them."""
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    """Pipeline schedule."""
    micro_batch_num: Annotated[int, Field(ge=1)] = 1
    """Pipeline chunks each micro batch is split into. All micro batches of a step go through one schedule run of micro_batch_num × gradient_accumulation_steps chunks, which must be at least pipeline_parallel; the bubble is (p-1)/(chunks+p-1) of the step."""
    pipeline_layers: list[int] | None = None
    """Blocks per pipeline stage, e.g. [5, 5, 5, 3] (one entry per virtual stage under interleaved_1f1b); null = balanced."""
    context_parallel: Annotated[int, Field(ge=1)] = 1
    """Ranks each sequence is split over (long context): every rank holds 2 of 2 × context_parallel load-balanced chunks of each sequence (chunks r and 2C−1−r, so causal attention costs every rank the same) and attention all-gathers keys and values over the group, so document masks, sliding windows and global RoPE positions stay exact. data.seq_length must be a multiple of 2 × context_parallel. Composes with data parallel, ZeRO 0–3 (sharded over data_parallel × context_parallel) and tensor parallel, not with pipeline parallel; the global batch is still micro_batch_size × data_parallel × accumulation sequences."""
    gradient_sync: Literal["auto", "every_micro_batch", "last_micro_batch"] = "auto"
    """With gradient accumulation, when data-parallel gradients are reduced: `last_micro_batch` once per step (least traffic, but ZeRO-2/3 then hold whole unsharded gradients until the last micro batch); `every_micro_batch` (ZeRO-2/3 keep only their gradient shard, for accumulation × the reduce-scatter traffic); `auto` = every micro batch under ZeRO-2/3, the last otherwise. Under pipeline parallel gradients are reduced once per step whatever this says (the step's micro batches share one schedule run)."""
    expert_parallel: Annotated[int, Field(ge=1)] = 1
    """Ranks each MoE layer's experts are split over (E / expert_parallel experts a rank), taken from the data-parallel ranks (it divides data_parallel and model.num_experts): each rank routes its own tokens and an all-to-all sends them to the ranks holding their experts and back. Attention, norms and embeddings stay data parallel; expert gradients are summed over the replicas of the same experts and scaled as every other gradient. Composes with ZeRO 0, 2 and 3 (under ZeRO-2/3 FSDP2 shards each rank's experts over the data-parallel ranks that hold the same ones, data_parallel / expert_parallel of them; otherwise they stay whole per expert rank), recompute, precision levels and accumulation; fitlm/rules.py lists what it does not compose with."""
    timeout_s: Annotated[int, Field(ge=1)] = 1800
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


class LossScalingConfig(Section):
    initial_scale: Annotated[float, Field(gt=0)] = 65536.0
    """Loss scale of the first step (dynamic scaling), a power of two."""
    growth_factor: Annotated[float, Field(ge=1)] = 2.0
    """Multiply the scale by this after growth_interval steps without overflow."""
    backoff_factor: Annotated[float, Field(gt=0, lt=1)] = 0.5
    """Multiply the scale by this when a step overflows (that step is skipped)."""
    growth_interval: Annotated[int, Field(ge=1)] = 1000
    """Overflow-free steps before the scale grows."""


class MemoryConfig(Section):
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
    recompute_every_n_layers: Annotated[int, Field(ge=1)] = 1
    """Recompute every n-th block only (1 = every block); trades memory for less recompute time."""
    cpu_offload: bool = False
    """Keep optimizer states (and with ZeRO-2/3 parameters and gradients too) in host memory; the optimizer steps on the CPU."""
    activation_offload: Literal[False, True, "blocks", "model"] = False
    """Move the tensors the forward saves for backward to host memory and back when backward needs them: `true`/`blocks` those of every decoder block (the bulk), `model` everything the forward saves (embedding and loss included). On CUDA the copies go to pinned memory on a side stream, overlapping compute; on a CPU device there is no other memory to move to and nothing changes. With recompute, only what recompute keeps (each block's input) is offloaded."""
    compile: bool = False
    """torch.compile the whole model with its loss (one process, DDP, ZeRO-1), or each block where FSDP2 (ZeRO-2/3), recompute, tensor or pipeline parallel wrap blocks (eager is the default, easier to debug)."""
    loss_chunk_size: Annotated[int, Field(ge=0)] = 0
    """Tokens per chunk of the fused output-layer + cross-entropy, so the [tokens, vocab] logits never exist whole; 0 = plain."""
    attention_backward: Literal["sdpa", "matmul", "matmul_saved"] = "sdpa"
    """Attention in training on a CPU: `sdpa` is the fused kernel, forward and backward. `matmul` keeps SDPA's forward and recomputes the probabilities in 128-row query blocks for five batched matmuls, skipping the causally masked blocks: in bf16 with rows up to ~512 tokens attention takes ~0.6x the time, holding one block's scores. `matmul_saved` computes the forward too as blocked matmuls (fp32 scores) and keeps its fp32 probabilities for backward: ~0.4x SDPA's time up to ~1,024 tokens (bf16 or fp32), for 4 bytes per attended score per layer (B·H·T·(T/2 + 64) for rows of T tokens; `fitlm plan` counts them). bench/train_throughput.py measures them. GPUs and context parallel always use their own kernels."""


class DpoConfig(Section):
    beta: Annotated[float, Field(gt=0)] = 0.1
    """DPO's β: how far the policy may move from the reference; the loss is −log σ(β · (chosen log-ratio − rejected log-ratio))."""
    reference: str | None = None
    """The frozen reference model: null = the starting model (LoRA: the base with adapters off; full/freeze: a frozen copy), or a model directory (HF or fitlm) with the same tokenizer."""


PAIR_OBJECTIVES = ("dpo", "simpo")  # finetune.objective values that train on preference pairs (2 rows a sample)


class SimpoConfig(Section):
    beta: Annotated[float, Field(gt=0)] = 2.0
    """SimPO's β: the scale of the rewards β · (average log-prob of the response per token); the loss is −log σ(β · (chosen average − rejected average) − γ). 2.0 is the SimPO paper's value (TRL's CPOConfig defaults beta to 0.1, for its other losses)."""
    gamma: float = 0.5
    """SimPO's γ: the target reward margin between chosen and rejected (TRL's `simpo_gamma`, whose default 0.5 is used here)."""


GrpoLossType = Literal["grpo", "dr_grpo", "dapo", "bnpo"]  # TRL's names for the losses fitlm computes
GRPO_LOSS_TYPES: tuple[str, ...] = get_args(GrpoLossType)


class GrpoConfig(Section):
    """finetune.grpo: Group Relative Policy Optimization, TRL's GRPOConfig names, defaults and meanings."""

    num_generations: Annotated[int, Field(ge=2)] = 8
    """G: completions sampled per prompt; each completion's advantage is its reward against its group's. Batch sizes count completions, as TRL's do: a step samples train.micro_batch_size × gradient_accumulation_steps × parallel.data_parallel / G prompts, so G must divide that product."""
    max_prompt_length: Annotated[int | None, Field(ge=1)] = 512
    """Tokens a prompt may have (TRL's former default 512); null = up to data.seq_length − max_completion_length."""
    max_completion_length: Annotated[int, Field(ge=1)] = 512
    """Tokens sampled per completion at most; one cut there is truncated. Also the constant the `dr_grpo` loss divides by."""
    temperature: Annotated[float, Field(gt=0)] = 1.0
    """Sampling temperature: higher is more random."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p; 1.0 keeps all."""
    top_k: Annotated[int, Field(ge=0)] = 0
    """Sample among the top_k most probable tokens only; 0 = no top-k filtering."""
    beta: Annotated[float, Field(ge=0)] = 0.0
    """Weight of the per-token KL to the reference model in the loss (k3 estimator exp(ref − new) − (ref − new) − 1); 0 loads no reference (TRL's default; DeepSeek-R1 used 0.001)."""
    epsilon: Annotated[float, Field(gt=0)] = 0.2
    """Clip range of the importance ratio: below 1 − epsilon it is clipped."""
    epsilon_high: Annotated[float | None, Field(gt=0)] = None
    """Upper clip: above 1 + epsilon_high the ratio is clipped; null = epsilon (the DAPO paper uses 0.28)."""
    loss_type: GrpoLossType = "dapo"
    """How per-token losses become the step's loss: `grpo` mean over each completion's tokens, then over completions (favours short correct answers); `bnpo` sum over the micro batch's tokens / their count; `dr_grpo` sum / (completions × max_completion_length); `dapo` (TRL's default) sum / the tokens of the whole step (all micro batches and ranks)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantage = reward − its group's mean, divided by (std + 1e-4) where std is the group's (`group`), the whole batch's (`batch`, PPO-Lite), or not divided (`none`, Dr. GRPO: no question-difficulty bias)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """Importance ratio new/old policy per token (`token`), or one per completion from its mean per-token log-ratio (`sequence`: GSPO, best with loss_type grpo)."""
    num_iterations: Annotated[int, Field(ge=1)] = 1
    """Policy updates per generation batch (μ); above 1 the sampling policy's log-probabilities are kept and the ratio departs from 1."""
    mask_truncated_completions: bool = False
    """Leave completions cut at max_completion_length (no end-of-sequence token) out of the loss (DAPO's advice)."""
    reward_funcs: list[str] = []
    """Reward functions, each a built-in name (fitlm.step.rewards) or `module:function` (an importable module, or a .py file such as `rewards.py:check`) with TRL's signature (prompts, completions, **columns) -> list[float | None]."""
    reward_weights: list[float] | None = None
    """Weight of each reward function in the total (one per reward_funcs entry); null = 1.0 each."""

    def longest_prompt(self, seq_length: int) -> int:
        """Tokens a prompt may have: max_prompt_length, or (null) seq_length − max_completion_length."""
        return self.max_prompt_length if self.max_prompt_length is not None else seq_length - self.max_completion_length

    def row_length(self, seq_length: int) -> int:
        """The longest row trained on: the longest prompt plus max_completion_length (each micro batch of rollouts is
        cut to its longest row), never more than seq_length."""
        return min(seq_length, self.longest_prompt(seq_length) + self.max_completion_length)


class FinetuneConfig(Section):
    method: Literal["full", "lora", "qlora", "freeze"] = "full"
    """`full` trains everything; `lora` trains adapters only; `qlora` trains adapters on a frozen base whose linear layers are stored in 4-bit NF4 (needs torchao: pip install 'fitlm[qlora]'); `freeze` freezes the bottom layers."""
    lora: LoraConfig = LoraConfig()
    """LoRA settings (used when method is `lora` or `qlora`)."""
    freeze_layers: Annotated[float, Field(ge=0, le=1)] = 0.0
    """Fraction of the bottom layers frozen when method is `freeze` (0.0-1.0; floor(fraction × layers) blocks)."""
    freeze_embeddings: bool = False
    """With method `freeze`: also freeze the token (and position) embeddings, and with them a tied output head."""
    objective: Literal["sft", "dpo", "simpo", "grpo"] = "sft"
    """`sft`: next-token cross-entropy on the target tokens. `dpo`: Direct Preference Optimization on `data.format: preference` pairs (settings in finetune.dpo). `simpo`: SimPO on the same pairs, without a reference model (settings in finetune.simpo). `grpo`: reinforcement learning from reward functions on `data.format: prompts` (settings in finetune.grpo)."""
    dpo: DpoConfig = DpoConfig()
    """DPO settings (used when objective is `dpo`)."""
    simpo: SimpoConfig = SimpoConfig()
    """SimPO settings (used when objective is `simpo`)."""
    grpo: GrpoConfig = GrpoConfig()
    """GRPO settings (used when objective is `grpo`)."""

    @property
    def pairs(self) -> bool:
        """The objective trains on preference pairs (`dpo`, `simpo`): 2 rows per sample."""
        return self.objective in PAIR_OBJECTIVES

    @property
    def adapters(self) -> bool:
        """LoRA adapters are what trains (`lora`, or `qlora` on its 4-bit base)."""
        return self.method in ("lora", "qlora")


class GuardsConfig(Section):
    nonfinite: Literal["skip", "stop", "rollback"] = "skip"
    """Loss or gradient norm NaN/Inf: `skip` the update (gradients dropped), `stop` with an error before the update, or `rollback`: skip, and after rollback_after bad steps in a row reload the last checkpoint."""
    spike: Literal["none", "warn", "skip", "stop", "rollback"] = "warn"
    """Loss or gradient-norm spike (see loss_spike_sigma, grad_spike_sigma): `warn` logs it and applies the update; `skip`, `stop`, `rollback` as for nonfinite; `none` does not look."""
    loss_spike_sigma: Annotated[float, Field(ge=0)] = 6.0
    """A loss above the running mean by this many standard deviations is a spike; 0 = loss spikes not checked."""
    grad_spike_sigma: Annotated[float, Field(ge=0)] = 10.0
    """A gradient norm (before clipping) above its running mean by this many standard deviations is a spike; 0 = not checked."""
    window: Annotated[int, Field(ge=2)] = 100
    """Accepted steps the running mean and standard deviation are taken over."""
    warmup_steps: Annotated[int, Field(ge=0)] = 100
    """Accepted steps observed before spikes are checked (early training is noisy by nature)."""
    rollback_after: Annotated[int, Field(ge=1)] = 3
    """With `rollback`: bad steps in a row (each skipped) before the last checkpoint is reloaded."""
    max_rollbacks: Annotated[int, Field(ge=0)] = 3
    """Rollbacks allowed in one run; the next bad streak after them stops the run."""


class ObserveConfig(Section):
    """train.observe: what watches a run (docs/troubleshooting.md); none of it changes what is learned."""

    guards: GuardsConfig = GuardsConfig()
    """What happens on a NaN/Inf or spiking loss or gradient norm (docs/troubleshooting.md)."""
    consistency_interval: Annotated[int, Field(ge=0)] = 100
    """Every this many steps compare a checksum of the weights of data-parallel replicas and stop if they differ; 0 = off. Not checked under ZeRO-2/3 (each rank holds a different shard)."""
    balance_threshold: Annotated[float, Field(ge=0)] = 1.5
    """Warn when one data-parallel rank's real (target) tokens or longest document exceed the mean of the other ranks by this factor over a log interval; 0 = off."""
    data_wait_warn: Annotated[float, Field(ge=0)] = 0.1
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
    eval_tasks: list[str] = []
    """lm-evaluation-harness tasks scored at every evaluation (train.eval_interval) on the weights being trained: lm-eval task names or fitlm's .jsonl task files (docs/evaluation.md); logged to metrics.jsonl as `eval/<task>/<metric>`. Needs `pip install 'fitlm[eval]'`."""
    eval_tasks_limit: Annotated[float, Field(gt=0)] | None = None
    """With eval_tasks: at most this many documents per task (below 1: a fraction of each task); null = all of them."""
    log_completions: bool = False
    """With finetune.objective: grpo, append every sampled completion to output_dir/rollouts.jsonl: one JSON object per completion with `step`, `prompt`, `completion` (text), `reward` (the weighted total), each reward function's value under its name (the function's, as TRL logs it: `check` for `rewards.py:check`; also the metrics' `rewards/<name>/mean`), and the prompt row's other columns (rank 0's completions under data parallel)."""
    oom_snapshot: bool = False
    """CUDA only: record allocator history and, on out of memory, dump a snapshot to output_dir/memory_snapshot_rank{R}.pickle (open it at pytorch.org/memory_viz)."""


class TrainConfig(Section):
    micro_batch_size: Annotated[int, Field(ge=1)] = 8
    """Sequences per forward/backward on each data-parallel rank."""
    gradient_accumulation_steps: Annotated[int, Field(ge=1)] = 1
    """Micro batches accumulated per optimizer step."""
    max_steps: Annotated[int, Field(ge=1)] = 1000
    """Optimizer steps to train."""
    lr: float = 3e-4
    """Peak learning rate (after warmup)."""
    min_lr: float = 3e-5
    """Learning rate at the end of the schedule."""
    warmup_steps: Annotated[int, Field(ge=0)] = 100
    """Linear warmup steps from 0 to lr."""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay from lr to min_lr after warmup."""
    weight_decay: Annotated[float, Field(ge=0)] = 0.1
    """AdamW decoupled weight decay (not applied to norms, biases and embeddings)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: Annotated[float, Field(ge=0)] = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    seed: int = 1234
    """Seed for initialisation and data order; runs with equal seeds are identical."""
    log_interval: Annotated[int, Field(ge=1)] = 10
    """Write a metrics.jsonl line every this many steps."""
    eval_interval: Annotated[int, Field(ge=0)] = 100
    """Evaluate on data.valid every this many steps (and at the end); 0 disables."""
    eval_steps: Annotated[int, Field(ge=0)] = 10
    """Global batches (micro_batch_size × data_parallel × gradient_accumulation_steps sequences each) per evaluation."""
    early_stopping_patience: int = 0
    """Stop when the validation loss has not improved for this many evaluations in a row (needs data.valid and eval_interval); 0 = never stop early."""
    lr_scaling: Literal["none", "sqrt"] = "none"
    """`sqrt`: multiply lr and min_lr by sqrt(global batch / lr_reference_batch) and warmup_steps by the same factor."""
    lr_reference_batch: Annotated[int | None, Field(ge=1)] = None
    """Global batch (sequences) that lr and warmup_steps were tuned for; null = micro_batch_size × data_parallel (no accumulation)."""
    output_dir: str = "runs/default"
    """Where metrics.jsonl, checkpoints/ and the final model/ go."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Compute device; `auto` takes CUDA when present."""
    host_allocator: Literal["reuse", "system"] = "reuse"
    """Host memory when training on the CPU: `reuse` makes glibc's malloc keep freed memory for the next step instead of returning it to the kernel and faulting it in again, which costs a small model's CPU step a large share of its time (bench/RESULTS.md); set once the model is loaded, one arena for all threads, so the peak resident size is unchanged; memory freed during training is not given back to the system until the run ends); `system` leaves malloc as it is. No effect on GPU training, under ZeRO-2/3 (whose gathers return each freed unit to keep a rank's host peak near its shard) or without glibc."""
    peak_tflops: float | None = None
    """Device peak TFLOP/s for MFU; null = the known peak of the GPU, or on CPU the best GEMM measured on this machine (cached in $FITLM_CACHE_DIR, default ~/.cache/fitlm, so a busy start-up does not inflate MFU). Pin it when MFU reads above 100%."""
    progress: bool = True
    """Show progress on stderr: a live bar on a terminal; elsewhere (a log file, CI, nohup) a plain line each log_interval steps and each evaluation (step/total, loss, eval loss, tokens/s, elapsed, ETA), and at the first step to end 30 s or more after the last line."""
    observe: ObserveConfig = ObserveConfig()
    """The run's observers: NaN/spike guards, replica checksums, input balance, TensorBoard, profiler window, OOM snapshot."""


class CheckpointConfig(Section):
    interval: Annotated[int, Field(ge=0)] = 0
    """Save a resumable checkpoint every this many steps; 0 = only the final model."""
    keep_last: Annotated[int, Field(ge=1)] = 3
    """Complete checkpoints kept on disk; older ones are deleted after each new one is complete."""
    resume: str = "auto"
    """`auto` continues from the latest complete checkpoint in output_dir (a fresh run when there is none); `never` refuses a used output_dir; a checkpoint directory path starts from that checkpoint (any layout) when output_dir has none of its own."""
    verify: bool = True
    """At resume, check every checkpoint file against the CRC-32 recorded when it was saved (reads the checkpoint once, split across ranks); a damaged checkpoint is reported with its file and the previous complete one is used instead."""
    on_save_error: Literal["stop", "continue"] = "stop"
    """When a checkpoint save fails for lack of disk space: `stop` (after removing the partial files; the previous checkpoint stays the latest) or `continue` training and try again at the next interval."""
    save_on_signal: bool = True
    """On SIGTERM or Ctrl-C (SIGINT), under any `interval` (0 too), save a final checkpoint at the end of the current step, say so on stderr, and exit with 143 / 130; running the same command again resumes from it (`resume: auto`). A second signal stops at once, abandoning the save. `false`: stop at the end of the step without saving, saying what a rerun starts from (the latest periodic checkpoint, or step 1)."""
    async_save: bool = False
    """Write checkpoints in a background thread (torch.distributed.checkpoint.async_save): the loop only waits for the copy to host memory; see bench/checkpoint.py for the measured step-time overhead."""


class Config(Section):
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
