"""Parity with Hugging Face transformers on the same weights: logits, greedy generation, both directions.

transformers is a test-only reference; fitlm itself never imports it.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from fitlm.config import ModelConfig
from fitlm.infer import generate
from fitlm.models.hf import load_hf_dir, save_hf_dir
from fitlm.models.io import load_model_dir
from fitlm.registry import build_model

V, T = 128, 24
LLAMA = {  # name -> LlamaConfig overrides
    "mha": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4),
    "gqa_6_2": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2),
    "tied_gqa": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "theta_500k": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, rope_theta=500000.0),
}
GPT2 = {"tied": dict(tie_word_embeddings=True), "untied": dict(tie_word_embeddings=False)}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Make every parameter matter (norm weights away from 1, biases away from 0) and logits decisive."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g)
            if p.dim() == 1:
                p.copy_((1.0 if "weight" in name else 0.0) + 0.1 * noise)
            else:
                p.copy_(0.15 * noise)


def hf_llama(name: str, attn: str) -> LlamaForCausalLM:
    kw = dict(
        num_hidden_layers=2,
        intermediate_size=160,
        vocab_size=V,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    cfg = LlamaConfig(**{**kw, **LLAMA[name]})
    cfg._attn_implementation = attn
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    randomize(model, seed=len(name))
    return model


def hf_gpt2(name: str, attn: str) -> GPT2LMHeadModel:
    cfg = GPT2Config(
        n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=V, bos_token_id=None, eos_token_id=None, **GPT2[name]
    )
    cfg._attn_implementation = attn
    model = GPT2LMHeadModel(cfg).to(torch.float32).eval()
    randomize(model, seed=len(name) + 100)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.transformer.wte.weight
    return model


ATTN = ("sdpa", "eager")
CASES = [("llama", n, a) for n in LLAMA for a in ATTN] + [("gpt2", n, a) for n in GPT2 for a in ATTN]


def make_hf(family: str, name: str, attn: str):
    return hf_llama(name, attn) if family == "llama" else hf_gpt2(name, attn)


def input_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def hf_greedy(hf, prompt: torch.Tensor, n: int) -> list[int]:
    out = hf.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, prompt.shape[1] :].tolist()


@pytest.mark.parametrize("family,name,attn", CASES)
def test_hf_checkpoint_loads_with_equal_logits_and_generations(tmp_path, family, name, attn):
    hf = make_hf(family, name, attn)
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    model, cfg = load_hf_dir(tmp_path)
    assert cfg.arch == family and cfg.tie_embeddings == hf.config.tie_word_embeddings
    x = input_ids()
    with torch.no_grad():
        ref = hf(x).logits
        ours = model(x)
    assert ref.abs().max() > 1.0  # the comparison means something only if the logits are not all ~0
    assert max_diff(ours, ref) < 1e-5
    if attn == "eager":
        return  # the attention kernel changes nothing below; generating once per config keeps the suite fast
    prompt = x[:1, :8]
    expected = hf_greedy(hf, prompt, 20)
    assert generate(model, prompt[0].tolist(), 20) == expected
    assert len(set(expected)) > 2  # not a degenerate constant continuation


@pytest.mark.parametrize(
    "family,name",
    [("llama", "gqa_6_2"), ("llama", "tied_gqa"), ("llama", "theta_500k"), ("gpt2", "tied"), ("gpt2", "untied")],
)
def test_fitlm_export_loads_in_transformers(tmp_path, family, name):
    hf_ref = make_hf(family, name, "sdpa")
    hf_ref.save_pretrained(tmp_path / "src")
    model, cfg = load_hf_dir(tmp_path / "src")
    save_hf_dir(model, cfg, tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.bin"))
    cls = LlamaForCausalLM if family == "llama" else GPT2LMHeadModel
    back = cls.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert back.config.tie_word_embeddings == cfg.tie_embeddings
    x = input_ids(1)
    with torch.no_grad():
        assert max_diff(back(x).logits, model(x)) < 1e-5
        assert max_diff(back(x).logits, hf_ref(x).logits) < 1e-5


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_fitlm_initialised_model_roundtrips_through_transformers(tmp_path, arch):
    cfg = ModelConfig(
        arch=arch,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2 if arch == "llama" else None,
        vocab_size=V,
        max_seq_len=64,
        init_std=0.1,
        rope_theta=5000.0,
        norm_eps=1e-6,
    )
    torch.manual_seed(3)
    model = build_model(cfg).eval()
    randomize(model, seed=3)
    save_hf_dir(model, cfg, tmp_path, max_shard_bytes=60_000)  # sharded, as large exports are
    assert (tmp_path / "model.safetensors.index.json").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    x = input_ids(2)
    with torch.no_grad():
        assert max_diff(back(x).logits, model(x)) < 1e-5
    assert hf_greedy(back, x[:1, :5], 20) == generate(model, x[0, :5].tolist(), 20)


def test_sharded_hf_checkpoint_loads(tmp_path):
    hf = hf_llama("gqa_6_2", "sdpa")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = load_model_dir(tmp_path)
    assert loaded.source == "hf"
    x = input_ids(3)
    with torch.no_grad():
        assert max_diff(loaded.model(x), hf(x).logits) < 1e-5
