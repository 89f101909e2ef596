"""Every family against transformers on checkpoints transformers itself creates, with unusual shapes.

For each case: fp32 logits within 1e-4; 32 greedy tokens through fitlm's KV cache equal to
transformers' (Gemma/Mistral/Phi-3 prompts longer than the sliding window); fitlm's HF export loads in
transformers with equal logits; a transformers-4.x spelling of the same config.json (rope_theta +
rope_scaling, no layer_types) gives the same model; a LoRA adapter made by fitlm loads in PEFT onto
the HF model with equal logits. transformers and peft are test-only references.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from fitlm.finetune.apply import expert_names
from fitlm.finetune.lora import apply_lora, split_lora_state_dict
from fitlm.finetune.peft_format import save_adapter
from fitlm.infer import generate
from fitlm.models.hf import load_hf_dir, save_hf_dir
from tests.helpers import hf_with_adapter, peft_applies

V = 131  # not a power of two
PROMPT, NEW = 20, 32
COMMON = dict(
    vocab_size=V,
    num_hidden_layers=3,
    max_position_embeddings=64,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CASES = {  # name -> (model_type, config overrides, fitlm arch)
    "llama3.1_gqa6-2_tied": (
        "llama",
        dict(
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=2,
            intermediate_size=160,
            rope_scaling=LLAMA3,
            tie_word_embeddings=True,
        ),
        "llama",
    ),
    "llama_yarn": (
        "llama",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=96,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        ),
        "llama",
    ),
    "llama_linear": (
        "llama",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            intermediate_size=96,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
        "llama",
    ),
    "llama_dynamic": (
        "llama",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            intermediate_size=96,
            max_position_embeddings=24,
            rope_scaling={"rope_type": "dynamic", "factor": 4.0},
        ),
        "llama",
    ),
    "mistral_window7_headdim16": (
        "mistral",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=1,
            intermediate_size=96,
            sliding_window=7,
            head_dim=16,
        ),
        "llama",
    ),
    "qwen2.5_gqa6-2": (
        "qwen2",
        dict(
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=2,
            intermediate_size=160,
            tie_word_embeddings=True,
        ),
        "qwen2",
    ),
    "qwen3_gqa9-3_headdim20": (
        "qwen3",
        dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, head_dim=20, intermediate_size=160),
        "qwen3",
    ),
    "gemma2_window6": (
        "gemma2",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            intermediate_size=128,
            sliding_window=6,
            query_pre_attn_scalar=20,
            tie_word_embeddings=False,
        ),
        "gemma2",
    ),
    "gemma3_window6": (
        "gemma3_text",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            intermediate_size=128,
            sliding_window=6,
            num_hidden_layers=7,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
        ),
        "gemma3",
    ),
    "phi3_gqa6-2": (
        "phi3",
        dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=160, sliding_window=9),
        "phi3",
    ),
    "phi3.5_longrope": (
        "phi3",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            intermediate_size=96,
            original_max_position_embeddings=16,
            rope_scaling={
                "type": "longrope",
                "short_factor": [round(1.0 + 0.1 * i, 2) for i in range(8)],
                "long_factor": [round(2.0 + 0.3 * i, 2) for i in range(8)],
            },
        ),
        "phi3",
    ),
    # Mixtures of experts: a dense block among sparse ones, top-3 of 6 unnormalized, a shared expert, every
    # other block sparse, tied and untied heads, a sliding window.
    "qwen3_moe_top3of6_dense1": (
        "qwen3_moe",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            intermediate_size=96,
            moe_intermediate_size=40,
            num_experts=6,
            num_experts_per_tok=3,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        ),
        "qwen3_moe",
    ),
    "qwen3_moe_normalized_tied": (
        "qwen3_moe",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=96,
            moe_intermediate_size=24,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            tie_word_embeddings=True,
        ),
        "qwen3_moe",
    ),
    "qwen2_moe_shared_step2_tied": (
        "qwen2_moe",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=96,
            moe_intermediate_size=40,
            shared_expert_intermediate_size=56,
            num_experts=5,
            num_experts_per_tok=2,
            decoder_sparse_step=2,
            tie_word_embeddings=True,
        ),
        "qwen2_moe",
    ),
    "mixtral_window7": (
        "mixtral",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=7,
        ),
        "mixtral",
    ),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter matters (norm scales away from their identity, biases away from 0)."""
    g = torch.Generator().manual_seed(seed)
    unit_offset = "gemma" in type(model).__name__.lower()  # Gemma's norms scale by 1 + w: identity at 0
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g)
            if p.dim() == 1:
                p.copy_((1.0 if "norm" in name and not unit_offset else 0.0) + 0.1 * noise)
            else:
                p.copy_(0.15 * noise)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    model_type, overrides, arch = CASES[request.param]
    cfg = AutoConfig.for_model(model_type, **{**COMMON, **overrides})
    cfg._attn_implementation = "eager"
    hf = AutoModelForCausalLM.from_config(cfg).float().eval()
    randomize(hf, seed=len(request.param))
    d = tmp_path_factory.mktemp(request.param.replace(".", "_")) / "hf"
    hf.save_pretrained(d)
    ours, mcfg = load_hf_dir(d)
    return request.param, hf, d, ours, mcfg, arch


def ids(t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (2, t), generator=torch.Generator().manual_seed(seed))


