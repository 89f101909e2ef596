"""GRPO's rollout phase in the plan (`finetune.objective: grpo`): what sampling holds on a device and how long it
takes, beside the training phase the engine counts over the generated batch.

A generation batch on one data-parallel rank is train.micro_batch_size × gradient_accumulation_steps completions
(`rollout_rows`), G per prompt, sampled at once by fitlm.step.sampler through fitlm.infer.batched.SlotBatch, from
the rank's whole copy of the weights (fitlm.rules refuses ZeRO-2/3 and CPU offload for GRPO). What it holds:
  - the weights and the optimizer states as trained (AdamW's moments live across steps), no gradients (the step
    zeroes them with set_to_none; DDP's buckets stay, so under DDP they count);
  - the KV cache (KVCache: per layer a k and a v [rows, kv_heads, cells, head_dim] in the embedding's dtype):
    rows × (max_prompt_length + max_completion_length) cells, the longest prompt right-aligned and room for
    every completion token. SlotBatch.add_many prefills each prompt once for its group, then builds the cache
    from those prompt caches (`KV_PREFILL`: rows / G caches of max_prompt_length cells, alive while it builds);
  - the sampling logits: last_logits' [rows, V] in the forward's dtype, the stacked first step's [rows, V], and
    the fp32 copy `.float()` makes before the copy to the CPU (none at O0).
The reference model (beta > 0) is fitlm.plan.finetune's REFERENCE term: a frozen copy under full fine-tuning,
none under LoRA/QLoRA (the adapters switched off). After sampling the cache is freed; the old and reference
log-probability forwards run per micro batch under no_grad and keep at most [b, T, V] logits, a half copy and two
fp32 ones: no more than the training loss's own at its peak, so the training phase covers them.
The training phase is the engine's step over micro_batch_size completions of max_prompt_length +
max_completion_length tokens (GrpoConfig.row_length: the rollout cuts each micro batch to its longest
row, however long data.seq_length is).

Time: sampling is memory-bound decoding. Each of the max_completion_length steps reads the weights and the cache
filled so far (on average prompt + completion/2 cells of every row) at the device's memory bandwidth, and copies
the [rows, V] fp32 logits to the host; each prompt is first run once for its group (prefill, compute-bound). The
sampling
runs once per generation batch, so a step carries 1/num_iterations of it (`grpo_sampling` in the report); the old
and reference forwards are fitlm.plan.finetune.reference_forward_flops in the training compute. Not modelled: the
CPU's top-k/top-p sampling per token, the cache build's copies, and completions that stop early (the plan
assumes every one runs to max_completion_length, the worst case).
"""

from __future__ import annotations

from fitlm.plan import finetune as ft
from fitlm.plan.setup import Setup, act_bytes, matmul_params, param_bytes, total_params
from fitlm.plan.terms import Feature, Stage, Term, TimeContext, Timed

KV_CACHE = "GRPO rollout KV cache"  # a part of `activations` at the rollout moment
KV_PREFILL = "GRPO prompts' prefill caches (one a group, while the batch cache is built)"
SAMPLING_LOGITS = "GRPO sampling logits"  # a part of `logits` at the rollout moment
SAMPLING_KEY = "grpo_sampling"  # time_breakdown_s key
LOSS_LOGITS = "GRPO loss: logits / temperature (fp32)"  # a part of `logits` at the training step's loss moment


def grpo(s: Setup) -> bool:
    return s.objective == "grpo"


def rollout_rows(s: Setup) -> int:
    """Completions one rank samples at once: micro_batch_size × gradient_accumulation_steps."""
    return s.mbs * s.accum


def prompt_length(s: Setup) -> int:
    """The longest prompt allowed (GrpoConfig.longest_prompt of the row length s.seq, which is
    GrpoConfig.row_length's)."""
    return s.cfg.finetune.grpo.longest_prompt(s.seq)


def rollout_length(s: Setup) -> int:
    """Cells of every row's cache: the longest prompt + max_completion_length."""
    return prompt_length(s) + s.cfg.finetune.grpo.max_completion_length


def kv_dtype_bytes(s: Setup) -> int:
    """The cache's dtype is the embedding weight's (CausalLM.new_kv_cache): half at O3, and at O2 where the
    embedding is frozen (stores_frozen_in_half); fp32 otherwise."""
    frozen_half = ft.frozen_in_half(s) and not ft.embeddings_train(s)
    return 2 if s.level == "O3" or frozen_half else param_bytes(s)


