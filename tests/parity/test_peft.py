"""PEFT interop both ways, and HF/GGUF import of llama variants, against transformers + peft (test-only)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from fitlm.finetune.importer import import_model
from fitlm.finetune.lora import apply_lora, split_lora_state_dict
from fitlm.finetune.merge import merge_model
from fitlm.finetune.peft_format import save_adapter
from fitlm.models.hf import HFFormatError
from fitlm.models.io import load_model_dir
from tests.helpers import attach_adapter
from tests.parity.test_hf_parity import randomize

peft = pytest.importorskip("peft")
V = 128
X = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))


def hf_base(tmp_path, tied: bool = False) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=96,
        vocab_size=V,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg).eval()
    randomize(model, seed=5)
    model.save_pretrained(tmp_path / "hf")
    return model


def test_fitlm_adapter_loads_in_peft_with_equal_logits_and_merge_matches(tmp_path):
    base_hf = hf_base(tmp_path)
    ours = load_model_dir(tmp_path / "hf").model
    spec = apply_lora(ours, r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    ours.eval()
    save_adapter(split_lora_state_dict(ours.state_dict())[1], spec, tmp_path / "adapter")
    with torch.no_grad():
        expected = ours(X)
        got = peft.PeftModel.from_pretrained(base_hf, str(tmp_path / "adapter")).eval()(X).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    merge_model(tmp_path / "hf", tmp_path / "adapter", tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(load_model_dir(tmp_path / "merged").model(X), expected, rtol=1e-4, atol=1e-4)


def test_peft_made_adapter_loads_in_fitlm_with_equal_logits(tmp_path):
    base_hf = hf_base(tmp_path, tied=True)
    cfg = peft.LoraConfig(r=2, lora_alpha=6, target_modules=["k_proj", "o_proj", "gate_proj"], lora_dropout=0.0)
    pm = peft.get_peft_model(base_hf, cfg)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    pm.eval()
    pm.save_pretrained(str(tmp_path / "peft"))
    with torch.no_grad():
        expected = pm(X).logits
    ours = load_model_dir(tmp_path / "hf").model
    spec = attach_adapter(ours, tmp_path / "peft")
    assert spec.r == 2 and spec.scaling == 3.0 and len(spec.modules) == 6
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(X), expected, rtol=1e-4, atol=1e-4)


def test_mistral_imports_with_its_sliding_window_and_moe_is_refused(tmp_path):
    cfg = MistralConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=96,
        vocab_size=V,
        max_position_embeddings=128,
        sliding_window=5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    hf = MistralForCausalLM(cfg).eval()
    randomize(hf, seed=9)
    hf.save_pretrained(tmp_path / "mistral")
    summary = import_model(tmp_path / "mistral", tmp_path / "out")
    assert summary["arch"] == "llama"
    loaded = load_model_dir(tmp_path / "out")
    assert loaded.config.model.max_seq_len == 128 and loaded.config.model.sliding_window == 5
    with torch.no_grad():  # X is longer than the window: the window is really applied
        torch.testing.assert_close(loaded.model(X), hf(X).logits, rtol=1e-4, atol=1e-4)
    raw = json.loads((tmp_path / "mistral" / "config.json").read_text())
    (tmp_path / "mistral" / "config.json").write_text(json.dumps({**raw, "model_type": "deepseek_v3"}))
    with pytest.raises(HFFormatError, match="mixture-of-experts"):
        import_model(tmp_path / "mistral", tmp_path / "out2")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's q/k row permutation."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, model: LlamaForCausalLM, qtype) -> None:
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(getattr(c, "rope_theta", None) or 10000.0))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    layer = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for name, t in model.state_dict().items():
        base = name.rsplit(".", 1)[0]
        if base.startswith("model.layers."):
            i, rest = base.split(".", 3)[2:]
            gname = f"blk.{i}.{layer[rest]}"
        else:
            gname = names[base]
        a = t.float().numpy()
        if gname.endswith("attn_q"):
            a = _permute(a, c.num_attention_heads)
        elif gname.endswith("attn_k"):
            a = _permute(a, c.num_key_value_heads)
        if a.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            q = gguf.quants.quantize(a, qtype)
            w.add_tensor(gname + ".weight", q, raw_shape=q.shape, raw_dtype=qtype)
        else:
            w.add_tensor(gname + ".weight", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtype,tol", [("F32", 1e-4), ("F16", 2e-2), ("Q8_0", 1e-1)])
def test_gguf_import_dequantizes_to_the_same_model(tmp_path, qtype, tol):
    import gguf

    base_hf = hf_base(tmp_path)
    write_gguf(tmp_path / "m.gguf", base_hf, getattr(gguf.GGMLQuantizationType, qtype))
    import_model(tmp_path / "m.gguf", tmp_path / "out")
    with torch.no_grad():
        got, want = load_model_dir(tmp_path / "out").model(X), base_hf(X).logits
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
