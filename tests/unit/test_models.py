"""Model families, KV cache, registry and the fitlm model directory, against independent references."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from fitlm.config import Config, ModelConfig
from fitlm.models.gpt2.model import GPT2LMHeadModel
from fitlm.models.hf import (
    HFFormatError,
    config_from_hf,
    config_to_hf,
    from_hf_state_dict,
    load_hf_dir,
    read_safetensors_dir,
    save_hf_dir,
    to_hf_state_dict,
    write_safetensors,
)
from fitlm.models.io import ModelDirError, load_model_dir, resolve_model_path, save_model_dir
from fitlm.models.llama.model import LlamaForCausalLM
from fitlm.registry import RegistryError, build_model, get_model_class, model_names, register_family

V = 128


def tiny(arch: str = "llama", **kw) -> ModelConfig:
    base = dict(arch=arch, hidden_size=64, num_layers=2, num_heads=4, vocab_size=V, max_seq_len=64)
    base.update(kw)
    return ModelConfig(**base)


def make(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    with torch.no_grad():  # break the init symmetry (norms = 1, biases = 0) so every weight matters
        for _name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def ids(b: int = 2, t: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- a naive reference llama


def _ref_rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _ref_rope(x, pos, theta):
    # Written with complex rotation of (i, i + D/2) pairs: a different derivation from the model's.
    d = x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None].float() * freqs[None]  # [T,D/2]
    z = torch.complex(x[..., : d // 2], x[..., d // 2 :]) * torch.polar(torch.ones_like(ang), ang)
    return torch.cat([z.real, z.imag], dim=-1)


def reference_llama(model: LlamaForCausalLM, x: torch.Tensor) -> torch.Tensor:
    """Loop-over-heads attention with explicit softmax and explicit GQA head sharing."""
    c = model.config
    sd = model.state_dict()
    t = x.shape[1]
    pos = torch.arange(t)
    h = sd["model.embed_tokens.weight"][x]
    mask = torch.full((t, t), float("-inf")).triu(1)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        a = _ref_rms(h, sd[p + "input_layernorm.weight"], c.norm_eps)
        q = (a @ sd[p + "self_attn.q_proj.weight"].T).view(*x.shape, c.num_heads, c.head_size)
        k = (a @ sd[p + "self_attn.k_proj.weight"].T).view(*x.shape, c.kv_heads, c.head_size)
        v = (a @ sd[p + "self_attn.v_proj.weight"].T).view(*x.shape, c.kv_heads, c.head_size)
        heads = []
        for hq in range(c.num_heads):
            kv = hq // (c.num_heads // c.kv_heads)
            qh, kh = _ref_rope(q[:, :, hq], pos, c.rope_theta), _ref_rope(k[:, :, kv], pos, c.rope_theta)
            att = torch.softmax(qh @ kh.transpose(1, 2) / math.sqrt(c.head_size) + mask, dim=-1)
            heads.append(att @ v[:, :, kv])
        h = h + torch.cat(heads, dim=-1) @ sd[p + "self_attn.o_proj.weight"].T
        m = _ref_rms(h, sd[p + "post_attention_layernorm.weight"], c.norm_eps)
        gate, up = m @ sd[p + "mlp.gate_proj.weight"].T, m @ sd[p + "mlp.up_proj.weight"].T
        h = h + (F.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return _ref_rms(h, sd["model.norm.weight"], c.norm_eps) @ sd["lm_head.weight"].T


# --------------------------------------------------------------------------- architecture


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_shapes_and_output_layer(arch):
    model = make(tiny(arch))
    x = ids(2, 10)
    logits, hidden = model(x), model.hidden_states(x)
    assert logits.shape == (2, 10, V) and logits.dtype == torch.float32
    assert hidden.shape == (2, 10, 64)
    assert model.output_layer is model.lm_head
    torch.testing.assert_close(model.output_layer(hidden), logits, rtol=0, atol=0)


def test_llama_state_dict_names_are_hf_names():
    model = make(tiny("llama", num_kv_heads=2))
    keys = set(model.state_dict())
    layer = {
        f"model.layers.0.{n}.weight"
        for n in [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "post_attention_layernorm",
        ]
    }
    assert layer <= keys
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= keys
    assert len(keys) == 3 + 2 * 9  # no biases, no rope buffers
    assert model.state_dict()["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 16, 64)


@pytest.mark.parametrize("hidden,heads,kv", [(96, 6, 3), (96, 12, 4), (64, 4, 1), (64, 4, None)])
def test_llama_matches_naive_reference(hidden, heads, kv):
    model = make(tiny("llama", hidden_size=hidden, num_heads=heads, num_kv_heads=kv, rope_theta=500.0))
    x = ids(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference_llama(model, x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_tied_embeddings_share_one_parameter(arch):
    tied = make(tiny(arch, tie_embeddings=True))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    untied = make(tiny(arch, tie_embeddings=False))
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(untied) - count(tied) == V * 64


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_init_is_deterministic_under_seed(arch):
    cfg = tiny(arch, init_std=0.05)
    torch.manual_seed(7)
    a = build_model(cfg).state_dict()
    torch.manual_seed(7)
    b = build_model(cfg).state_dict()
    torch.manual_seed(8)
    c = build_model(cfg).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert torch.equal(a["model.norm.weight"], torch.ones(64))
    w = a["model.layers.0.mlp.down_proj.weight"]
    assert abs(w.std().item() - 0.05) < 0.005 and abs(w.mean().item()) < 0.005


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_meta_device_build_then_init_weights(arch):
    cfg = tiny(arch, tie_embeddings=True)
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device="cpu")
    model.init_weights(buffer_device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    reference = build_model(cfg)
    for name, buf in reference.named_buffers():
        torch.testing.assert_close(dict(model.named_buffers())[name], buf, rtol=0, atol=0)
    assert torch.isfinite(model(ids())).all()


# --------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize("arch,kv", [("llama", 2), ("llama", None), ("gpt2", None)])
def test_kv_cache_incremental_equals_full_forward(arch, kv):
    model = make(tiny(arch, num_kv_heads=kv))
    x = ids(2, 20)
    with torch.no_grad():
        full = model(x)
        cache = model.new_kv_cache(2, 32)
        # prompt, then a multi-token chunk after the prefix (explicit-mask path), then one at a time
        parts = [model(x[:, :8], kv_cache=cache), model(x[:, 8:11], kv_cache=cache)]
        parts += [model(x[:, i : i + 1], kv_cache=cache) for i in range(11, 20)]
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5)


def test_kv_cache_overflow_and_length_limit_are_clear():
    model = make(tiny("llama"))
    cache = model.new_kv_cache(1, 4)
    model(ids(1, 4), kv_cache=cache)
    with pytest.raises(ValueError, match="KV cache is full"):
        model(ids(1, 1), kv_cache=cache)
    with pytest.raises(ValueError, match="max_seq_len=64"):
        model(ids(1, 65))


# --------------------------------------------------------------------------- registry


def test_registry_builds_both_families_by_name():
    assert {"llama", "gpt2"} <= set(model_names())
    assert isinstance(build_model(tiny("llama")), LlamaForCausalLM)
    assert isinstance(build_model(tiny("gpt2")), GPT2LMHeadModel)


def test_registering_llama_twice_names_both_classes():
    import dataclasses

    from fitlm.registry import get_family

    class Impostor(torch.nn.Module):
        pass

    with pytest.raises(RegistryError) as err:
        register_family(dataclasses.replace(get_family("llama"), model_cls=Impostor))
    assert "LlamaForCausalLM" in str(err.value) and "Impostor" in str(err.value)
    assert get_model_class("llama") is LlamaForCausalLM  # nothing was overwritten
    qwen2 = get_family("qwen2")
    with pytest.raises(RegistryError, match="model_type"):  # an HF model_type belongs to one family
        register_family(dataclasses.replace(qwen2, spec=dataclasses.replace(qwen2.spec, name="qwen2-copy")))
    assert "qwen2-copy" not in model_names()


def test_registering_a_spec_twice_is_an_error_too():
    """The torch-free spec table keeps the family table's rules: one spec per name, one family per model_type."""
    import dataclasses

    from fitlm.registry import get_family, get_spec, register_spec

    llama = get_spec("llama")
    assert register_spec(llama) is llama  # the same spec again is no conflict (family.py registers it too)
    with pytest.raises(RegistryError, match="registered twice") as err:
        register_spec(dataclasses.replace(llama, hf_model_types=("my_llama",)))
    assert "my_llama" in str(err.value) and "'llama'" in str(err.value)
    with pytest.raises(
        RegistryError, match=r"model_type \['llama', 'mistral'\] is claimed by families 'llama' and 'llama2'"
    ):
        register_spec(dataclasses.replace(llama, name="llama2"))
    assert get_spec("llama") is llama and "llama2" not in model_names()
    assert get_family("llama").spec is llama  # the torch family holds the spec itself, not a copy


