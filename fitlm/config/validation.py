"""The semantic checks of a validated config: what no single field's type can say (divisibility, one
section against another, the family's own refusals, what composes with what: fitlm.rules). Each message
names the key and the fix."""

from __future__ import annotations

from fitlm import registry, rules
from fitlm.config.model_schema import ModelConfig
from fitlm.config.schema import Config, ParallelConfig
from fitlm.parallel_dims import divisors


def semantic_errors(cfg: Config) -> list[str]:
    """Rules no single field can check (a field's own range is its pydantic constraint, fitlm.config.schema).
    Each message names the key and the fix."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    errs = shape_errors(m) + rope_scaling_errors(m) + moe_errors(m)
    errs += expert_parallel_errors(m, p) + family_errors(m, p) + sequence_errors(cfg) + objective_errors(cfg)
    if t.min_lr > t.lr and t.lr_schedule != "constant":  # (a constant schedule never reads min_lr)
        errs.append(
            f"train.min_lr: {t.min_lr} is above train.lr={t.lr}; the {t.lr_schedule} schedule decays from lr down to "
            f"min_lr: set train.min_lr below lr (e.g. {t.lr / 10:g}, a tenth), or train.lr_schedule: constant"
        )
    errs += memory_errors(cfg) + observe_errors(cfg)
    return errs + rules.violations(rules.flatten(cfg.model_dump()))  # what composes with what (fitlm.rules)


def shape_errors(m: ModelConfig) -> list[str]:
    """Heads, head size, grouped-query heads, sliding window and layer types that cannot build a model."""
    errs: list[str] = []
    if m.head_dim is None and m.hidden_size % m.num_heads:
        multiple = m.num_heads * max(1, round(m.hidden_size / m.num_heads))
        errs.append(
            f"model.hidden_size: {m.hidden_size} is not divisible by model.num_heads={m.num_heads}; "
            f"pick a hidden_size that is a multiple of num_heads (e.g. {multiple}) or set model.head_dim"
        )
    if m.num_kv_heads and m.num_heads % m.num_kv_heads:
        errs.append(
            f"model.num_kv_heads: {m.num_heads} heads cannot be grouped into {m.num_kv_heads} kv heads; "
            f"num_kv_heads must divide num_heads (valid: {divisors(m.num_heads)})"
        )
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
        # With model.init_from the context is the checkpoint's: raising it beside init_from is a conflict.
        fix = "lower data.seq_length" + ("" if m.init_from else " or raise model.max_seq_len")
        errs.append(f"data.seq_length: {d.seq_length} exceeds model.max_seq_len={m.max_seq_len}; {fix}")
    return errs


def objective_errors(cfg: Config) -> list[str]:
    """The training objective and the data it needs: DPO and SimPO read preference pairs, and only they do;
    GRPO reads prompts, and only it does."""
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
    if (f.objective == "grpo") != (fmt == "prompts"):
        errs.append(
            f"finetune.objective: {f.objective} with data.format {fmt!r}: GRPO samples completions for prompts, "
            "and prompts are only for GRPO; set finetune.objective: grpo with data.format: prompts, or neither"
        )
    return errs + (grpo_errors(cfg) if f.objective == "grpo" else [])


def grpo_errors(cfg: Config) -> list[str]:
    """finetune.grpo against the batch (TRL counts it in completions, G per prompt) and its reward functions."""
    g, t, dp = cfg.finetune.grpo, cfg.train, cfg.parallel.data_parallel
    completions = t.micro_batch_size * t.gradient_accumulation_steps * dp
    errs = []
    if completions % g.num_generations:
        errs.append(
            f"finetune.grpo.num_generations: a step holds train.micro_batch_size × gradient_accumulation_steps × "
            f"parallel.data_parallel = {completions} completions, which {g.num_generations} per prompt do not "
            f"divide; use num_generations in {[d for d in divisors(completions) if d >= 2]} or change the batch"
        )
    elif (completions // dp) % g.num_generations:
        per_rank = completions // dp
        errs.append(
            f"finetune.grpo.num_generations: each data-parallel rank samples whole groups, but its "
            f"train.micro_batch_size × gradient_accumulation_steps = {per_rank} completions are not a multiple of "
            f"{g.num_generations}; use num_generations in {[d for d in divisors(per_rank) if d >= 2]} or raise "
            "micro_batch_size or gradient_accumulation_steps"
        )
    if not g.reward_funcs:
        errs.append(
            "finetune.grpo.reward_funcs: GRPO learns from rewards but none is named; list at least one, e.g. "
            "[answer_equals] or [rewards.py:check]"
        )
    if g.reward_weights is not None and len(g.reward_weights) != len(g.reward_funcs):
        errs.append(
            f"finetune.grpo.reward_weights: {len(g.reward_weights)} weights for {len(g.reward_funcs)} "
            "reward_funcs; give one weight per function, or null for 1.0 each"
        )
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
    """The routing settings of an MoE model section, checked only when it has experts (a dense model ignores
    them); which families route is each family's own check."""
    if m.num_experts is None:
        return []
    errs = []
    if not 1 <= m.num_experts_per_tok <= m.num_experts:
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
    """memory.loss_scale: `dynamic` or a positive number. Not a field constraint: on a union pydantic reports
    one error per member (the literal and the number), where one message says it all."""
    scale = cfg.memory.loss_scale
    if not isinstance(scale, str) and scale <= 0:
        return [f"memory.loss_scale: a static scale must be positive (got {scale}); or use dynamic"]
    return []


def observe_errors(cfg: Config) -> list[str]:
    """The observers' settings no single bound describes: the balance factor (0 = off, else above 1) and the
    profiler window [first, last]."""
    t = cfg.train.observe
    errs: list[str] = []
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
