"""The planner's accuracy bar (issue 7), measured by `fitlm profile`: over configurations that differ in
model size, batch, sequence length, precision, recompute, loss path and layout (multi-process ones through
the real CLI under torchrun), the analytic per-device total is within 10% of the measured peak live
tensor bytes of the most loaded rank, and the simulated total within 3%. The measured side is the
profile's burst (fitlm.profile.burst: the real Trainer step under MemTracker), never the planner.

Fast tier: the FAST names below; the rest (pipelines, DDP and ZeRO-1 among them) with --runslow. Every
layout is simulated: fitlm.plan.simulate plays each pipeline stage (and ZeRO-1's most loaded rank) on torch's
fake process group.
"""

from __future__ import annotations

import json

import pytest

from fitlm.config import validate_dict
from tests.e2e.helpers import fitlm, tiny_config, write_config
from tests.e2e.test_moe_cli import MOE as MOE_CLI

ANALYTIC_TOLERANCE = 0.10
# The issue-55 MoE rows (a dense block among routed ones; full, LoRA and QLoRA on attention and experts, LoRA under
# expert parallel) and the GRPO rows (issue 54) are held to 5%: the planner counts each kind of block, and the
# rollout, as they run.
MOE_ANALYTIC_TOLERANCE = 0.05
SIMULATED_TOLERANCE = 0.03
slow = pytest.mark.slow