# --------------------------------------------------------------------------- HF adapters (no transformers needed)


def test_gpt2_adapter_layout_and_roundtrip():
    cfg = tiny("gpt2", tie_embeddings=True)
    model = make(cfg)
    hf = to_hf_state_dict(model, cfg)
    assert hf["transformer.h.0.attn.c_attn.weight"].shape == (64, 3 * 64)  # Conv1D: [in, out]
    assert hf["transformer.h.1.mlp.c_fc.weight"].shape == (64, 4 * 64)
    assert "lm_head.weight" not in hf  # tied: stored once, as HF does
    q = model.state_dict()["model.layers.0.self_attn.k_proj.weight"]
    torch.testing.assert_close(hf["transformer.h.0.attn.c_attn.weight"][:, 64:128], q.T)
    back = from_hf_state_dict(hf, cfg)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(back[k], v, rtol=0, atol=0)


def test_adapters_see_through_compile_and_checkpoint_wrappers():
    cfg = tiny("llama")
    sd = make(cfg).state_dict()
    wrapped = {
        k.replace("layers.0.", "layers.0._orig_mod.").replace("layers.1.", "layers.1._checkpoint_wrapped_module."): v
        for k, v in sd.items()
    }
    assert wrapped != sd and to_hf_state_dict(wrapped, cfg).keys() == sd.keys()


