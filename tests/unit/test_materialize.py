"""Building on the meta device and materializing from streams gives exactly the whole-model build's weights.

The references are independent of the streams: `build_model` on the CPU after the same seed (every
family, tied and untied), `apply_lora` on a real model, transformers' own saved weights read back by
safetensors, and `load_hf_dir` (the whole-model load).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fitlm.config import ModelConfig
from fitlm.finetune.lora import apply_lora, lora_weights
from fitlm.models.hf import HFFormatError, load_hf_dir, write_safetensors
from fitlm.models.init_replay import seeded_weights
from fitlm.models.safetensors_io import SafetensorsReader, write_safetensors_stream
from fitlm.models.streaming import stream_from_hf, stream_to_hf
from fitlm.parallel.materialize import MaterializeError, materialize, tied_aliases
from fitlm.registry import build_model

FAMILIES = ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gpt2"]


def tiny(arch: str, tie: bool = False, **kw) -> ModelConfig:
    return ModelConfig(
        arch=arch, hidden_size=64, num_layers=2, num_heads=4, vocab_size=128, max_seq_len=64, tie_embeddings=tie, **kw
    )


def meta(cfg: ModelConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return build_model(cfg)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_seeded_stream_equals_cpu_build_and_leaves_the_generator_where_it_does(arch, tie):
    cfg = tiny(arch, tie)
    torch.manual_seed(7)
    ref = build_model(cfg)
    after_ref = torch.rand(4)
    got = dict(seeded_weights(cfg, 7))
    after = torch.rand(4)
    want = dict(ref.named_parameters())  # a tied head is listed once, under the embedding
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(after, after_ref)


def test_lora_stream_draws_what_apply_lora_draws():
    cfg = tiny("llama")
    torch.manual_seed(3)
    real = build_model(cfg)
    apply_lora(real, 4, 8.0, 0.0, ["all-linear"])
    after_ref = torch.rand(2)
    lazy = meta(cfg)
    apply_lora(lazy, 4, 8.0, 0.0, ["all-linear"])
    torch.manual_seed(3)
    dict(seeded_weights(cfg, 3))  # the base draws first, as build_model did
    got = dict(lora_weights(lazy))
    want = {k: v for k, v in real.named_parameters() if "lora_" in k}
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(torch.rand(2), after_ref)


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_materialize_fills_a_meta_model_as_the_cpu_build(arch):
    cfg = tiny(arch, tie=True)
    torch.manual_seed(5)
    ref = build_model(cfg)
    model = meta(cfg)
    materialize([model], lambda groups: seeded_weights(cfg, 5), "cpu", tied_aliases(model))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # to_empty untied it; tied again
    x = torch.randint(0, 128, (2, 9))
    assert torch.equal(model(x), ref(x))  # RoPE tables recomputed, every weight in place


def test_materialize_names_a_missing_or_misshapen_weight():
    cfg = tiny("llama")
    model = meta(cfg)
    stream = [(k, v) for k, v in seeded_weights(cfg, 0) if k != "model.norm.weight"]
    with pytest.raises(MaterializeError, match="model.norm.weight"):
        materialize([model], lambda groups: iter(stream), "cpu")
    wrong = [(k, v[:-1] if k == "lm_head.weight" else v) for k, v in seeded_weights(cfg, 0)]
    with pytest.raises(MaterializeError, match=r"lm_head.weight: the weights hold \[127, 64\].*needs \[128, 64\]"):
        materialize([meta(cfg)], lambda groups: iter(wrong), "cpu")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """transformers' own checkpoints (bf16, sharded for Llama; GPT-2's fused Conv1D c_attn; Phi-3's fused qkv)."""
    transformers = pytest.importorskip("transformers")
    out = {}
    specs = {
        "llama": transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
        ),
        "gpt2": transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64),
        "phi3": transformers.Phi3Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=128,
            pad_token_id=0,
            tie_word_embeddings=False,
        ),
    }
    for name, cfg in specs.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        path = tmp_path_factory.mktemp(name)
        if name == "llama":
            model.to(torch.bfloat16).save_pretrained(path, max_shard_size="40KB")
        else:
            model.save_pretrained(path)
        out[name] = path
    return out


@pytest.mark.parametrize("name", ["llama", "gpt2", "phi3"])
def test_stream_from_hf_gives_the_whole_model_load(hf_dirs, name):
    path = hf_dirs[name]
    model, cfg = load_hf_dir(path, dtype=None)
    specs, stream = stream_from_hf(path, cfg)
    got = dict(stream)
    want = model.state_dict()  # a tied head appears under both names in both
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert specs == {k: (v.dtype, tuple(v.shape)) for k, v in want.items()}
    if name == "llama":
        assert (path / "model.safetensors.index.json").is_file()  # the sharded layout was read
        assert next(iter(got.values())).dtype == torch.bfloat16  # the stored dtype; the model's fill casts


def test_stream_from_hf_skips_what_no_one_wants_and_names_a_missing_weight(hf_dirs, tmp_path, monkeypatch):
    path = hf_dirs["gpt2"]
    _, cfg = load_hf_dir(path)
    reads = []
    real_read = SafetensorsReader.read
    monkeypatch.setattr(SafetensorsReader, "read", lambda self, n: reads.append(n) or real_read(self, n))
    got = dict(stream_from_hf(path, cfg, wanted=lambda k: k.startswith("model.layers.1."))[1])
    assert got and all(k.startswith("model.layers.1.") for k in got)
    assert reads and all(".h.1." in n for n in reads)  # block 0, embeddings and norm were never read

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((path / "config.json").read_text())
    sd = load_file(path / "model.safetensors")
    sd.pop("transformer.h.1.mlp.c_fc.weight")
    save_file(sd, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFFormatError, match="transformer.h.1.mlp.c_fc.weight"):
        stream_from_hf(broken, cfg)


def test_streamed_shards_read_back_by_safetensors_and_round_trip_to_hf(hf_dirs, tmp_path):
    model, cfg = load_hf_dir(hf_dirs["gpt2"])
    sd = model.state_dict()
    specs = {k: (v.dtype, tuple(v.shape)) for k, v in sd.items()}
    blocks: dict[str, dict] = {}
    for k, v in sd.items():
        blocks.setdefault(k.split(".")[2] if k.startswith("model.layers.") else "top", {})[k] = v
    hf_specs, tensors = stream_to_hf(specs, cfg, blocks.values())
    files = write_safetensors_stream(hf_specs, tensors, tmp_path, max_shard_bytes=60_000)
    assert len(files) > 1
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    back = {}
    for f in files:
        back.update(load_file(f))  # safetensors' own reader
    assert set(index["weight_map"]) == set(back)
    ref = tmp_path / "ref"
    ref.mkdir()
    write_safetensors(
        {
            k: v
            for k, v in load_file(hf_dirs["gpt2"] / "model.safetensors").items()
            if not k.endswith((".attn.bias", ".attn.masked_bias"))
        },
        ref,
    )
    want = load_file(ref / "model.safetensors")
    assert sorted(back) == sorted(want) and all(torch.equal(back[k], want[k]) for k in want)