def kv_bytes_per_cell(s: Setup) -> int:
    """One token of one row in the cache: layers × (k, v) × kv_heads × head_dim × dtype bytes."""
    return s.layers * 2 * s.kv_heads * s.head_dim * kv_dtype_bytes(s)


def kv_cache_bytes(s: Setup) -> int:
    """The cache SlotBatch allocates for the whole generation batch: rows × (prompt + completion) cells."""
    return rollout_rows(s) * rollout_length(s) * kv_bytes_per_cell(s) if grpo(s) else 0


def kv_prefill_bytes(s: Setup) -> int:
    """The prompts' own caches, one per group (G completions share a prefill), alive while the batch's is built."""
    g = s.cfg.finetune.grpo.num_generations
    return -(-rollout_rows(s) // g) * prompt_length(s) * kv_bytes_per_cell(s) if grpo(s) else 0


def sampling_logits_bytes(s: Setup) -> int:
    """A decoding step's [rows, V] logits in the forward's dtype and the sampler's fp32 working set beside them
    (fitlm.step.sampler.sample: the scaled logits, their log-softmax, and the entropy's exp and product)."""
    return rollout_rows(s) * s.vocab * (act_bytes(s) + 4 * 4) if grpo(s) else 0


def weight_bytes(s: Setup) -> float:
    """The weights one decoding step reads: the whole model as stored (NF4 codes for QLoRA's linears; half where
    O2 stores frozen weights in half, O3; fp32 else)."""
    stored = 2 if s.level == "O3" or ft.frozen_in_half(s) else 4
    return (total_params(s) - ft.nf4_params(s)) * stored + ft.nf4_rank_bytes(s, gathered=True)


def sampling_s(s: Setup, peak_flops: float, hbm_bps: float, host_bps: float) -> float:
    """Seconds to sample one generation batch on a rank: each prompt's prefill once for its group, then
    max_completion_length memory-bound decoding steps over all rows at once."""
    rows, p = rollout_rows(s), prompt_length(s)
    steps = s.cfg.finetune.grpo.max_completion_length
    prompts = -(-rows // s.cfg.finetune.grpo.num_generations)
    prefill = prompts * p * (2.0 * matmul_params(s) + 4.0 * s.layers * s.h * p) / peak_flops
    cache_read = rows * steps * (p + steps / 2) * kv_bytes_per_cell(s)
    decode = (steps * weight_bytes(s) + cache_read) / hbm_bps
    to_host = steps * rows * s.vocab * 4 / host_bps
    return prefill + decode + to_host


def memory(st: Stage) -> list[Term]:
    """The rollout moment's KV cache (with the prompts' prefill caches) and sampling logits; the loss's scaled
    logits at the training step's loss moment."""
    s = st.s
    if not grpo(s):
        return []
    # token_logps' logits / temperature: one more fp32 [b, T, V] than the cross-entropy's path, kept for
    # logsumexp's backward (a new tensor at any temperature, 1.0 included)
    scaled = st.tokens * s.vocab / s.tp * 4 if st.has_logits else 0.0
    return [
        Term("activations", KV_CACHE, kv_cache_bytes(s), "rollout"),
        Term("activations", KV_PREFILL, kv_prefill_bytes(s), "rollout"),
        Term("logits", SAMPLING_LOGITS, sampling_logits_bytes(s), "rollout"),
        Term("logits", LOSS_LOGITS, scaled, "loss"),
    ]


def time(tc: TimeContext) -> Timed:
    """The step's share of its generation batch's sampling (1/num_iterations of it)."""
    s, dev = tc.s, tc.dev
    if not grpo(s):
        return Timed()
    once = sampling_s(s, dev.tflops * 1e12 * dev.efficiency, dev.hbm_gbs * 1e9, dev.host_link_gbs * 1e9)
    return Timed(critical={SAMPLING_KEY: once / s.cfg.finetune.grpo.num_iterations})


def summary(s: Setup) -> dict[str, int]:
    """The plan report's `finetune.grpo` section."""
    return {
        "rollout_rows_per_device": rollout_rows(s),
        "rollout_tokens_per_row": rollout_length(s),
        "kv_cache_bytes": kv_cache_bytes(s),
        "kv_prefill_bytes": kv_prefill_bytes(s),
        "sampling_logits_bytes": sampling_logits_bytes(s),
        "reference_bytes": ft.reference_bytes(s),
    }


FEATURE = Feature("grpo rollout", memory=memory, time=time)