def test_config_from_hf_spells_family_defaults_as_null():
    for cfg in (tiny("llama"), tiny("gpt2"), tiny("llama", num_kv_heads=4)):
        assert config_from_hf(config_to_hf(cfg)) == cfg.model_copy(update={"num_kv_heads": None})


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_adapter_refuses_leftover_and_missing_weights(arch):
    cfg = tiny(arch)
    with pytest.raises(HFFormatError, match="merge adapters"):
        to_hf_state_dict({**make(cfg).state_dict(), "model.layers.0.self_attn.q_proj.lora_A": torch.zeros(1)}, cfg)
    hf = to_hf_state_dict(make(cfg), cfg)
    with pytest.raises(HFFormatError, match="unexpected weights"):
        from_hf_state_dict({**hf, "transformer.h.0.attn.lora_A": torch.zeros(1)}, cfg)
    missing = "transformer.h.1.ln_2.bias" if arch == "gpt2" else "model.layers.1.mlp.up_proj.weight"
    del hf[missing]
    with pytest.raises(HFFormatError, match=missing):
        from_hf_state_dict(hf, cfg)
    with pytest.raises(HFFormatError, match="lm_head.weight' is missing"):
        from_hf_state_dict({k: v for k, v in to_hf_state_dict(make(cfg), cfg).items() if k != "lm_head.weight"}, cfg)


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("gpt2", True), ("gpt2", False)])
def test_config_to_hf_and_back(arch, tied):
    cfg = tiny(arch, tie_embeddings=tied, rope_theta=123.0, norm_eps=1e-6, intermediate_size=96)
    back = config_from_hf(config_to_hf(cfg))
    assert back.model_dump(exclude={"rope_theta"} if arch == "gpt2" else set()) == cfg.model_dump(
        exclude={"rope_theta"} if arch == "gpt2" else set()
    )


