"""The user's path with each family's own files: a tiny model of every family made by transformers,
saved with a real tokenizer of that family's BOS convention (Llama 3: BOS by the post-processor and two
EOS ids; Qwen: no BOS; Gemma and Phi-3: add_bos_token), goes through `fitlm import` -> `fitlm generate`
(the greedy tokens of transformers on the same prompt, stopping where it stops) -> `fitlm export
--format hf` (the same logits in transformers). Then a GGUF file carrying the tokenizer and chat template
is imported, packs chat data with its own template, and fine-tunes with LoRA, with no manual step.
The CLI runs in process (fitlm.cli.main) so the file stays fast; the JSON is what a user would read.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from fitlm.cli import main
from fitlm.data.tokenizer import Tokenizer
from tests.parity.test_families import randomize
from tests.unit.model_tokenizers import CHAT, hf_dir

PROMPT = "Hello, how are you? Grüße, 你好"
SHAPE = dict(
    hidden_size=48,
    num_attention_heads=6,
    num_key_value_heads=2,
    num_hidden_layers=2,
    intermediate_size=96,
    max_position_embeddings=128,
)
FAMILIES = {  # name -> (model_type, tokenizer style, config overrides)
    "llama3": (
        "llama",
        "llama3",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            tie_word_embeddings=True,
        ),
    ),
    "qwen2.5": ("qwen2", "qwen", {}),
    "qwen3": ("qwen3", "qwen", dict(head_dim=16)),
    "gemma2": ("gemma2", "gemma", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16)),
    "gemma3": ("gemma3_text", "gemma", dict(head_dim=16, sliding_window=8)),
    "phi3": ("phi3", "phi3", {}),
    "qwen3_moe": (
        "qwen3_moe",
        "qwen",
        dict(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1]),
    ),
    "mixtral": ("mixtral", "llama3", dict(num_local_experts=4, num_experts_per_tok=2)),
}


def run_json(capsys, *args) -> dict:
    capsys.readouterr()
    assert main([*map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def hf_model(tmp_path, name: str):
    model_type, style, overrides = FAMILIES[name]
    tok_dir = hf_dir(style, tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    specials = {
        k: tok.convert_tokens_to_ids(v)
        for k, v in (("bos_token_id", tok.bos_token), ("eos_token_id", tok.eos_token), ("pad_token_id", tok.pad_token))
        if v is not None
    }
    cfg = AutoConfig.for_model(model_type, vocab_size=len(tok), **{**SHAPE, **overrides}, **specials)
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    randomize(model, seed=3)
    d = tmp_path / "hf"
    model.save_pretrained(d)
    for f in tok_dir.iterdir():  # the tokenizer files (and Llama 3's generation_config.json with two EOS ids)
        (d / f.name).write_bytes(f.read_bytes())
    return model, tok, d


@pytest.mark.parametrize("name", list(FAMILIES))
def test_import_generate_export_with_the_models_own_tokenizer(tmp_path, capsys, name):
    hf, tok, d = hf_model(tmp_path, name)
    summary = run_json(capsys, "import", d, "--out", tmp_path / "imported")
    assert summary["tokenizer"] and summary["arch"] == hf.config.model_type.removesuffix("_text")
    ids = tok(PROMPT)["input_ids"]
    assert (ids[0] == tok.bos_token_id) == (FAMILIES[name][1] != "qwen")  # the model's own BOS rule
    ref = hf.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=24,
        do_sample=False,
    )[0, len(ids) :].tolist()
    stop = set(Tokenizer.from_file(tmp_path / "imported").stop_ids)
    for model in (tmp_path / "imported", d):  # the imported directory and the HF directory itself
        got = run_json(capsys, "generate", model, "--prompt", PROMPT, "--max-new-tokens", 24)["token_ids"]
        assert got == ref[: len(got)]
        # Both ran to the limit, or fitlm stopped at one of the model's stop tokens (it also knows end-of-turn).
        assert len(got) == len(ref) or got[-1] in stop or ref[len(got)] in stop, (got, ref)
    run_json(capsys, "export", tmp_path / "imported", "--format", "hf", "--out", tmp_path / "export")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager").float().eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, hf(x).logits, rtol=1e-4, atol=1e-4)
    assert AutoTokenizer.from_pretrained(tmp_path / "export")(PROMPT)["input_ids"] == ids


def test_gguf_chat_model_packs_its_own_template_and_trains_with_lora(tmp_path, capsys):
    hf, tok, d = hf_model(tmp_path, "qwen2.5")
    run_json(capsys, "import", d, "--out", tmp_path / "imported")
    run_json(capsys, "export", tmp_path / "imported", "--format", "gguf", "--out", tmp_path / "chat.gguf")
    # A GGUF file is a MODEL too: its own tokenizer, the greedy tokens of transformers on the HF original.
    ids = tok(PROMPT)["input_ids"]
    ref = hf.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=12,
        do_sample=False,
    )[0, len(ids) :].tolist()
    got = run_json(capsys, "generate", tmp_path / "chat.gguf", "--prompt", PROMPT, "--max-new-tokens", 12)
    assert got["token_ids"] == ref[: len(got["token_ids"])] and len(got["token_ids"]) > 0
    summary = run_json(capsys, "import", tmp_path / "chat.gguf", "--out", tmp_path / "base")
    assert summary["tokenizer"] and summary["arch"] == "qwen2"
    base = tmp_path / "base"
    assert (base / "chat_template.jinja").is_file()
    run_json(
        capsys,
        "data",
        "pack",
        CHAT,
        "--format",
        "chat",
        "--tokenizer",
        base / "tokenizer.json",
        "--out",
        tmp_path / "chat",
    )
    inspect = run_json(capsys, "data", "inspect", tmp_path / "chat", "--doc", 1)
    text = json.dumps(inspect)
    assert "<|im_start|>" in text and "<|im_end|><|im_end|>" not in text  # its own template, no doubled EOS
    cfg = {
        "model": {"init_from": str(base)},
        "data": {"train": str(tmp_path / "chat"), "format": "chat", "seq_length": 64},
        "finetune": {"method": "lora", "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}},
        "train": {
            "micro_batch_size": 2,
            "max_steps": 3,
            "lr": 1e-3,
            "log_interval": 1,
            "eval_interval": 0,
            "output_dir": str(tmp_path / "run"),
            "progress": False,
        },
    }
    (tmp_path / "lora.yaml").write_text(yaml.safe_dump(cfg))
    out = run_json(capsys, "train", tmp_path / "lora.yaml")
    assert out["steps"] == 3
    adapter = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert set(adapter["target_modules"]) == {"q_proj", "v_proj"}
