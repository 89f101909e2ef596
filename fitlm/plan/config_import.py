"""`fitlm config import`: a MindSpore Transformers (MindFormers) training YAML -> a fitlm config.

Why a translator rather than a compatibility layer: MindFormers users have working setups (layout,
recompute, precision, schedule) and want to plan and train them here, once. Every source key is
accounted for: translated silently when the meaning is the same, and otherwise reported as a note
that names the key and says what was done (approximated, or dropped because fitlm has no equivalent),
so nothing is lost without the user being told.

Key names follow MindFormers' llama configs (REFERENCES.md, "MindSpore Transformers YAML"), older
and newer spellings both (num_layers / num_hidden_layers, n_kv_heads / num_key_value_heads, ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fitlm.atomic import atomic_file
from fitlm.config import Config, ConfigError, validate_dict


class ConfigImportError(ValueError):
    """The source YAML cannot be translated; the message names the file or key and the fix."""


ARCHS = {
    "llamaconfig": "llama",
    "llama2config": "llama",
    "llamaforcausallm": "llama",
    "gpt2config": "gpt2",
    "gpt2lmheadmodel": "gpt2",
}
HALF = {"float16": "fp16", "bfloat16": "bf16"}
SCHEDULES = {
    "cosinewithwarmuplr": "cosine",
    "cosinewithrestartswithwarmuplr": "cosine",
    "linearwithwarmuplr": "linear",
    "constantwarmuplr": "constant",
    "constantwithwarmuplr": "constant",
    "polynomialwithwarmuplr": "linear",
}
ADAMW = {"adamw", "fusedadamweightdecay", "adamweightdecay", "fp32stateadamweightdecay"}
# MindFormers' llama module names -> fitlm's (HF) names, for pet_config.target_modules.
LORA_NAMES = {
    "wq": "q_proj",
    "wk": "k_proj",
    "wv": "v_proj",
    "wo": "o_proj",
    "w1": "gate_proj",
    "w3": "up_proj",
    "w2": "down_proj",
    "q_proj": "q_proj",
    "k_proj": "k_proj",
    "v_proj": "v_proj",
    "o_proj": "o_proj",
    "gate_proj": "gate_proj",
    "up_proj": "up_proj",
    "down_proj": "down_proj",
}
# Why a block's keys (when not translated) have no equivalent.
BLOCK_REASONS = {
    "context": "a MindSpore runtime setting; fitlm runs PyTorch on CUDA or CPU",
    "train_dataset": "the MindSpore dataset pipeline; fitlm reads token directories made by `fitlm data pack` "
    "(set data.train)",
    "train_dataset_task": "the MindSpore dataset pipeline; fitlm reads `fitlm data pack` output (set data.train)",
    "eval_dataset": "the MindSpore dataset pipeline; set data.valid to a `fitlm data pack` directory",
    "eval_dataset_task": "the MindSpore dataset pipeline; set data.valid to a `fitlm data pack` directory",
    "processor": "tokenizer setup; fitlm uses the tokenizer.json beside the packed data (`fitlm data tokenizer`)",
    "callbacks": "a MindFormers callback; fitlm writes metrics.jsonl every train.log_interval steps",
    "trainer": "the MindFormers trainer class; fitlm has one trainer for pretraining and fine-tuning",
    "parallel": "a MindSpore auto-parallel setting; fitlm's layout is explicit in the parallel section",
    "parallel_config": "no fitlm equivalent; fitlm's layout is data × tensor × pipeline (+ ZeRO)",
    "recompute_config": "no fitlm equivalent; fitlm recomputes whole blocks (full) or element-wise ops (selective)",
    "runner_config": "a MindSpore execution setting; fitlm counts optimizer steps (train.max_steps)",
    "runner_wrapper": "a MindSpore train-cell setting with no fitlm equivalent",
    "moe_config": "mixture of experts: fitlm's models are dense",
    "model": "a MindFormers model option with no fitlm equivalent (inference, kernels or checkpoint loading)",
}


# Keys whose reason is more specific than their block's.
KEY_REASONS = {
    "load_checkpoint": "a MindSpore .ckpt cannot be read; convert the weights to Hugging Face safetensors and set "
    "model.init_from",
    "resume_training": "fitlm resumes from its own checkpoints (checkpoint.resume: auto)",
    "run_mode": "fitlm trains whenever it is given a config; fine-tuning is model.init_from + finetune.method",
    "use_parallel": "fitlm launches one process per device from the parallel layout (`fitlm train --nproc`)",
    "src_strategy_path_or_dir": "MindSpore strategy files: fitlm checkpoints reshard to any layout by themselves",
    "auto_trans_ckpt": "MindSpore strategy files: fitlm checkpoints reshard to any layout by themselves",
    "only_save_strategy": "MindSpore strategy files: fitlm checkpoints reshard to any layout by themselves",
    "micro_batch_interleave_num": "fitlm does not split micro batches to overlap communication",
    "parallel_config.vocab_emb_dp": "fitlm shards the embedding by vocabulary under tensor parallel",
    "parallel_config.gradient_aggregation_group": (
        "gradient communication fusion; DDP/FSDP2 bucket gradients themselves"
    ),
    "train_dataset.data_loader.dataset_dir": "MindRecord data cannot be read; pack the source text with "
    "`fitlm data pack` and set data.train (a placeholder is written)",
}


@dataclass
class Translation:
    source: dict[str, Any]
    path: str
    out: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {
            k: {} for k in ("model", "data", "parallel", "memory", "finetune", "train", "checkpoint")
        }
    )
    notes: list[dict[str, str]] = field(default_factory=list)
    used: set[str] = field(default_factory=set)

    def peek(self, key: str, default: Any = None) -> Any:
        """The value at a dotted source key, or `default` when absent (a block: its keys stay unhandled)."""
        node: Any = self.source
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def get(self, key: str, default: Any = None) -> Any:
        """The value at a dotted source key, marked as handled (with everything under it)."""
        value = self.peek(key, self)
        if value is self:
            return default
        self.used.add(key)
        return value

    def first(self, *keys: str) -> tuple[str | None, Any]:
        """The first of several spellings present (older and newer MindFormers names)."""
        for k in keys:
            v = self.get(k)
            if v is not None:
                return k, v
        return None, None

    def note(self, key: str, why: str) -> None:
        self.used.add(key)
        self.notes.append({"key": key, "note": why})

    def set(self, section: str, key: str, value: Any) -> None:
        self.out[section][key] = value


def read_source(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.suffix.lower() not in (".yaml", ".yml"):
        raise ConfigImportError(
            f"{p}: not a YAML file (expected .yaml or .yml); pass a MindSpore Transformers "
            "training YAML such as run_llama2_7b.yaml"
        )
    if not p.is_file():
        raise ConfigImportError(f"{p} does not exist: pass the path of a MindSpore Transformers YAML file")
    try:
        data = yaml.safe_load(p.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigImportError(
            f"{p}: malformed YAML{where}: {getattr(e, 'problem', None) or e}; fix the syntax"
        ) from None
    if not isinstance(data, dict):
        raise ConfigImportError(f"{p}: the top level must be a mapping (run_mode:, model:, parallel_config:, ...)")
    return data


def translate(source: dict[str, Any], path: str = "<yaml>") -> tuple[Config, list[dict[str, str]]]:
    """The fitlm config for a MindFormers YAML mapping, and the notes on every key not carried over exactly."""
    t = Translation(source, path)
    _model(t)
    _layout(t)
    _precision(t)
    _training(t)
    _leftovers(t)
    hint = "(these keys come from the MindFormers YAML: fix them there)"
    try:
        cfg = validate_dict(_prune(t.out), f"the translation of {path}")
    except ConfigError as e:
        raise ConfigError(e.problems + [hint], e.source) from None
    from fitlm.parallel.layout import layout_problems

    problems = layout_problems(cfg, cfg.parallel.world_size)  # the model's divisibility rules for the layout
    if problems:
        raise ConfigError(problems + [hint], f"the translation of {path}")
    return cfg, t.notes


def _model(t: Translation) -> None:
    mc = t.peek("model.model_config")
    if not isinstance(mc, dict):
        raise ConfigImportError(
            f"{t.path}: model.model_config is missing; a MindFormers training YAML describes "
            "the network there (type: LlamaConfig, hidden_size, num_layers, ...)"
        )
    key, kind = t.first("model.model_config.type", "model.arch.type")
    arch = ARCHS.get(str(kind).lower()) if kind else "llama"
    if arch is None:
        raise ConfigImportError(
            f"{t.path}: {key}: {kind} is not a model fitlm has; supported types are "
            f"{', '.join(sorted({'LlamaConfig', 'LlamaForCausalLM', 'GPT2Config'}))} "
            "(Llama 2/3-style models use LlamaConfig)"
        )
    if kind is None:
        t.note("model.model_config.type", "absent; assumed a Llama model (LlamaConfig)")
    t.get("model.arch.type")
    t.set("model", "arch", arch)
    p = "model.model_config."
    for fitlm_key, names in (
        ("hidden_size", ("hidden_size",)),
        ("num_layers", ("num_layers", "num_hidden_layers")),
        ("num_heads", ("num_heads", "num_attention_heads")),
        ("num_kv_heads", ("n_kv_heads", "num_key_value_heads")),
        ("vocab_size", ("vocab_size",)),
        ("norm_eps", ("rms_norm_eps", "layernorm_epsilon", "layer_norm_epsilon")),
        ("rope_theta", ("theta", "rope_theta")),
        ("tie_embeddings", ("tie_word_embeddings", "tie_embeddings")),
    ):
        _, v = t.first(*(p + n for n in names))
        if v is not None:
            t.set("model", fitlm_key, v)
    _, ffn = t.first(p + "intermediate_size", p + "ffn_hidden_size")
    multiple_of, mult = t.get(p + "multiple_of"), t.get(p + "ffn_dim_multiplier")
    if ffn is None and multiple_of is not None and "hidden_size" in t.out["model"]:
        # MindFormers' LlamaFeedForward: 2/3 of 4h, times ffn_dim_multiplier, rounded up to multiple_of.
        width = int(2 * 4 * t.out["model"]["hidden_size"] / 3)
        width = int(mult * width) if mult else width
        ffn = multiple_of * ((width + multiple_of - 1) // multiple_of)
    if ffn is not None:
        t.set("model", "intermediate_size", ffn)
    _, seq = t.first(p + "seq_length", p + "max_position_embeddings")
    _, max_pos = t.first(p + "max_position_embedding", p + "max_position_embeddings")
    if seq is not None:
        t.set("data", "seq_length", seq)
        t.set("model", "max_seq_len", max(seq, max_pos or 0))
    batch = t.get(p + "batch_size")
    if batch is not None:
        t.note(p + "batch_size", "ignored: the per-device batch is runner_config.batch_size (train.micro_batch_size)")
    if t.get(p + "use_flash_attention") is False:
        t.note(p + "use_flash_attention", "false: fitlm always uses fused attention (SDPA); memory follows that")
    _pet(t, mc.get("pet_config"))


def _pet(t: Translation, pet: Any) -> None:
    p = "model.model_config.pet_config."
    if not isinstance(pet, dict):
        return
    kind = str(t.get(p + "pet_type", "")).lower()
    if kind != "lora":
        t.note(p + "pet_type", f"{kind or 'absent'}: fitlm fine-tunes with lora, freeze or full; kept full")
        return
    t.set("finetune", "method", "lora")
    lora: dict[str, Any] = {}
    for src, dst in (("lora_rank", "r"), ("lora_alpha", "alpha"), ("lora_dropout", "dropout")):
        if (v := t.get(p + src)) is not None:
            lora[dst] = v
    regex = t.get(p + "target_modules")
    if regex:
        names = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", str(regex))
        targets = sorted({LORA_NAMES[n] for n in names if n in LORA_NAMES})
        unknown = sorted({n for n in names if n not in LORA_NAMES})
        if targets:
            lora["target_modules"] = targets
        t.note(
            p + "target_modules",
            f"regex {regex!r} read as module names {targets or 'none (default q_proj, v_proj)'}"
            + (f"; unrecognised parts {unknown} ignored" if unknown else ""),
        )
    t.set("finetune", "lora", lora)


def _layout(t: Translation) -> None:
    pc = "parallel_config."
    dp, tp, pp = (int(t.get(pc + k, 1) or 1) for k in ("data_parallel", "model_parallel", "pipeline_stage"))
    cp = int(t.get(pc + "context_parallel", 1) or 1)
    if cp > 1:
        dp *= cp
        t.note(
            pc + "context_parallel",
            f"{cp}: fitlm has no context parallel; its ranks were folded into "
            f"data_parallel ({dp}), so the device count is unchanged",
        )
    t.out["parallel"].update(data_parallel=dp, tensor_parallel=tp, pipeline_parallel=pp)
    mbn = t.get(pc + "micro_batch_num")
    if mbn is not None and pp > 1:
        t.set("parallel", "micro_batch_num", mbn)
    elif mbn is not None and mbn != 1:
        t.note(pc + "micro_batch_num", f"{mbn}: only meaningful with pipeline_stage > 1; set to 1")
    sp = t.get(pc + "use_seq_parallel")
    if sp and tp > 1:
        t.set("parallel", "sequence_parallel", True)
    elif sp:
        t.note(pc + "use_seq_parallel", "true with model_parallel 1: nothing to shard; left off")
    _, shard = t.first("parallel.enable_parallel_optimizer", pc + "optimizer_shard")
    if shard and dp > 1:
        stage = 1 if tp == 1 and pp == 1 else 2
        t.set("parallel", "zero_stage", stage)
        key = (
            "parallel.enable_parallel_optimizer"
            if "enable_parallel_optimizer" in (t.source.get("parallel") or {})
            else pc + "optimizer_shard"
        )
        t.note(
            key,
            f"true: MindSpore's parallel optimizer shards optimizer states (and weights) over data parallel; "
            f"approximated by parallel.zero_stage: {stage}"
            + ("" if stage == 1 else " (FSDP2; ZeRO-1 works with plain data parallel only)")
            + "; try zero_stage 3 in `fitlm plan --search`",
        )
    elif shard:
        t.note("parallel.enable_parallel_optimizer", "true with data_parallel 1: nothing to shard; zero_stage 0")
    rc = "recompute_config."
    full, select = t.get(rc + "recompute"), t.get(rc + "select_recompute")
    if isinstance(full, list) or isinstance(select, list):
        t.note(
            rc + ("recompute" if isinstance(full, list) else "select_recompute"),
            "per-stage layer counts approximated: every block recomputed in the same mode",
        )
    if _truthy(full):
        t.set("memory", "recompute", "full")
        if _truthy(select):
            t.note(rc + "select_recompute", "ignored: recompute (full) already recomputes the whole block")
    elif _truthy(select):
        t.set("memory", "recompute", "selective")


def _truthy(v: Any) -> bool:
    return any(_truthy(x) for x in v) if isinstance(v, list) else bool(v)


def _precision(t: Translation) -> None:
    p = "model.model_config."
    compute = str(t.get(p + "compute_dtype", "float32")).lower()
    params = str(t.get(p + "param_init_type", "float32")).lower()
    if compute in HALF:
        t.set("memory", "half_dtype", HALF[compute])
        t.set("memory", "mixed_precision", "O3" if params == compute else "O2")
    elif compute != "float32":
        t.note(p + "compute_dtype", f"{compute}: not a dtype fitlm computes in; kept fp32 (O0)")
    for key in ("softmax_compute_type", "layernorm_compute_type", "rotary_dtype"):
        v = t.get(p + key)
        if v is not None and str(v).lower() != "float32":
            t.note(
                p + key,
                f"{v}: fitlm keeps softmax statistics, norm statistics and RoPE tables in fp32 at every "
                "precision level",
            )
    rw = "runner_wrapper.scale_sense."
    kind = str(t.get(rw + "type", "")).lower()
    if "dynamic" in kind:
        ls = {}
        for src, dst in (
            ("loss_scale_value", "initial_scale"),
            ("scale_factor", "growth_factor"),
            ("scale_window", "growth_interval"),
        ):
            if (v := t.get(rw + src)) is not None:
                ls[dst] = v
        if "growth_factor" in ls:
            ls["backoff_factor"] = 1.0 / ls["growth_factor"]
        t.set("memory", "loss_scaling", ls)
    elif "fixed" in kind and (v := t.get(rw + "loss_scale_value")) is not None:
        t.set("memory", "loss_scale", float(v))
    elif isinstance(t.peek("runner_wrapper.scale_sense"), (int, float)):
        t.set("memory", "loss_scale", float(t.get("runner_wrapper.scale_sense")))
    if compute == "bfloat16" and t.peek("runner_wrapper.scale_sense") is not None:
        t.note("runner_wrapper.scale_sense", "bf16 needs no loss scaling: fitlm scales only fp16 losses")
    clip, norm = t.get("runner_wrapper.use_clip_grad"), t.get("runner_wrapper.max_grad_norm")
    if clip is False:
        t.set("train", "grad_clip", 0.0)
    elif norm is not None:
        t.set("train", "grad_clip", float(norm))


def _training(t: Translation) -> None:
    tr = t.out["train"]
    for src, dst in (
        ("runner_config.batch_size", "micro_batch_size"),
        ("runner_config.gradient_accumulation_steps", "gradient_accumulation_steps"),
        ("optimizer.beta1", "beta1"),
        ("optimizer.beta2", "beta2"),
        ("optimizer.eps", "eps"),
        ("optimizer.weight_decay", "weight_decay"),
        ("seed", "seed"),
        ("output_dir", "output_dir"),
    ):
        v = t.get(src)
        if v is not None:
            tr[dst] = v
    chunks = t.out["parallel"].get("micro_batch_num", 1)
    if chunks > 1:  # MindFormers: batch_size per pipeline micro batch; fitlm splits one micro batch into chunks
        tr["micro_batch_size"] = tr.get("micro_batch_size", 1) * chunks
        t.note(
            "parallel_config.micro_batch_num",
            f"{chunks}: fitlm splits each micro batch into micro_batch_num "
            f"pipeline chunks, so train.micro_batch_size = batch_size × "
            f"{chunks} = {tr['micro_batch_size']} (same global batch)",
        )
    kind = t.get("optimizer.type")
    if kind is not None and str(kind).lower() not in ADAMW:
        t.note("optimizer.type", f"{kind}: fitlm trains with AdamW; its betas, eps and weight decay were kept")
    _, lr = t.first("lr_schedule.learning_rate", "optimizer.learning_rate")
    if lr is not None:
        tr["lr"] = float(lr)
        if t.get("optimizer.learning_rate") is not None and t.get("lr_schedule.learning_rate") is not None:
            t.note("optimizer.learning_rate", "superseded by lr_schedule.learning_rate (train.lr)")
    sched = t.get("lr_schedule.type")
    if sched is not None:
        tr["lr_schedule"] = SCHEDULES.get(str(sched).lower(), "cosine")
        if str(sched).lower() not in SCHEDULES:
            t.note("lr_schedule.type", f"{sched}: approximated by a cosine decay after linear warmup")
    lr_end = t.get("lr_schedule.lr_end")
    tr["min_lr"] = float(lr_end) if lr_end is not None else min(float(tr.get("lr", 3e-4)), 3e-5)
    total = t.get("lr_schedule.total_steps")
    if total is not None and int(total) > 0:
        tr["max_steps"] = int(total)
    elif t.get("runner_config.epochs") is not None:
        t.note(
            "runner_config.epochs",
            "fitlm counts optimizer steps: set train.max_steps (epochs × sequences / "
            "global batch); the default was kept",
        )
    warm, ratio = t.get("lr_schedule.warmup_steps"), t.get("lr_schedule.warmup_ratio")
    if warm is not None:
        tr["warmup_steps"] = int(warm)
    elif ratio is not None and "max_steps" in tr:
        tr["warmup_steps"] = round(float(ratio) * tr["max_steps"])
    elif ratio is not None:
        t.note("lr_schedule.warmup_ratio", "needs lr_schedule.total_steps to become train.warmup_steps; default kept")
    if t.get("runner_config.epochs") is not None and "max_steps" in tr:
        t.note("runner_config.epochs", f"ignored: lr_schedule.total_steps sets train.max_steps ({tr['max_steps']})")
    for i, cb in enumerate(t.peek("callbacks") or []):
        if isinstance(cb, dict) and cb.get("type") == "CheckpointMonitor":
            for src, dst in (("save_checkpoint_steps", "interval"), ("keep_checkpoint_max", "keep_last")):
                if src in cb:
                    t.out["checkpoint"][dst] = cb[src]
                    t.used.add(f"callbacks[{i}].{src}")
            t.used.add(f"callbacks[{i}].type")
    context_memory = t.get("context.max_device_memory")
    if context_memory is not None:
        t.note(
            "context.max_device_memory",
            f"{context_memory}: plan against it with `fitlm plan CONFIG "
            f"--device-memory {str(context_memory).replace(' ', '')}`",
        )
    if str(t.get("context.device_target", "")).lower() == "ascend":
        t.note("context.device_target", "Ascend: fitlm trains on CUDA or CPU; plan for it with --device ascend-910b")


def _leaves(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [leaf for k, v in node.items() for leaf in _leaves(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(node, list) and node and any(isinstance(x, dict) for x in node):
        return [leaf for i, v in enumerate(node) for leaf in _leaves(v, f"{prefix}[{i}]")]
    return [prefix]


def _leftovers(t: Translation) -> None:
    """A note for every source key that nothing above translated or commented on."""
    covered = lambda key: any(key == u or key.startswith(u + ".") or key.startswith(u + "[") for u in t.used)  # noqa: E731
    for key in _leaves(t.source):
        if not covered(key):
            block = re.split(r"[.\[]", key, maxsplit=1)[0]
            why = KEY_REASONS.get(key) or BLOCK_REASONS.get(block, "no fitlm equivalent")
            t.notes.append({"key": key, "note": "dropped: " + why})


def _prune(out: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {k: v for k, v in out.items() if v}


def import_file(src: str | Path, out: str | Path, force: bool = False) -> tuple[Config, list[dict[str, str]]]:
    """Translate `src` and write the fitlm config to `out` atomically (never a half-written file)."""
    out = Path(out)
    if out.exists() and not force:
        raise ConfigImportError(f"{out} already exists; choose another --out or pass --force to replace it")
    if out.exists() and out.is_dir():
        raise ConfigImportError(f"{out} is a directory; --out names the config file to write, e.g. {out}/config.yaml")
    cfg, notes = translate(read_source(src), str(src))
    header = [f"# fitlm config imported from {src} by `fitlm config import`."]
    header += [f"# note: {n['key']}: {n['note']}" for n in notes]
    text = "\n".join(header) + "\n" + cfg.to_yaml()
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out) as tmp:
        tmp.write_text(text)
    return cfg, notes