def test_config_from_hf_refuses_unsupported_features():
    hf = config_to_hf(tiny("llama"))
    legacy = {k: v for k, v in hf.items() if k != "rope_parameters"}  # a transformers 4.x config.json
    with pytest.raises(HFFormatError, match="RoPE type 'su'"):
        config_from_hf({**legacy, "rope_scaling": {"rope_type": "su", "factor": 8.0}})
    with pytest.raises(HFFormatError, match="partial_rotary_factor"):
        config_from_hf({**legacy, "partial_rotary_factor": 0.5})
    for kind in ("dynamic", "linear"):  # a scaling that needs a factor and has none: named, not a TypeError
        with pytest.raises(HFFormatError, match=f"RoPE type '{kind}' without a factor"):
            config_from_hf({**legacy, "rope_scaling": {"rope_type": kind}})
    with pytest.raises(HFFormatError, match="hidden_act"):
        config_from_hf({**hf, "hidden_act": "gelu"})
    with pytest.raises(HFFormatError, match="'falcon' is not supported"):
        config_from_hf({**hf, "model_type": "falcon"})
    for moe in ("deepseek_v3", "olmoe"):  # MoE models of no fitlm family: named, with the ones it reads
        with pytest.raises(HFFormatError, match="mixture-of-experts model fitlm does not implement; its MoE fam"):
            config_from_hf({**hf, "model_type": moe})
    with pytest.raises(HFFormatError, match="router_jitter_noise"):
        config_from_hf({**hf, "model_type": "mixtral", "num_local_experts": 4, "router_jitter_noise": 0.1})
    scaled = config_from_hf(
        {
            **legacy,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        }
    )
    assert scaled.rope_scaling.type == "llama3" and scaled.rope_scaling.original_max_seq_len == 32


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hf_dir_roundtrip_and_sharding(tmp_path, arch):
    cfg = tiny(arch, tie_embeddings=arch == "gpt2")
    model = make(cfg)
    save_hf_dir(model, cfg, tmp_path / "one")
    save_hf_dir(model, cfg, tmp_path / "sharded", max_shard_bytes=40_000)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 2
    x = ids()
    for d in ("one", "sharded"):
        loaded, lcfg = load_hf_dir(tmp_path / d)
        assert lcfg.model_dump(exclude={"intermediate_size"}) == cfg.model_dump(exclude={"intermediate_size"})
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
        assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == cfg.tie_embeddings


def test_pickled_weights_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(tiny("llama"))))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(HFFormatError, match="pytorch_model.bin.*safetensors only"):
        load_hf_dir(tmp_path)
    with pytest.raises(HFFormatError, match="pytorch_model.bin"):
        load_model_dir(tmp_path)


