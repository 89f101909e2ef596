"""GRPO from the command line, as a user runs it: `fitlm data pack --format prompts`, then `fitlm train` with
`finetune.objective: grpo`, on a config whose model section is `init_from` alone (a transformers-made tiny
Llama, LoRA, the reference its adapters switched off) and on one with a full model section (random init, full
fine-tuning, a frozen reference copy). The tiny model learns a verifiable task (its mean reward rises), a resumed
run samples exactly the completions of the uninterrupted one, and bad inputs stop before the first step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.e2e.helpers import fitlm, read_metrics, tiny_config, write_config

TOPICS = ["king", "night", "sword", "crown", "storm", "island", "ghost", "witch", "heath", "castle", "spirit", "sea"]
REWARD = (
    "def e_share(prompts, completions, **columns):\n    return [c.count('e') / max(len(c), 1) for c in completions]\n"
)
MODEL = tiny_config({"train": Path("unused"), "valid": Path("unused")}, Path("unused"))[
    "model"
]  # the golden tiny Llama


def pack(src: Path, tokenizer: Path, out: Path, *extra: str):
    return fitlm("data", "pack", src, "--tokenizer", tokenizer, "--out", out, "--format", "prompts", *extra, "--json")


def config(root: Path, model: dict, out: Path, grpo: dict | None = None, **sections) -> dict:
    cfg = {
        "model": model,
        "data": {"train": str(root / "prompts"), "format": "prompts", "seq_length": 64},
        "finetune": {
            "objective": "grpo",
            "grpo": {
                "num_generations": 4,
                "max_prompt_length": 16,
                "max_completion_length": 12,
                "reward_funcs": [f"{root / 'rewards.py'}:e_share"],
                **(grpo or {}),
            },
        },
        "train": {
            "micro_batch_size": 4,
            "gradient_accumulation_steps": 2,
            "max_steps": 6,
            "lr": 1e-2,
            "lr_schedule": "constant",
            "warmup_steps": 0,
            "log_interval": 1,
            "seed": 7,
            "output_dir": str(out),
            "progress": False,
            "observe": {"log_completions": True},
        },
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def train(root: Path, name: str, cfg: dict) -> tuple[list[dict], list[dict]]:
    proc = fitlm("train", write_config(root / f"{name}.yaml", cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = Path(cfg["train"]["output_dir"])
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    return [r for r in read_metrics(out) if "loss" in r], rollouts


def prompt_data(root: Path, tokenizer: Path) -> dict:
    """root/rewards.py (e_share) and root/prompts packed from TOPICS' prompts; the pack's manifest."""
    (root / "rewards.py").write_text(REWARD)
    src = root / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"Speak of the {t}:", "topic": t}) + "\n" for t in TOPICS))
    proc = pack(src, tokenizer, root / "prompts", "--max-length", "16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory) -> dict:
    import transformers

    root = tmp_path_factory.mktemp("grpo")
    manifest = prompt_data(root, tiny_corpus["tokenizer"])
    assert manifest["num_prompts"] == len(TOPICS) and manifest["columns"] == ["topic"]
    torch.manual_seed(0)
    hf = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=176
    )
    hf.vocab_size, hf.max_position_embeddings, hf.tie_word_embeddings = 512, 64, False
    transformers.LlamaForCausalLM(hf).save_pretrained(root / "hf")
    (root / "hf" / "tokenizer.json").write_bytes(Path(tiny_corpus["tokenizer"]).read_bytes())
    lora = {"method": "lora", "lora": {"r": 4, "target_modules": ["all-linear"]}}
    out: dict = {"root": root}
    cfg = config(root, {"init_from": str(root / "hf")}, root / "lora", {"beta": 0.04}, checkpoint={"interval": 3})
    cfg["finetune"].update(lora)
    out["lora"] = train(root, "lora", cfg)
    cfg["train"]["output_dir"] = str(root / "resumed")
    cfg["checkpoint"] = {"interval": 0, "resume": str(root / "lora" / "checkpoints" / "step_00000003")}
    out["resumed"] = train(root, "resumed", cfg)
    cfg = config(root, MODEL, root / "full", {"beta": 0.01}, train={"max_steps": 40})
    out["full"] = train(root, "full", cfg)
    return out


def test_init_from_alone_with_lora_logs_the_grpo_metrics_and_the_rollouts(runs):
    steps, rollouts = runs["lora"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for key in (
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "kl",
        "clip_ratio/region_mean",
        "completions/mean_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "entropy",
        "sampling_tokens_per_s",
        "rewards/e_share/mean",
    ):
        assert key in steps[0], key
    assert steps[0]["kl"] == 0.0  # the reference is the policy with its adapters off, and they start at zero
    assert steps[-1]["kl"] > 0.0
    assert "sampling" in steps[0]["step_seconds"]
    assert len(rollouts) == 6 * 8  # every step: 2 prompts × 4 completions
    first = rollouts[0]
    assert {"step", "prompt", "completion", "reward", "topic"} <= set(first)
    assert first["prompt"] == f"Speak of the {first['topic']}:"
    assert first["reward"] == first["e_share"]  # the function's name, as TRL logs it
    assert (runs["root"] / "lora" / "adapter" / "adapter_config.json").is_file()


def test_a_resumed_run_samples_what_the_uninterrupted_one_did(runs):
    steps, rollouts = runs["lora"]
    resumed_steps, resumed_rollouts = runs["resumed"]
    assert [r["step"] for r in resumed_steps] == [4, 5, 6]
    assert resumed_rollouts == [r for r in rollouts if r["step"] > 3]
    for a, b in zip(steps[3:], resumed_steps):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6) and b["reward"] == a["reward"]


def test_a_tiny_model_learns_a_verifiable_task(runs):
    steps, _ = runs["full"]
    rewards = [r["reward"] for r in steps]
    before, after = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert after > 1.5 * before, rewards  # the share of "e" in what it writes rises
    assert steps[0]["kl"] == 0.0  # the frozen reference copy is the starting model


@pytest.mark.parametrize(
    "change,expected",
    [
        (
            {"grpo": {"reward_funcs": ["answer_equals"]}},
            "answer_equals compares the final answer with the prompts' 'answer'",
        ),
        ({"grpo": {"num_generations": 3}}, "finetune.grpo.num_generations"),
        ({"grpo": {"max_prompt_length": 4}}, "over finetune.grpo.max_prompt_length (4)"),
        ({"grpo": {"max_completion_length": 60}}, "finetune.grpo.max_completion_length: 60 tokens"),
    ],
)
def test_bad_inputs_stop_before_the_first_step(runs, change, expected, tmp_path):
    out = tmp_path / "out"
    cfg = config(runs["root"], MODEL, out, change["grpo"])
    proc = fitlm("train", write_config(tmp_path / "bad.yaml", cfg))
    assert proc.returncode != 0 and expected in proc.stderr, proc.stderr[-2000:]
    assert not (out / "metrics.jsonl").exists()


def test_pack_names_the_file_and_line_of_a_bad_row_and_refuses_a_long_prompt(tiny_corpus, tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "Hello"}) + "\n" + json.dumps({"answer": "5"}) + "\n")
    proc = pack(src, tiny_corpus["tokenizer"], tmp_path / "a")
    assert proc.returncode != 0 and f"{src}:2: a prompt row has exactly one of 'prompt'" in proc.stderr
    src.write_text(json.dumps({"prompt": "Speak of the king and the crown and the storm"}) + "\n")
    proc = pack(src, tiny_corpus["tokenizer"], tmp_path / "b", "--max-length", "4")
    assert proc.returncode != 0 and f"{src}:1: the prompt has" in proc.stderr and "--max-length 4" in proc.stderr


def test_a_reward_function_that_raises_stops_the_run_naming_it_and_the_prompt(runs, tmp_path):
    (tmp_path / "bad_rewards.py").write_text(
        "def picky(prompts, completions, topic, **columns):\n"
        "    return [1 / 0 if t == 'witch' else 0.0 for t in topic]\n"
    )
    cfg = config(runs["root"], MODEL, tmp_path / "out", {"reward_funcs": [f"{tmp_path / 'bad_rewards.py'}:picky"]})
    cfg["train"]["max_steps"] = 12  # an epoch of the 12 prompts: the witch's row comes up
    proc = fitlm("train", write_config(tmp_path / "bad.yaml", cfg))
    assert proc.returncode != 0, proc.stderr[-2000:]
    assert f"reward function {tmp_path / 'bad_rewards.py'}:picky failed on the prompt 'Speak of the witch:'" in (
        proc.stderr
    ), proc.stderr[-2000:]


def test_dry_run_says_what_a_step_samples(runs, tmp_path):
    cfg = config(runs["root"], MODEL, tmp_path / "out")
    proc = fitlm("train", write_config(tmp_path / "ok.yaml", cfg), "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    shape = json.loads(proc.stdout)
    assert (shape["prompts_per_step"], shape["completions_per_step"], shape["train_prompts"]) == (2, 8, len(TOPICS))
    assert not (tmp_path / "out").exists()
