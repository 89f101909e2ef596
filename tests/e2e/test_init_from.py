"""model.init_from through every command that takes a config: `fitlm plan`, `profile`, `train --dry-run`
and `train` take the network from the weights of a Hugging Face directory (made here by transformers),
agree on its shape, and refuse a model key that contradicts the weights with one and the same message.

The fine-tuning config is the shipped configs/lora-chat.yaml, which sets no model key; only its paths
and sizes are overridden with --set, as a user would.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fitlm.cli import main
from fitlm.config import load_config
from fitlm.finetune.init_from import resolve_init_from
from tests.e2e.helpers import fitlm, read_metrics

ROOT = Path(__file__).resolve().parents[2]
LORA_CHAT = ROOT / "configs" / "lora-chat.yaml"
CHAT = ROOT / "examples" / "data" / "chat" / "chatterbot_corpus.jsonl"
# The weights' shape, deliberately unlike every default of the model section (hidden 256, 4 layers, ...).
SHAPE = {
    "hidden_size": 96,
    "num_layers": 2,
    "num_heads": 6,
    "num_kv_heads": 2,
    "intermediate_size": 160,
    "vocab_size": 512,
    "max_seq_len": 128,
}
CONFLICT = "model.init_from: {hf} does not match the model section (model.hidden_size: config 128 vs weights 96)"


@pytest.fixture(scope="module")
def base(tiny_corpus, tmp_path_factory) -> dict[str, Path]:
    """A random tiny Llama saved by transformers, and chat data packed with the test tokenizer (vocab 512)."""
    import torch
    import transformers

    from fitlm.data.prep.pack import pack_corpus

    root = tmp_path_factory.mktemp("init_from")
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=128,
    )
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(root / "hf")
    chat = root / "chat.jsonl"  # a few conversations: enough for a couple of steps of 2 × 64 tokens
    chat.write_text("".join(CHAT.read_text().splitlines(keepends=True)[:120]))
    pack_corpus(
        [chat],
        tiny_corpus["tokenizer"],
        root / "chat",
        data_format="chat",
        max_length=64,
        overlong="drop",
        show_progress=False,
    )
    return {"root": root, "hf": root / "hf", "chat": root / "chat"}


def overrides(base: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """lora-chat.yaml made tiny: the HF weights, the packed chat data, 2 steps; `extra` are more KEY=VALUEs."""
    keys = [
        f"model.init_from={base['hf']}",
        f"data.train={base['chat']}",
        f"data.valid={base['chat']}",
        "data.seq_length=64",
        "train.micro_batch_size=2",
        "train.max_steps=2",
        "train.warmup_steps=0",
        "train.eval_interval=2",
        "train.eval_steps=1",
        "train.log_interval=1",
        "train.progress=false",
        "train.peak_tflops=1.0",
        f"train.output_dir={out}",
        "checkpoint.interval=2",
        *extra,
    ]
    return [arg for key in keys for arg in ("--set", key)]


def run_json(*args) -> dict:
    proc = fitlm(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_command_takes_the_network_from_the_weights(base):
    root = base["root"]
    planned = run_json("plan", LORA_CHAT, *overrides(base, root / "plan"), "--json")
    assert planned["model"] == {"arch": "llama", "params": planned["model"]["params"], "layers": 2, "hidden_size": 96}
    dry = run_json("train", LORA_CHAT, *overrides(base, root / "run"), "--dry-run", "--json")
    assert (dry["hidden_size"], dry["layers"], dry["params"]) == (96, 2, planned["model"]["params"])
    # The bug this file is for: profile re-validated a dump of the unresolved config, so every default
    # of the model section looked set by the user and contradicted the weights.
    profiled = run_json(
        "profile", LORA_CHAT, *overrides(base, root / "run"), "--steps", "2", "--out", root / "profile", "--json"
    )
    assert profiled["model"] == {"arch": "llama", "hidden_size": 96, "layers": 2, "vocab_size": 512}
    assert not (root / "run").exists()  # the profile trains into its own scratch directory
    trained = run_json("train", LORA_CHAT, *overrides(base, root / "run"), "--json")
    assert trained["steps"] == 2
    written = yaml.safe_load((root / "run" / "config.yaml").read_text())["model"]
    assert {k: written[k] for k in SHAPE} == SHAPE and written["init_from"] == str(base["hf"])
    # output_dir/config.yaml is the resolved config: every model key is written out, so all of them
    # read as set by the user, and all agree with the weights. Resuming from it continues the run.
    resumed = run_json("train", root / "run" / "config.yaml", "--set", "train.max_steps=3", "--json")
    assert resumed["steps"] == 3
    assert [r["step"] for r in read_metrics(root / "run") if "loss" in r] == [1, 2, 3]


def test_profile_relaunched_under_torchrun_resolves_alike(base, tmp_path):
    # Each rank re-reads the user's YAML and --set, so each knows which model keys the user set.
    result = run_json(
        "profile",
        LORA_CHAT,
        *overrides(base, tmp_path / "run", "parallel.data_parallel=2"),
        "--steps",
        "2",
        "--out",
        tmp_path / "profile",
        "--nproc",
        "2",
        "--json",
    )
    assert result["world_size"] == 2
    assert result["model"] == {"arch": "llama", "hidden_size": 96, "layers": 2, "vocab_size": 512}


@pytest.mark.parametrize(
    "command", [["plan", "--json"], ["profile", "--steps", "2", "--json"], ["train", "--dry-run"], ["train"]]
)
def test_a_model_key_that_contradicts_the_weights_is_refused_alike(base, command, tmp_path, capsys):
    # In process (the CLI's own main()): each command refuses before it builds or writes anything.
    args = [command[0], str(LORA_CHAT), *overrides(base, tmp_path / "out", "model.hidden_size=128"), *command[1:]]
    if command[0] == "profile":
        args += ["--out", str(tmp_path / "profile")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fitlm {command[0]}: error: ") and CONFLICT.format(hf=base["hf"]) in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "profile").exists()


def test_the_rule_keys_set_must_match_unset_come_from_the_weights_init_std_never_conflicts(base, tmp_path):
    args = overrides(base, tmp_path / "out", "model.hidden_size=96", "model.num_kv_heads=2", "model.init_std=0.5")
    cfg = resolve_init_from(load_config(LORA_CHAT, args[1::2]))
    assert {k: getattr(cfg.model, k) for k in SHAPE} == SHAPE and cfg.model.init_std == 0.5
    # Idempotent: the resolved config, dumped (every key now "set") and read back, resolves to itself.
    again = tmp_path / "resolved.yaml"
    again.write_text(cfg.to_yaml())
    assert resolve_init_from(load_config(again)) == cfg


def test_config_show_prints_the_resolved_config(base, tmp_path, capsys):
    # What it prints spells out every key; printed unresolved, it would contradict the weights as a config.
    assert main(["config", "show", str(LORA_CHAT), *overrides(base, tmp_path / "out")]) == 0
    shown = tmp_path / "shown.yaml"
    shown.write_text(capsys.readouterr().out)
    model = resolve_init_from(load_config(shown)).model
    assert {k: getattr(model, k) for k in SHAPE} == SHAPE
