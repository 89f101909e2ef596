"""QLoRA through the real CLI on a real architecture: a Qwen2 checkpoint that transformers made and saved in
bf16 (q/k/v biases, tied embeddings, as Qwen2.5's small models are), fine-tuned on packed chat data with its
linear layers in 4-bit NF4; the loss falls; the PEFT adapter carries the quantization recipe; `fitlm merge`
of base + adapter gives exactly the run's merged model; `fitlm export --format hf` of the run loads in
transformers, which gives the logits and greedy tokens `fitlm generate` gives on the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.helpers import fitlm, pack_chat, qlora_run_config, read_metrics, write_config

STEPS = 6


@pytest.fixture(scope="module")
def run(tiny_corpus, tmp_path_factory) -> dict[str, Path]:
    import transformers

    root = tmp_path_factory.mktemp("qlora")
    torch.manual_seed(0)
    hf_cfg = transformers.Qwen2Config(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=512,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    transformers.Qwen2ForCausalLM(hf_cfg).to(torch.bfloat16).save_pretrained(root / "hf")
    (root / "hf" / "tokenizer.json").write_bytes(Path(tiny_corpus["tokenizer"]).read_bytes())
    out = root / "run"
    cfg = qlora_run_config(root / "hf", pack_chat(root, root / "hf"), out, ["all-linear"], STEPS)
    r = fitlm("train", write_config(root / "qlora.yaml", cfg), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return {"root": root, "hf": root / "hf", "run": out}


def test_qlora_trains_and_its_adapter_records_the_quantized_base(run):
    losses = [m["loss"] for m in read_metrics(run["run"]) if "loss" in m]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.5, losses
    recipe = json.loads((run["run"] / "adapter" / "fitlm_qlora.json").read_text())
    assert recipe["format"] == "nf4" and recipe["block_size"] == 64
    # every linear of both blocks but the head (tied to the embedding, which stays unquantized)
    assert len(recipe["weights"]) == 2 * 7 and "lm_head.weight" not in recipe["weights"]
    assert json.loads((run["run"] / "adapter" / "adapter_config.json").read_text())["r"] == 8


def merged_is_the_runs_model(run: dict[str, Path]) -> dict[str, torch.Tensor]:
    """`fitlm merge` of the base and the run's adapter, checked equal to the run's merged model; returns that."""
    merged = run["root"] / "merged"
    r = fitlm("merge", run["hf"], "--adapter", run["run"] / "adapter", "--out", merged, "--json")
    assert r.returncode == 0, r.stderr
    ours, theirs = (
        load_file(str(merged / "model.safetensors")),
        load_file(str(run["run"] / "model" / "model.safetensors")),
    )
    assert ours.keys() == theirs.keys()
    for k in ours:  # both: the NF4-dequantized base + scale·B·A in fp32
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-6, atol=1e-6, msg=k)
    return theirs


def test_merge_of_base_and_adapter_is_the_runs_model(run):
    theirs = merged_is_the_runs_model(run)
    base = load_file(str(run["hf"] / "model.safetensors"))
    # an untrained-adapter weight still differs from the bf16 original: it is the 4-bit base's value
    assert not torch.equal(
        theirs["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"].float()
    )


PROMPT = "Hello, how are you?"


def exported_and_generated(run: dict[str, Path]):
    """(the greedy tokens `fitlm generate` gives on the run after PROMPT, the run exported by `fitlm export
    --format hf` and loaded in transformers, its directory)."""
    from transformers import AutoModelForCausalLM

    out = run["root"] / "export"
    r = fitlm("export", run["run"], "--format", "hf", "--out", out)
    assert r.returncode == 0, r.stderr
    r = fitlm("generate", run["run"], "--prompt", PROMPT, "--max-new-tokens", "16", "--json")
    assert r.returncode == 0, r.stderr
    ours = json.loads(r.stdout.strip().splitlines()[-1])["token_ids"]
    return ours, AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), out


def assert_same_greedy(hf, ids: list[int], ours: list[int]) -> None:
    """transformers' 16 greedy tokens after `ids` begin with `ours`; where fitlm stopped early, at an EOS."""
    x = torch.tensor([ids])
    theirs = hf.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=16, min_new_tokens=16, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )[0, len(ids) :].tolist()  # fmt: skip
    assert ours and theirs[: len(ours)] == ours
    if len(ours) < 16:  # fitlm stopped at an end-of-sequence token: transformers chose it there too
        eos = hf.generation_config.eos_token_id
        assert theirs[len(ours)] in eos if isinstance(eos, list) else theirs[len(ours)] == eos


def test_exported_model_gives_in_transformers_the_greedy_tokens_of_fitlm_generate(run):
    from transformers import AutoTokenizer

    ours, hf, out = exported_and_generated(run)
    ids = AutoTokenizer.from_pretrained(out)(PROMPT)["input_ids"]  # the consumer's own encoding
    assert_same_greedy(hf, ids, ours)


def test_export_of_base_with_the_adapter_is_the_export_of_the_run(run):
    for name, args in (("from-run", [run["run"]]), ("from-base", [run["hf"], "--adapter", run["run"] / "adapter"])):
        r = fitlm("export", *args, "--format", "hf", "--out", run["root"] / name)
        assert r.returncode == 0, r.stderr
    a = load_file(str(run["root"] / "from-run" / "model.safetensors"))
    b = load_file(str(run["root"] / "from-base" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:  # streamed block by block, each base weight through the adapter's NF4 recipe
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-6, msg=k)