def test_logits_equal_transformers(case):
    name, hf, _, ours, mcfg, arch = case
    assert mcfg.arch == arch
    x = ids(PROMPT + NEW)
    with torch.no_grad():
        ref, got = hf(x).logits, ours(x)
    cap = getattr(hf.config, "final_logit_softcapping", None)
    if cap:  # the check must not pass only because tanh saturates every logit at the cap
        assert ref.abs().max() < 0.9 * cap
    assert ref.std() > 0.1
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_greedy_tokens_through_the_kv_cache_equal_transformers(case):
    name, hf, _, ours, mcfg, _ = case
    prompt = ids(PROMPT, seed=1)[:1]
    if mcfg.sliding_window:
        assert PROMPT > mcfg.sliding_window  # the cache holds more than a window
    ref = hf.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, PROMPT:].tolist()
    got = generate(ours, prompt[0].tolist(), NEW, temperature=0.0, eos_id=None)
    assert got == ref
    assert len(set(ref)) > 3  # not a degenerate repetition


def test_export_loads_in_transformers_with_equal_logits(case, tmp_path):
    name, hf, _, ours, mcfg, _ = case
    save_hf_dir(ours, mcfg, tmp_path / "export")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager").float().eval()
    x = ids(PROMPT + NEW, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, hf(x).logits, rtol=1e-4, atol=1e-4)
    reread, rcfg = load_hf_dir(tmp_path / "export")
    assert rcfg == mcfg


def _legacy(cfg: dict) -> dict:
    """The transformers 4.x spelling of a config.json: rope_theta + rope_scaling, no layer_types."""
    out = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "layer_types")}
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:  # Gemma 3: one entry per attention type
        out["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
        params = params["full_attention"]
    out["rope_theta"] = params.get("rope_theta", 10000.0)
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta",)}
    out["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
    if cfg["model_type"] == "gemma3_text":
        out["sliding_window_pattern"] = 6
    if cfg["model_type"] in ("qwen2", "qwen3") and cfg.get("sliding_window"):
        out["use_sliding_window"] = True
    if cfg["model_type"] in ("qwen2_moe", "qwen3_moe") and "num_local_experts" in out:  # 4.x: num_experts
        out["num_experts"] = out.pop("num_local_experts")
    return out


def test_transformers_4_config_spelling_reads_the_same(case, tmp_path):
    name, hf, d, ours, mcfg, _ = case
    legacy_dir = tmp_path / "legacy"
    legacy_dir.mkdir()
    (legacy_dir / "config.json").write_text(json.dumps(_legacy(json.loads((d / "config.json").read_text()))))
    (legacy_dir / "model.safetensors").symlink_to(d / "model.safetensors")
    model, cfg = load_hf_dir(legacy_dir)
    assert cfg == mcfg
    x = ids(PROMPT + NEW, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ours(x), rtol=0, atol=0)


def test_fitlm_lora_adapter_loads_in_peft_with_equal_logits(case, tmp_path):
    peft = pytest.importorskip("peft")
    name, hf, d, _, mcfg, _ = case
    ours, _ = load_hf_dir(d)
    spec = apply_lora(ours, r=4, alpha=8, dropout=0.0, target_modules=["all-linear"])
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(hash(n) % 1000))
    ours.eval()
    adapter = split_lora_state_dict(ours.state_dict())[1]
    save_adapter(adapter, spec, tmp_path / "adapter", experts=expert_names(mcfg))
    targets = set(json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"])
    assert targets == set(mcfg.family.lora_linears)  # HF's own names (Phi-3: qkv_proj, gate_up_proj; w1 ...)
    x = ids(16, seed=4)
    with torch.no_grad():
        expected = ours(x)
    if mcfg.moe and not peft_applies(mcfg):  # PEFT on transformers 5 cannot express it (tests/parity/test_moe_lora.py)
        with torch.no_grad():
            got = hf_with_adapter(d, tmp_path / "adapter")(x).logits
    else:
        base = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").float().eval()
        with torch.no_grad():
            got = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()(x).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_gemma3_multimodal_checkpoint_imports_its_language_model(tmp_path):
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration (model_type gemma3, a text_config, weights
    under language_model.*, a vision tower): fitlm reads the language model, and on text its logits and
    greedy tokens are the multimodal model's."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        intermediate_size=96,
        num_hidden_layers=3,
        vocab_size=V,
        sliding_window=6,
        max_position_embeddings=64,
    )
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    cfg = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=V - 1,
        boi_token_index=V - 3,
        eoi_token_index=V - 2,
    )
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    hf = Gemma3ForConditionalGeneration(cfg).float().eval()
    randomize(hf, seed=7)
    hf.save_pretrained(tmp_path / "mm")
    ours, mcfg = load_hf_dir(tmp_path / "mm")
    assert mcfg.arch == "gemma3" and mcfg.num_layers == 3 and mcfg.tie_embeddings
    x = ids(PROMPT + NEW) % (V - 3)  # text tokens only
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(input_ids=x).logits, rtol=1e-4, atol=1e-4)
    prompt = x[:1, :PROMPT]
    ref = hf.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, PROMPT:].tolist()
    assert generate(ours, prompt[0].tolist(), NEW, temperature=0.0, eos_id=None) == ref
