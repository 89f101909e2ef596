"""The semantic checks of a validated config: what no single field's type can say (divisibility, one
section against another, the family's own refusals, what composes with what: fitlm.rules). Each message
names the key and the fix."""

from __future__ import annotations

from fitlm import registry, rules
from fitlm.config.model_schema import ModelConfig
from fitlm.config.schema import Config, ParallelConfig
from fitlm.parallel_dims import divisors


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
        multiple = m.num_heads * max(1, round(m.hidden_size / m.num_heads))
        errs.append(
            f"model.hidden_size: {m.hidden_size} is not divisible by model.num_heads={m.num_heads}; "
            f"pick a hidden_size that is a multiple of num_heads (e.g. {multiple}) or set model.head_dim"
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
            "train.observe.balance_threshold: a factor above 1 (e.g. 1.5) or 0 to turn it off "
            f"(got {t.balance_threshold})"
        )
    ps = t.profile_steps
    if ps is not None and (len(ps) != 2 or ps[0] < 1 or ps[1] < ps[0]):
        errs.append(
            f"train.observe.profile_steps: needs [first, last] with 1 <= first <= last, e.g. [10, 12] (got {ps})"
        )
    return errs