def test_shard_names_cannot_escape_the_directory(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../evil.safetensors"}}))
    with pytest.raises(HFFormatError, match="not a plain file name"):
        read_safetensors_dir(tmp_path)


# --------------------------------------------------------------------------- fitlm model directory


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("gpt2", True)])
def test_model_dir_roundtrip(tmp_path, arch, tied):
    cfg = Config(model=tiny(arch, tie_embeddings=tied, num_kv_heads=2 if arch == "llama" else None))
    cfg.data.seq_length = 64
    model = make(cfg.model)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text('{"model": {}}')
    (tmp_path / "tok" / "chat_template.jinja").write_text("{{ messages }}")
    out = save_model_dir(model, cfg, tmp_path / "m", tokenizer_path=tmp_path / "tok" / "tokenizer.json")
    assert sorted(p.name for p in out.iterdir()) == [
        "chat_template.jinja",
        "config.yaml",
        "fitlm.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    info = json.loads((out / "fitlm.json").read_text())
    assert info["format_version"] == 1 and info["torch_version"] == torch.__version__
    loaded = load_model_dir(out)
    assert loaded.source == "fitlm" and loaded.config == cfg and not loaded.model.training
    assert loaded.tokenizer_path == out / "tokenizer.json"
    for k, v in model.state_dict().items():
        torch.testing.assert_close(loaded.model.state_dict()[k], v, rtol=0, atol=0)
    x = ids()
    torch.testing.assert_close(loaded.model(x), model(x), rtol=0, atol=0)
    assert (loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight) == tied


def test_training_output_and_hf_dirs_resolve(tmp_path):
    cfg = tiny("llama")
    model = make(cfg)
    save_model_dir(model, cfg, tmp_path / "run" / "model")
    assert resolve_model_path(tmp_path / "run") == ("fitlm", tmp_path / "run" / "model")
    assert load_model_dir(tmp_path / "run").path == tmp_path / "run" / "model"
    save_hf_dir(model, cfg, tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    loaded = load_model_dir(tmp_path / "hf")
    assert loaded.source == "hf" and loaded.config.model.hidden_size == 64
    assert loaded.config.data.seq_length <= cfg.max_seq_len
    assert loaded.tokenizer_path == tmp_path / "hf" / "tokenizer.json"
    torch.testing.assert_close(loaded.model(ids()), model(ids()), rtol=0, atol=0)


def test_unknown_path_error_lists_what_was_looked_for(tmp_path):
    with pytest.raises(ModelDirError) as err:
        load_model_dir(tmp_path)
    msg = str(err.value)
    assert "fitlm.json" in msg and "model/fitlm.json" in msg.replace("\\", "/") and "config.json" in msg
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(ModelDirError, match="fitlm ckpt merge"):
        load_model_dir(tmp_path)
    with pytest.raises(ModelDirError, match="does not exist"):
        load_model_dir(tmp_path / "nope")


def _siblings(path):
    return sorted(p.name for p in path.parent.iterdir())


def test_save_refuses_foreign_nonempty_dir_and_leaves_it_untouched(tmp_path):
    target = tmp_path / "precious"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    cfg = tiny("llama")
    with pytest.raises(ModelDirError, match="not a fitlm model directory"):
        save_model_dir(make(cfg), cfg, target)
    assert [p.name for p in target.iterdir()] == ["notes.txt"] and (target / "notes.txt").read_text() == "keep me"
    assert _siblings(target) == ["precious"]  # no temporary directory left behind


def test_save_replaces_a_model_dir_and_a_crash_keeps_the_old_one(tmp_path, monkeypatch):
    cfg = tiny("llama")
    target = tmp_path / "m"
    save_model_dir(make(cfg, seed=1), cfg, target)
    second = make(cfg, seed=2)
    save_model_dir(second, cfg, target)
    torch.testing.assert_close(load_model_dir(target).model(ids()), second(ids()), rtol=0, atol=0)
    assert _siblings(target) == ["m"]

    import fitlm.models.io as mio

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(mio, "write_safetensors_stream", boom)
    with pytest.raises(OSError, match="disk full"):
        save_model_dir(make(cfg, seed=3), cfg, target)
    assert _siblings(target) == ["m"]
    torch.testing.assert_close(load_model_dir(target).model(ids()), second(ids()), rtol=0, atol=0)
    with pytest.raises(OSError):
        save_model_dir(make(cfg, seed=3), cfg, tmp_path / "fresh")
    assert _siblings(target) == ["m"]  # a crash on a new path leaves nothing behind


def test_write_safetensors_replaces_stale_shards(tmp_path):
    sd = {"a": torch.zeros(10_000), "b": torch.ones(10_000)}
    write_safetensors(sd, tmp_path, max_shard_bytes=40_000)
    write_safetensors({"a": torch.ones(3)}, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert set(read_safetensors_dir(tmp_path)) == {"a"}


def test_save_refuses_a_config_that_could_not_be_loaded_back(tmp_path):
    from fitlm.config import ConfigError

    cfg = Config(model=tiny("llama"))  # data.seq_length 2048 > max_seq_len 64: load_config would refuse it
    with pytest.raises(ConfigError, match="data.seq_length"):
        save_model_dir(make(cfg.model), cfg, tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_gguf_metadata_of_a_yarn_scaling_without_factor_writes_the_derived_one():
    """fitlm's yarn with factor null scales by max_seq_len / original (as its RoPE computes): GGUF gets that."""
    from fitlm.config import RopeScalingConfig
    from fitlm.models.gguf import gguf_metadata

    cfg = tiny(max_seq_len=64, rope_scaling=RopeScalingConfig(type="yarn", original_max_seq_len=16))
    meta = gguf_metadata(cfg)
    assert meta["llama.rope.scaling.factor"] == 4.0 and meta["llama.rope.scaling.original_context_length"] == 16