QLORA = {"method": "qlora", "lora": {"r": 8, "target_modules": ["q_proj", "v_proj"]}}
QLORA_MODEL = {"hidden_size": 256, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 512}
# Qwen3-MoE: the MoE CLI runs' model (4 experts of width 32, top-2) with both blocks routed.
MOE = {k: v for k, v in MOE_CLI.items() if k != "mlp_only_layers"}
# The issue-55 model: Qwen3-MoE whose experts hold most of the weights (16 experts of width 128, top 4), a dense
# block among the routed ones, vocabulary 1,024; every expert [128, 128] is whole double-quantization groups.
MOE_DENSE1 = {
    **MOE_CLI,
    "hidden_size": 128,
    "num_layers": 3,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 128,
    "mlp_only_layers": [1],
    "vocab_size": 1024,
}
MOE_LORA = {"r": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
# (name, config sections, processes). Accumulation is 1 unless stated; tiny Llama h64, 2 layers, GQA 4/2,
# vocab 512, seq 64, micro batch 4.
CONFIGS = [
    ("O0", {}, 1),
    ("O2 h128", {"model": {"hidden_size": 128, "intermediate_size": 352}, "memory": {"mixed_precision": "O2"}}, 1),
    ("O3 full recompute", {"memory": {"mixed_precision": "O3", "recompute": "full"}}, 1),
    ("O1 mbs8", {"memory": {"mixed_precision": "O1"}, "train": {"micro_batch_size": 8}}, 1),
    (
        "O0 selective, 4 layers, accum 2",
        {"model": {"num_layers": 4}, "memory": {"recompute": "selective"}, "train": {"gradient_accumulation_steps": 2}},
        1,
    ),
    ("O0 chunked loss, vocab 2048", {"model": {"vocab_size": 2048}, "memory": {"loss_chunk_size": 64}}, 1),
    (
        "O2 seq 32, no doc mask",
        {"data": {"seq_length": 32, "document_mask": False}, "memory": {"mixed_precision": "O2"}},
        1,
    ),
    (
        "O0 tied, full every 2nd of 4",
        {
            "model": {"tie_embeddings": True, "num_layers": 4},
            "memory": {"recompute": "full", "recompute_every_n_layers": 2},
        },
        1,
    ),
    ("dp2 zero2", {"parallel": {"data_parallel": 2, "zero_stage": 2}, "train": {"micro_batch_size": 2}}, 2),
    ("dp2 zero1", {"parallel": {"data_parallel": 2, "zero_stage": 1}, "train": {"micro_batch_size": 2}}, 2),
    (
        "dp2 ddp O2",
        {"parallel": {"data_parallel": 2}, "memory": {"mixed_precision": "O2"}, "train": {"micro_batch_size": 2}},
        2,
    ),
    (
        "dp2 zero2 accum 2, sync every",
        {
            "parallel": {"data_parallel": 2, "zero_stage": 2},
            "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 2},
        },
        2,
    ),
    (
        "dp2 zero2 accum 2, sync last",
        {
            "parallel": {"data_parallel": 2, "zero_stage": 2, "gradient_sync": "last_micro_batch"},
            "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 2},
        },
        2,
    ),
    ("tp2", {"parallel": {"tensor_parallel": 2}}, 2),
    (
        "dp2 zero3 O2",
        {
            "parallel": {"data_parallel": 2, "zero_stage": 3},
            "memory": {"mixed_precision": "O2"},
            "train": {"micro_batch_size": 2},
        },
        2,
    ),
    ("dp2 ddp", {"parallel": {"data_parallel": 2}, "train": {"micro_batch_size": 2}}, 2),
    (
        "dp2 ddp accum 2",
        {"parallel": {"data_parallel": 2}, "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 2}},
        2,
    ),
    # Context parallel: each rank keeps T/C tokens of activations and every layer's gathered full-length K/V
    # (document masks on: a [B, 1, T/C, T] mask); ZeRO shards over dp x cp ranks.
    ("cp2", {"parallel": {"context_parallel": 2}}, 2),
    (
        "dp2 cp2 zero2",
        {"parallel": {"data_parallel": 2, "context_parallel": 2, "zero_stage": 2}, "train": {"micro_batch_size": 2}},
        4,
    ),
    # Plain causal: each of a rank's two chunks attends the keys before its end ([c, (g+1)c] masks).
    (
        "cp2 O2 no doc mask",
        {"parallel": {"context_parallel": 2}, "data": {"document_mask": False}, "memory": {"mixed_precision": "O2"}},
        2,
    ),
    # Pipelines: the first stage keeps the embedding and the in-flight chunks' activations, the last the head
    # and the logits; every pp rank is measured and simulated, the most loaded compared.
    ("pp2 1f1b x2", {"parallel": {"pipeline_parallel": 2, "micro_batch_num": 2}}, 2),
    (
        "pp2 gpipe x2 accum 2 O2",
        {
            "parallel": {"pipeline_parallel": 2, "micro_batch_num": 2, "pipeline_schedule": "gpipe"},
            "memory": {"mixed_precision": "O2"},
            "train": {"gradient_accumulation_steps": 2},
        },
        2,
    ),
    (
        "pp2 interleaved 4 layers",
        {
            "model": {"num_layers": 4},
            "parallel": {"pipeline_parallel": 2, "micro_batch_num": 2, "pipeline_schedule": "interleaved_1f1b"},
        },
        2,
    ),
    (
        "pp2 1f1b x4 vocab 2048",
        {"model": {"vocab_size": 2048}, "parallel": {"pipeline_parallel": 2, "micro_batch_num": 4}},
        2,
    ),
    # Other families' blocks (counted by their family units, fitlm.models.counts): Qwen3's per-head q/k
    # norms with head_dim independent of hidden/heads; Gemma 3's sandwich of four (1 + w) norms, q/k norms,
    # sliding-window layers (a masked SDPA) and a second RoPE table; Gemma 2's soft-capped eager attention.
    ("qwen3 O0 head_dim 24", {"model": {"arch": "qwen3", "head_dim": 24}}, 1),
    ("qwen3 O2", {"model": {"arch": "qwen3", "head_dim": 24}, "memory": {"mixed_precision": "O2"}}, 1),
    (
        "gemma3 O0",
        {
            "model": {
                "arch": "gemma3",
                "head_dim": 24,
                "sliding_window": 16,
                "rope_local_theta": 1e4,
                "layer_types": ["sliding", "full"],
            }
        },
        1,
    ),
    (
        "gemma3 O2",
        {
            "model": {
                "arch": "gemma3",
                "head_dim": 24,
                "sliding_window": 16,
                "rope_local_theta": 1e4,
                "layer_types": ["sliding", "full"],
            },
            "memory": {"mixed_precision": "O2"},
        },
        1,
    ),
    (
        "gemma3 cp2 no doc mask",
        {
            "model": {
                "arch": "gemma3",
                "head_dim": 24,
                "sliding_window": 16,
                "rope_local_theta": 1e4,
                "layer_types": ["sliding", "full"],
            },
            "parallel": {"context_parallel": 2},
            "data": {"document_mask": False},
        },
        2,
    ),
    (
        "gemma2 O0 softcap",
        {
            "model": {
                "arch": "gemma2",
                "head_dim": 24,
                "sliding_window": 16,
                "attn_logit_softcap": 50.0,
                "final_logit_softcap": 30.0,
            }
        },
        1,
    ),
    # Mixtures of experts: the stacked experts counted by the family unit; under expert parallel a rank holds
    # E/ep of them, sharded over their replicas (edp) under ZeRO-2/3 (fitlm.plan.expert_parallel), the dense part
    # sharded as before.
    ("qwen3_moe O0", {"model": MOE}, 1),
    (
        "qwen3_moe dp2 ep2",
        {"model": MOE, "parallel": {"data_parallel": 2, "expert_parallel": 2}, "train": {"micro_batch_size": 2}},
        2,
    ),
    (
        "qwen3_moe dp2 ep2 zero3",
        {
            "model": MOE,
            "parallel": {"data_parallel": 2, "expert_parallel": 2, "zero_stage": 3},
            "train": {"micro_batch_size": 2},
        },
        2,
    ),
    # two replicas of each expert shard: FSDP2 shards the experts over them (edp 2) as ZeRO-3 shards the rest
    (
        "qwen3_moe dp4 ep2 zero3",
        {
            "model": MOE,
            "parallel": {"data_parallel": 4, "expert_parallel": 2, "zero_stage": 3},
            "train": {"micro_batch_size": 1},
        },
        4,
    ),
    # The same MoE trained in full, with LoRA on attention and experts, and with QLoRA (4-bit experts), O2.
    ("moe dense1 full O2", {"model": MOE_DENSE1, "memory": {"mixed_precision": "O2"}}, 1),
    (
        "moe dense1 lora O2",
        {"model": MOE_DENSE1, "finetune": {"method": "lora", "lora": MOE_LORA}, "memory": {"mixed_precision": "O2"}},
        1,
    ),
    (
        "moe dense1 qlora O2",
        {"model": MOE_DENSE1, "finetune": {"method": "qlora", "lora": MOE_LORA}, "memory": {"mixed_precision": "O2"}},
        1,
    ),
    # ZeRO-3 shards the 4-bit experts by rows, 8 whole experts a rank, and gathers one block's at a time
    (
        "moe dense1 qlora dp2 zero3 O2",
        {
            "model": MOE_DENSE1,
            "finetune": {"method": "qlora", "lora": MOE_LORA},
            "memory": {"mixed_precision": "O2"},
            "parallel": {"data_parallel": 2, "zero_stage": 3},
            "train": {"micro_batch_size": 2},
        },
        2,
    ),
    # LoRA on attention and experts under expert parallel: each rank holds E/ep experts and their adapters
    (
        "moe dense1 lora dp2 ep2 O2",
        {
            "model": MOE_DENSE1,
            "finetune": {"method": "lora", "lora": MOE_LORA},
            "memory": {"mixed_precision": "O2"},
            "parallel": {"data_parallel": 2, "expert_parallel": 2},
            "train": {"micro_batch_size": 2},
        },
        2,
    ),
    # and QLoRA: each rank holds its E/ep experts' 4-bit codes (ZeRO-3: the dense codes sharded over dp, gathered a
    # block at a time; the experts whole per ep rank, edp 1)
    *(
        (
            f"moe dense1 qlora dp2 ep2{zero} O2",
            {
                "model": MOE_DENSE1,
                "finetune": {"method": "qlora", "lora": MOE_LORA},
                "memory": {"mixed_precision": "O2"},
                "parallel": {"data_parallel": 2, "expert_parallel": 2, "zero_stage": 3 if zero else 0},
                "train": {"micro_batch_size": 2},
            },
            2,
        )
        for zero in ("", " zero3")
    ),
    # Tensor parallel splits each expert on its width (fitlm.parallel.expert_tensor_parallel), under sequence
    # parallel; with expert parallel and LoRA on attention and experts, a rank holds E/ep experts at I/tp each.
    (
        "moe dense1 tp2 sp O2",
        {
            "model": MOE_DENSE1,
            "parallel": {"tensor_parallel": 2, "sequence_parallel": True},
            "memory": {"mixed_precision": "O2"},
        },
        2,
    ),
    (
        "moe dense1 lora dp2 ep2 tp2 O2",
        {
            "model": MOE_DENSE1,
            "finetune": {"method": "lora", "lora": MOE_LORA},
            "memory": {"mixed_precision": "O2"},
            "parallel": {"data_parallel": 2, "expert_parallel": 2, "tensor_parallel": 2},
            "train": {"micro_batch_size": 2},
        },
        4,
    ),
    # Pipelines over the MoE: the first stage keeps a routed block and the dense one, the last a routed block and
    # the head; with expert parallel each stage's routed block holds E/ep experts. The first stage peaks in its last
    # backward (every gradient, the experts' new one being accumulated). O2 as the rows above: at O0 a CPU step
    # runs torch's fp32 grouped matmul, which fake tensors cannot (the simulation takes the per-expert loop).
    (
        "moe dense1 pp2 O2",
        {
            "model": MOE_DENSE1,
            "parallel": {"pipeline_parallel": 2, "micro_batch_num": 2},
            "memory": {"mixed_precision": "O2"},
        },
        2,
    ),
    (
        "moe dense1 dp2 ep2 pp2 O2",
        {
            "model": MOE_DENSE1,
            "parallel": {"data_parallel": 2, "expert_parallel": 2, "pipeline_parallel": 2, "micro_batch_num": 2},
            "memory": {"mixed_precision": "O2"},
            "train": {"micro_batch_size": 2},
        },
        4,
    ),
    # DPO on preference pairs (`_preference_corpus`): micro batch 2 = 4 rows; LoRA's reference is its base with
    # the adapters off, full fine-tuning keeps a frozen fp32 copy (the profile files it under params).
    (
        "lora dpo O0",
        {
            "finetune": {"method": "lora", "objective": "dpo"},
            "data": {"format": "preference"},
            "train": {"micro_batch_size": 2},
        },
        1,
    ),
    (
        "full dpo O0",
        {
            "finetune": {"method": "full", "objective": "dpo"},
            "data": {"format": "preference"},
            "train": {"micro_batch_size": 2},
        },
        1,
    ),
    # QLoRA: every block Linear stored as 4-bit NF4 (widths whose Linears, and their halves at dp2, are whole
    # double-quantization groups), its dequantization working set at the backward peak; O1 keeps no half casts
    # of NF4 weights; ZeRO-3 shards the codes and gathers one block at that peak.
    ("qlora O1", {"model": QLORA_MODEL, "finetune": QLORA, "memory": {"mixed_precision": "O1"}}, 1),
    ("qlora O2", {"model": QLORA_MODEL, "finetune": QLORA, "memory": {"mixed_precision": "O2"}}, 1),
    (
        "qlora dp2 zero3 O2",
        {
            "model": QLORA_MODEL,
            "finetune": QLORA,
            "memory": {"mixed_precision": "O2"},
            "parallel": {"data_parallel": 2, "zero_stage": 3},
            "train": {"micro_batch_size": 2},
        },
        2,
    ),
    # GRPO (`_prompt_corpus`): the peak is the larger of the rollout (KV cache, sampling logits) and the training
    # over rows of the longest prompt and completion; max_prompt_length is the corpus's longest prompt, so the
    # measured rows are as long as the planned ones. Full fine-tuning keeps a frozen reference (beta > 0), LoRA
    # switches its adapters off instead.
    (
        "grpo full beta O0",
        {"finetune": {"method": "full", "objective": "grpo", "grpo": {"beta": 0.04}}, "train": {"micro_batch_size": 4}},
        1,
    ),
    (
        "grpo dp2 zero3",
        {
            "finetune": {"method": "full", "objective": "grpo", "grpo": {}},
            "parallel": {"data_parallel": 2, "zero_stage": 3},
            "train": {"micro_batch_size": 4},
        },
        2,
    ),
    (
        "grpo lora beta dp2 zero3 tied O0",
        {
            "model": {"tie_embeddings": True},
            "finetune": {"method": "lora", "objective": "grpo", "grpo": {"beta": 0.04}},
            "parallel": {"data_parallel": 2, "zero_stage": 3},
            "train": {"micro_batch_size": 4},
        },
        2,
    ),
    (
        "grpo lora O2",
        {
            "finetune": {"method": "lora", "objective": "grpo", "grpo": {"beta": 0.04}},
            "memory": {"mixed_precision": "O2"},
            "train": {"micro_batch_size": 4, "gradient_accumulation_steps": 2},
        },
        1,
    ),
]
FAST = {
    "O0",
    "O2 h128",
    "O3 full recompute",
    "dp2 zero2",
    "dp2 zero2 accum 2, sync every",
    "qwen3 O0 head_dim 24",
    "gemma3 O2",
    "qlora O2",
}
# Where an engine misses the bar, the miss is recorded here (strict: the test fails once it is fixed) rather
# than the tolerance loosened. Numbers in the README's accuracy table.
SIMULATION_MISSES: dict[str, str] = {
    "qlora dp2 zero3 O2": "simulated +12% (parameters +53%, activations +6%): FSDP2's all-gather of torchao's NF4 "
    "codes on the fake process group holds more than the gloo run does"
}
_results: dict[str, dict] = {}


def _sections(name: str) -> tuple[dict, int]:
    return next((sections, nproc) for n, sections, nproc in CONFIGS if n == name)


def _preference_corpus(tiny_corpus, root) -> dict:
    """tiny_corpus with its train/valid replaced by preference pairs (test_dpo's rows), packed with its tokenizer."""
    from fitlm.data.prep import pack_corpus
    from tests.unit.test_dpo import rows, write_jsonl

    root.mkdir(parents=True, exist_ok=True)
    src = write_jsonl(root / "pairs.jsonl", rows() * 4)
    pack_corpus(
        [src], tiny_corpus["tokenizer"], root / "pairs", data_format="preference", max_length=65, show_progress=False
    )
    return {**tiny_corpus, "train": root / "pairs", "valid": root / "pairs"}


def _prompt_corpus(tiny_corpus, root, cfg: dict) -> None:
    """cfg trained on tiny_corpus's tokenizer over test_grpo_cli's prompts and reward (GRPO has no validation)."""
    from tests.e2e.test_grpo_cli import prompt_data

    root.mkdir(parents=True, exist_ok=True)
    manifest = prompt_data(root, tiny_corpus["tokenizer"])
    cfg["data"] = {**cfg["data"], "train": str(root / "prompts"), "format": "prompts"}
    del cfg["data"]["valid"]
    grpo = cfg["finetune"]["grpo"]
    grpo.update(num_generations=4, max_prompt_length=manifest["max_prompt_tokens"], max_completion_length=12)
    grpo["reward_funcs"] = [f"{root / 'rewards.py'}:e_share"]


def measure(tiny_corpus, root, name: str) -> dict:
    """The profile of one configuration (2 timed steps), with the plan held against it; cached per name."""
    if name in _results:
        return _results[name]
    sections, nproc = _sections(name)
    if sections.get("data", {}).get("format") == "preference":
        tiny_corpus = _preference_corpus(tiny_corpus, root / "preference")
    train = {"max_steps": 4, "eval_interval": 0, "gradient_accumulation_steps": 1, **sections.get("train", {})}
    cfg = tiny_config(tiny_corpus, root / "run", train=train, **{k: v for k, v in sections.items() if k != "train"})
    if sections.get("finetune", {}).get("objective") == "grpo":
        _prompt_corpus(tiny_corpus, root / "prompts", cfg)
    out = root / "out"
    if nproc > 1:  # the real command: torchrun, gloo, every rank measured and gathered to rank 0
        proc = fitlm("profile", write_config(root / "cfg.yaml", cfg), "--steps", "2", "--out", out, "--json")
        assert proc.returncode == 0, proc.stderr[-4000:]
        result = json.loads(proc.stdout)
    else:  # the same burst and comparison in this process (no report rendering)
        from fitlm.profile.burst import run_burst
        from fitlm.profile.compare import plan_for
        from fitlm.profile.report import assemble

        config = validate_dict(cfg)
        ranks = run_burst(config, 2, out)
        result = assemble(config, name, 2, ranks, plan_for(config, ranks[0]["device"], ranks[0]["peak_flops"]))
    measured = result["per_device"]["total"]
    analytic = result["plan"]["analytic"]["per_device"]["total"]
    sim = result["plan"].get("simulated", {}).get("per_device", {}).get("total")
    print(
        f"\n{name:<34} measured {measured:>10,} analytic {analytic:>10,} ({analytic / measured - 1:+.1%})"
        + (f" simulated {sim:>10,} ({sim / measured - 1:+.1%})" if sim else " simulated –")
    )
    _results[name] = result
    return result


def _params(with_sim: bool):
    out = []
    for name, _, _ in CONFIGS:
        marks = [] if name in FAST else [slow]
        if with_sim and name in SIMULATION_MISSES:
            marks.append(pytest.mark.xfail(strict=True, reason=SIMULATION_MISSES[name]))
        out.append(pytest.param(name, marks=marks, id=name.replace(" ", "-").replace(",", "")))
    return out


@pytest.mark.parametrize("name", _params(with_sim=False))
def test_analytic_total_within_10_percent_of_measured(tiny_corpus, tmp_path, name):
    result = measure(tiny_corpus, tmp_path, name)
    bound = MOE_ANALYTIC_TOLERANCE if name.startswith(("moe dense1", "grpo")) else ANALYTIC_TOLERANCE
    assert abs(result["errors"]["analytic"]["total"]) <= bound, result["errors"]


@pytest.mark.parametrize("name", _params(with_sim=True))
def test_simulated_total_within_3_percent_of_measured(tiny_corpus, tmp_path, name):
    result = measure(tiny_corpus, tmp_path, name)
    assert "simulated" in result["errors"], f"not simulated: {result['plan']['simulated'].get('error')}"
    assert abs(result["errors"]["simulated"]["total"]) <= SIMULATED_TOLERANCE, result["errors"]
