"""What composes with what: every "X does not compose with Y" and "X needs Y" rule, one row each.

A rule reads config values by their dotted keys (`parallel.tensor_parallel`), so the same row checks a
config when it is loaded (`fitlm.config.semantic_errors`), a run before it starts (`stage="launch"`:
rules about this machine or this build, checked by the trainer's preflight), and each candidate of
`fitlm plan --search` (a config with another layout). The README's table of refused combinations is
rendered from ROWS (`make docs`). Imports nothing from fitlm: the config stands on it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Mapping

Values = Mapping[str, Any]  # dotted config key -> value


@dataclass(frozen=True)
class Rule:
    key: str  # the key the message names first (the one to change)
    kind: str  # "refused": X does not compose with Y; "needs": X needs Y
    summary: str  # the README row: what, and the alternative
    broken: Callable[[Values], bool]
    message: Callable[[Values], str]
    stage: str = "config"  # "config": checked whenever a config is validated; "launch": before a run starts


def _split(v: Values) -> bool:
    return v["parallel.tensor_parallel"] > 1 or v["parallel.pipeline_parallel"] > 1


def _eval_tasks_split(v: Values) -> bool:
    split = (
        "parallel.tensor_parallel",
        "parallel.pipeline_parallel",
        "parallel.context_parallel",
        "parallel.expert_parallel",
    )
    return any(v[k] > 1 for k in split) or v["parallel.zero_stage"] >= 2


def _rollback_without_checkpoints(kind: str) -> Rule:
    key = f"train.observe.guards.{kind}"
    return Rule(
        key,
        "needs",
        f"`{key}: rollback` needs checkpoints (`checkpoint.interval` > 0)",
        lambda v: (
            v[key] == "rollback" and v["checkpoint.interval"] == 0 and v["checkpoint.resume"] in ("auto", "never")
        ),
        lambda v: (
            f"{key}: rollback reloads the last checkpoint, but checkpoint.interval is 0; set "
            "checkpoint.interval (e.g. 100) or choose skip or stop"
        ),
    )


def _expert_parallel_refuses(key: str, what: str, broken: Callable[[Values], bool], why: str) -> Rule:
    return Rule(
        key,
        "refused",
        f"{what} with expert parallel (`parallel.expert_parallel` > 1)",
        lambda v: v["parallel.expert_parallel"] > 1 and broken(v),
        lambda v: f"{key}: {what} with parallel.expert_parallel={v['parallel.expert_parallel']}: {why}",
    )


def tensorboard_installed() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _tracker_installed(name: str) -> Rule:
    return Rule(
        "train.observe.report_to",
        "needs",
        f"`report_to: [{name}]` needs {name} (`pip install 'fitlm[{name}]'`)",
        lambda v: name in (v["train.observe.report_to"] or ()) and not installed(name),
        lambda v: (
            f"train.observe.report_to: lists {name}, but the {name} package is not installed; "
            f"pip install 'fitlm[{name}]', or remove {name} from train.observe.report_to"
        ),
        stage="launch",
    )


def torchao_installed() -> bool:
    return importlib.util.find_spec("torchao") is not None


# finetune.objective values whose loss needs each sequence's own log-probabilities on one rank
SEQUENCE_OBJECTIVES = ("dpo", "simpo", "grpo")

ROWS: tuple[Rule, ...] = (
    Rule(
        "parallel.zero_stage",
        "refused",
        "ZeRO-1 (torch's `ZeroRedundancyOptimizer`) with tensor or pipeline parallel: use ZeRO-2/3 (FSDP2)",
        lambda v: v["parallel.zero_stage"] == 1 and _split(v),
        lambda v: (
            "parallel.zero_stage: 1 (torch's ZeroRedundancyOptimizer) works with plain data parallel only; "
            "with tensor or pipeline parallel use zero_stage 2 or 3 (FSDP2), which also shard the optimizer"
        ),
    ),
    Rule(
        "parallel.zero_stage",
        "needs",
        "ZeRO 1-3 need `data_parallel` × `context_parallel` ≥ 2 (they shard over those ranks)",
        lambda v: v["parallel.zero_stage"] > 0 and v["parallel.data_parallel"] * v["parallel.context_parallel"] == 1,
        lambda v: (
            f"parallel.zero_stage: {v['parallel.zero_stage']} shards over data-parallel ranks but "
            "data_parallel=1; raise data_parallel (or context_parallel) or set zero_stage: 0"
        ),
    ),
    Rule(
        "parallel.context_parallel",
        "refused",
        "context parallel with pipeline parallel: use tensor or data parallel",
        lambda v: v["parallel.context_parallel"] > 1 and v["parallel.pipeline_parallel"] > 1,
        lambda v: (
            f"parallel.context_parallel: {v['parallel.context_parallel']} splits sequences inside each "
            f"attention layer, which pipeline_parallel={v['parallel.pipeline_parallel']} stages do not support; "
            "set pipeline_parallel: 1 and combine context parallel with tensor_parallel or data_parallel/ZeRO"
        ),
    ),
    Rule(
        "parallel.sequence_parallel",
        "needs",
        "sequence parallel needs `tensor_parallel` ≥ 2",
        lambda v: v["parallel.sequence_parallel"] and v["parallel.tensor_parallel"] == 1,
        lambda v: (
            "parallel.sequence_parallel: shards activations across the tensor-parallel group, which has one "
            "rank; set tensor_parallel >= 2 or sequence_parallel: false"
        ),
    ),
    Rule(
        "memory.loss_chunk_size",
        "refused",
        "chunked loss with tensor parallel (which already computes the loss on vocab-sharded logits)",
        lambda v: bool(v["memory.loss_chunk_size"]) and v["parallel.tensor_parallel"] > 1,
        lambda v: (
            "memory.loss_chunk_size: tensor parallel already computes the loss on vocab-sharded logits; "
            "set loss_chunk_size to 0 with tensor_parallel > 1"
        ),
    ),
    Rule(
        "memory.loss_chunk_size",
        "refused",
        "chunked loss with pipeline parallel (the last stage computes the loss from its logits)",
        lambda v: bool(v["memory.loss_chunk_size"]) and v["parallel.pipeline_parallel"] > 1,
        lambda v: (
            "memory.loss_chunk_size: not supported with pipeline_parallel > 1 (the last stage computes "
            "the loss from its logits); set it to 0, or use data parallel / ZeRO"
        ),
    ),
    Rule(
        "memory.loss_chunk_size",
        "refused",
        "chunked loss with soft-capped logits (`model.final_logit_softcap`, Gemma 2)",
        lambda v: bool(v["memory.loss_chunk_size"]) and v["model.final_logit_softcap"] is not None,
        lambda v: (
            "memory.loss_chunk_size: the chunked loss computes plain logits, but model.final_logit_softcap "
            "caps them (Gemma 2); set loss_chunk_size to 0 for this model"
        ),
    ),
    Rule(
        "memory.cpu_offload",
        "refused",
        "CPU offload with tensor or pipeline parallel: use data parallel and ZeRO 0-3",
        lambda v: v["memory.cpu_offload"] and _split(v),
        lambda v: (
            "memory.cpu_offload: works with data parallel and ZeRO 0-3, not with tensor or pipeline "
            "parallel; set it to false or use data_parallel with zero_stage 3"
        ),
    ),
    Rule(
        "finetune.objective",
        "refused",
        "DPO, SimPO or GRPO with tensor, pipeline or context parallel: use data parallel and ZeRO 0-3",
        lambda v: v["finetune.objective"] in SEQUENCE_OBJECTIVES and (_split(v) or v["parallel.context_parallel"] > 1),
        lambda v: (
            f"finetune.objective: {v['finetune.objective']} scores whole sequences on one rank, which "
            f"tensor_parallel={v['parallel.tensor_parallel']} / pipeline_parallel="
            f"{v['parallel.pipeline_parallel']} / context_parallel={v['parallel.context_parallel']} do not "
            "give it; set all three to 1 and use data_parallel (ZeRO 0-3)"
        ),
    ),
    Rule(
        "finetune.objective",
        "refused",
        "DPO, SimPO or GRPO with the chunked loss (`memory.loss_chunk_size`), which sums tokens over the whole "
        "micro batch",
        lambda v: v["finetune.objective"] in SEQUENCE_OBJECTIVES and bool(v["memory.loss_chunk_size"]),
        lambda v: (
            f"finetune.objective: {v['finetune.objective']} needs each sequence's own log-probability, but "
            "memory.loss_chunk_size sums the loss over the whole micro batch; set memory.loss_chunk_size: 0"
        ),
    ),
    Rule(
        "memory.attention_backward",
        "refused",
        "`memory.attention_backward: matmul` or `matmul_saved` with context parallel, whose attention over gathered "
        "keys has its own backward",
        lambda v: v["memory.attention_backward"] != "sdpa" and v["parallel.context_parallel"] > 1,
        lambda v: (
            f"memory.attention_backward: {v['memory.attention_backward']} replaces the single-rank attention, but "
            f"context_parallel={v['parallel.context_parallel']} attends over keys gathered from other ranks with "
            "its own kernel; set memory.attention_backward: sdpa (or context_parallel: 1)"
        ),
    ),
    Rule(
        "finetune.method",
        "refused",
        "QLoRA with tensor, pipeline or context parallel: use data parallel and ZeRO 0-3 "
        "(ZeRO-3 shards the 4-bit base)",
        lambda v: v["finetune.method"] == "qlora" and (_split(v) or v["parallel.context_parallel"] > 1),
        lambda v: (
            "finetune.method: qlora stores the base in 4-bit NF4 blocks that tensor_parallel="
            f"{v['parallel.tensor_parallel']} / pipeline_parallel={v['parallel.pipeline_parallel']} / "
            f"context_parallel={v['parallel.context_parallel']} do not split; set all three to 1 and use "
            "data_parallel with zero_stage 3 (FSDP2 shards the 4-bit base), or finetune.method: lora"
        ),
    ),
    Rule(
        "finetune.method",
        "refused",
        "QLoRA with `memory.mixed_precision: O3`, which would turn the 4-bit base back into half weights: use O2",
        lambda v: v["finetune.method"] == "qlora" and v["memory.mixed_precision"] == "O3",
        lambda v: (
            "finetune.method: qlora keeps the frozen base in 4-bit NF4, but memory.mixed_precision: O3 stores "
            "every weight in half, the adapters included; use O2 (half compute, fp32 adapters) or O1"
        ),
    ),
    Rule(
        "memory.compile",
        "refused",
        "torch.compile of an MoE model under tensor parallel",
        lambda v: v["memory.compile"] and v["parallel.tensor_parallel"] > 1 and bool(v["model.num_experts"]),
        lambda v: (
            "memory.compile: an MoE model's routed blocks split their experts over the tensor-parallel ranks with "
            "plain tensors between DTensor layout changes and a hand-written gradient reduction, which torch.compile "
            "does not trace yet (fitlm.parallel.expert_tensor_parallel); set memory.compile: false, or "
            "tensor_parallel: 1 and split the experts with parallel.expert_parallel"
        ),
    ),
    _expert_parallel_refuses(
        "parallel.context_parallel",
        "context parallel with the experts sharded over their replicas (ZeRO-2/3, data_parallel > expert_parallel)",
        lambda v: (
            v["parallel.context_parallel"] > 1
            and v["parallel.zero_stage"] >= 2
            and v["parallel.data_parallel"] > v["parallel.expert_parallel"]
        ),
        "FSDP2 shards each rank's experts over the edp ranks and reduce-scatters their gradients there, which leaves "
        "out the context-parallel ranks' parts of the same sequences; set data_parallel equal to expert_parallel "
        "(experts whole, summed over edp x cp), zero_stage 0 or 1, or context_parallel: 1",
    ),
    _expert_parallel_refuses(
        "memory.cpu_offload",
        "CPU offload",
        lambda v: v["memory.cpu_offload"],
        "offloaded optimizer states are not kept for the expert shards; set memory.cpu_offload: false",
    ),
    _expert_parallel_refuses(
        "memory.compile",
        "torch.compile",
        lambda v: v["memory.compile"],
        "the all-to-all's token counts are data-dependent and untested under compile; set memory.compile: false",
    ),
    _expert_parallel_refuses(
        "finetune.objective",
        "DPO, SimPO, or GRPO with a frozen reference (full fine-tuning, beta > 0)",
        lambda v: (
            v["finetune.objective"] in ("dpo", "simpo")
            or (v["finetune.objective"] == "grpo" and v["finetune.method"] == "full" and v["finetune.grpo.beta"] > 0)
        ),
        "the frozen reference model is not built with split experts; train these objectives with "
        "data_parallel and zero_stage 0-3 (GRPO: LoRA, whose reference is its adapters switched off, or beta: 0)",
    ),
    _rollback_without_checkpoints("nonfinite"),
    _rollback_without_checkpoints("spike"),
    Rule(
        "train.observe.eval_tasks",
        "needs",
        "evaluation tasks need `train.eval_interval` > 0",
        lambda v: bool(v["train.observe.eval_tasks"]) and not v["train.eval_interval"],
        lambda v: "train.observe.eval_tasks: run at each evaluation, but train.eval_interval is 0; set it (e.g. 100)",
    ),
    Rule(
        "train.observe.eval_tasks",
        "refused",
        "evaluation tasks with a layout that holds no whole model on a rank (tensor, pipeline, context or expert "
        "parallel, ZeRO-2/3)",
        lambda v: bool(v["train.observe.eval_tasks"]) and _eval_tasks_split(v),
        lambda v: (
            "train.observe.eval_tasks: scored on rank 0's whole copy of the model, which tensor, pipeline, context "
            "and expert parallel and ZeRO-2/3 do not keep; evaluate the saved model with `fitlm eval` instead, or "
            "train with data_parallel and zero_stage 0 or 1"
        ),
    ),
    Rule(
        "train.early_stopping_patience",
        "needs",
        "early stopping needs `data.valid` and `train.eval_interval` > 0",
        lambda v: bool(v["train.early_stopping_patience"]) and not (v["data.valid"] and v["train.eval_interval"]),
        lambda v: "train.early_stopping_patience: needs a validation set (data.valid) and train.eval_interval > 0",
        stage="launch",
    ),
    Rule(
        "finetune.method",
        "needs",
        "`finetune.method: qlora` needs torchao (`pip install 'fitlm[qlora]'`)",
        lambda v: v["finetune.method"] == "qlora" and not torchao_installed(),
        lambda v: (
            "finetune.method: qlora stores the base in 4-bit NF4 through torchao, which is not installed; "
            "pip install 'fitlm[qlora]' (torchao 0.18), or set finetune.method: lora"
        ),
        stage="launch",
    ),
    Rule(
        "train.observe.tensorboard",
        "needs",
        "`train.observe.tensorboard: true` needs the tensorboard package (`auto` skips it)",
        lambda v: v["train.observe.tensorboard"] is True and not tensorboard_installed(),
        lambda v: (
            "train.observe.tensorboard: true, but the tensorboard package is not installed; `pip install tensorboard`, "
            "or set train.observe.tensorboard to auto or false"
        ),
        stage="launch",
    ),
    Rule(
        "finetune.objective",
        "refused",
        "GRPO with CPU offload: its sampler decodes on the device, which offload's host-held weights are not on",
        lambda v: v["finetune.objective"] == "grpo" and v["memory.cpu_offload"],
        lambda v: (
            "finetune.objective: grpo samples completions on the device, one forward a token, while "
            "memory.cpu_offload: true keeps the weights (or AdamW's states and master copy) on the host; set "
            "memory.cpu_offload: false and shard instead (parallel.zero_stage 3 gathers one block at a time while "
            "sampling), or use LoRA/QLoRA to fit the model"
        ),
    ),
    Rule(
        "data.valid",
        "refused",
        "GRPO with `data.valid`: a validation loss over prompts has no meaning yet; use `train.observe.eval_tasks`",
        lambda v: v["finetune.objective"] == "grpo" and bool(v["data.valid"]),
        lambda v: (
            "data.valid: finetune.objective: grpo has no validation loss (its data are prompts without "
            "completions); remove data.valid, and score the policy with train.observe.eval_tasks or `fitlm eval`"
        ),
    ),
    _tracker_installed("tensorboard"),
    _tracker_installed("wandb"),
    _tracker_installed("mlflow"),
    Rule(
        "train.observe.tensorboard",
        "refused",
        "`train.observe.tensorboard` set with `report_to`: list tensorboard in report_to instead",
        lambda v: v["train.observe.report_to"] is not None and v["train.observe.tensorboard"] != "auto",
        lambda v: (
            f"train.observe.tensorboard: {v['train.observe.tensorboard']} is set with train.observe.report_to, "
            "and both would say whether TensorBoard is written; leave tensorboard at auto and list tensorboard in "
            "report_to or not"
        ),
    ),
)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping (a config's dump) as dotted keys: {"parallel": {"zero_stage": 2}} -> {"parallel.zero_stage":
    2}."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def broken(values: Values, stages: tuple[str, ...] = ("config",)) -> list[Rule]:
    """The rules of these stages that `values` break, in table order."""
    return [r for r in ROWS if r.stage in stages and r.broken(values)]


def violations(values: Values, stage: str = "config") -> list[str]:
    """The message of every rule of `stage` that `values` break, in table order."""
    return [r.message(values) for r in broken(values, (stage,))]


def rules_table_markdown() -> str:
    """The README's table of refused combinations and requirements, one row per rule."""
    rows = ["| key | rule | checked |", "| --- | --- | --- |"]
    for r in ROWS:
        what = ("refused: " if r.kind == "refused" else "") + r.summary
        when = "when a config is loaded" if r.stage == "config" else "before a run starts"
        rows.append(f"| `{r.key}` | {what} | {when} |")
    return "\n".join(rows) + "\n"
