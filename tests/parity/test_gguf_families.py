"""GGUF out and back in for every family llama.cpp defines, against the gguf package and transformers'
GGUF loader: llama.cpp's architecture names, tensor names, q/k permutation (llama only) and Gemma's
stored 1 + w norms; fitlm's import of fitlm's export reproduces the logits; the gguf package reads the
metadata; transformers' GGUF loader gives the same logits where its GGUF reader knows every key the
model uses (it reads no query_pre_attn_scalar, key_length for Qwen3, or RoPE scaling).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from fitlm.export.gguf import export_gguf
from fitlm.models.io import load_model_dir
from tests.parity.test_families import CASES, case  # noqa: F401, F811  (the module-scoped HF checkpoints)


def _rope_type(kw: dict) -> str | None:
    sc = kw.get("rope_scaling") or {}
    return sc.get("rope_type", sc.get("type"))


def _untied_gemma2(model_type: str, kw: dict) -> bool:
    """llama.cpp's gemma2 loader has no output head of its own (it reuses token_embd): an untied one is refused."""
    return model_type == "gemma2" and kw.get("tie_word_embeddings") is False


def _gemma_scale_differs(model_type: str, kw: dict) -> bool:
    """llama.cpp's Gemma graphs scale scores by head_dim^-1/2 and read no key for query_pre_attn_scalar (whose
    transformers default is 256): any other value is refused."""
    return model_type.startswith("gemma") and kw.get("query_pre_attn_scalar", 256) != kw["head_dim"]


def _moe_graph_differs(model_type: str, kw: dict) -> bool:
    """llama.cpp's MoE graphs route every block, and qwen3moe renormalizes the top-k weights where qwen2moe does not."""
    dense = kw.get("mlp_only_layers") or kw.get("decoder_sparse_step", 1) != 1
    norm = {"qwen3_moe": True, "qwen2_moe": False}.get(model_type)
    return bool(dense) or (norm is not None and bool(kw.get("norm_topk_prob", False)) != norm)


# Cases whose RoPE llama.cpp can store: metadata (linear, yarn), factor tensors (llama3, longrope) or plain.
EXPORTABLE = [
    n
    for n, (t, kw, _) in CASES.items()
    if _rope_type(kw) != "dynamic"
    and not _untied_gemma2(t, kw)
    and not _gemma_scale_differs(t, kw)
    and not _moe_graph_differs(t, kw)
]
MOE_REFUSED = [n for n, (t, kw, _) in CASES.items() if _moe_graph_differs(t, kw)]
UNTIED_GEMMA2 = [n for n, (t, kw, _) in CASES.items() if _untied_gemma2(t, kw)]
GEMMA_SCALE = [n for n, (t, kw, _) in CASES.items() if _gemma_scale_differs(t, kw) and not _untied_gemma2(t, kw)]
# transformers' GGUF loader reads these completely (short inputs: within every sliding window). Not Phi-3:
# without a tokenizer in the file its config keeps pad_token_id 32000, outside this test vocabulary.
TRANSFORMERS_READS = {"qwen2.5_gqa6-2", "mistral_window7_headdim16"}
T = 5


def ids(t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 131, (2, t), generator=torch.Generator().manual_seed(seed))


REFUSED = [
    n for n in CASES if n not in EXPORTABLE and n not in UNTIED_GEMMA2 and n not in GEMMA_SCALE and n not in MOE_REFUSED
]


@pytest.fixture
def exported(case, tmp_path):
    name, hf, d, ours, mcfg, _ = case
    f = tmp_path / "m.gguf"
    export_gguf(load_model_dir(d), f, "f32")
    return f


@pytest.mark.parametrize("case", EXPORTABLE, indirect=True)
def test_gguf_export_imports_back_with_equal_logits(case, exported):
    name, hf, d, ours, mcfg, _ = case
    back = load_model_dir(exported)
    got = back.config.model
    if mcfg.rope_scaling is not None and mcfg.rope_scaling.type == "llama3" and got.rope_scaling.type == "longrope":
        # 8 frequencies hold too few ramp points to name Llama 3's parameters: the same factors come back as
        # a fixed (never switching) LongRoPE pair -- equal frequencies, checked by the logits below.
        assert got.rope_scaling.short_factor == got.rope_scaling.long_factor
        got = got.model_copy(update={"rope_scaling": mcfg.rope_scaling})
    assert got.model_dump(exclude={"init_std"}) == mcfg.model_dump(exclude={"init_std"})
    x = ids(40)
    with torch.no_grad():
        torch.testing.assert_close(back.model(x), ours(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", EXPORTABLE, indirect=True)
def test_gguf_names_are_llama_cpps(case, exported):
    from gguf import GGUFReader

    name, hf, d, ours, mcfg, _ = case
    reader = GGUFReader(str(exported))
    fields = {k: v.contents() for k, v in reader.fields.items() if not k.startswith("GGUF.")}
    arch = mcfg.family.gguf.arch
    assert fields["general.architecture"] == arch
    assert fields[f"{arch}.block_count"] == mcfg.num_layers
    assert fields[f"{arch}.attention.head_count_kv"] == mcfg.kv_heads
    names = {t.name for t in reader.tensors}
    assert "token_embd.weight" in names and "blk.0.attn_norm.weight" in names and "output_norm.weight" in names
    assert ("output.weight" in names) == (not mcfg.tie_embeddings)
    sc = mcfg.rope_scaling
    if sc is not None and sc.type == "llama3":
        assert "rope_freqs.weight" in names
    if sc is not None and sc.type == "longrope":
        assert {"rope_factors_short.weight", "rope_factors_long.weight"} <= names
    expected = {
        "phi3": {"blk.0.attn_qkv.weight", "blk.0.ffn_up.weight"},
        "gemma2": {"blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight"},
        "gemma3": {"blk.0.attn_q_norm.weight", "blk.0.post_ffw_norm.weight"},
        "qwen3": {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"},
        "qwen2": {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"},
        "qwen3moe": {"blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_exps.weight", "blk.1.ffn_down_exps.weight"},
    }.get(arch, set())
    assert expected <= names
    if mcfg.family.gguf.norm_offset:  # Gemma: llama.cpp stores the scale 1 + w
        t = next(t for t in reader.tensors if t.name == "blk.0.attn_norm.weight")
        w = ours.state_dict()["model.layers.0.input_layernorm.weight"]
        torch.testing.assert_close(torch.tensor(t.data).float(), w + 1.0)


@pytest.mark.parametrize("case", sorted(TRANSFORMERS_READS), indirect=True)
def test_transformers_gguf_loader_gives_equal_logits(case, exported):
    name, hf, d, ours, mcfg, _ = case
    back = AutoModelForCausalLM.from_pretrained(exported.parent, gguf_file=exported.name, dtype=torch.float32).eval()
    x = ids(T, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ours(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", REFUSED, indirect=True)
def test_gguf_export_refuses_scaling_without_a_llama_cpp_key(case, tmp_path):
    from fitlm.export.errors import ExportError
    from fitlm.models.gguf import GGUFError

    name, hf, d, *_ = case
    with pytest.raises((GGUFError, ExportError), match="RoPE scaling"):
        export_gguf(load_model_dir(d), tmp_path / "m.gguf", "f32")
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("case", UNTIED_GEMMA2, indirect=True)
def test_gguf_export_of_an_untied_gemma2_is_refused_and_a_tied_one_round_trips(case, tmp_path):
    from fitlm.export.errors import ExportError

    name, hf, d, ours, mcfg, _ = case
    with pytest.raises(ExportError, match="gemma2 architecture has no output head of its own.*--format hf"):
        export_gguf(load_model_dir(d), tmp_path / "m.gguf", "f32")
    assert not (tmp_path / "m.gguf").exists()
    tied_hf = copy.deepcopy(hf)  # the same checkpoint with its head tied, as Gemma 2 ships
    tied_hf.config.tie_word_embeddings = True
    tied_hf.config.query_pre_attn_scalar = tied_hf.config.head_dim  # as Gemma 2 2B/9B ship: llama.cpp's scale
    tied_hf.tie_weights()
    tied_hf.save_pretrained(tmp_path / "tied")
    tied = load_model_dir(tmp_path / "tied")
    assert tied.config.model.tie_embeddings
    export_gguf(tied, tmp_path / "tied.gguf", "f32")
    back = load_model_dir(tmp_path / "tied.gguf")
    x = ids(40)
    with torch.no_grad():
        torch.testing.assert_close(back.model(x), tied.model(x), rtol=1e-5, atol=1e-5)


def test_llama_3_1_rope_factors_name_their_parameters_again():
    """llama.cpp's rope_freqs of Llama 3.1 (head_dim 128, theta 500000, factor 8, low 1, high 4, 8192) give
    back exactly those parameters, so an imported Llama 3.1 GGUF exports to HF as Meta's config."""
    from fitlm.config import RopeScalingConfig
    from fitlm.models.rope import frequency_factors, scaling_from_factors

    meta = RopeScalingConfig(
        type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192
    )
    factors = frequency_factors(meta, 128, 500000.0, 131072)
    assert factors[0] == 1.0 and max(factors) == 8.0  # high frequencies kept, low ones divided by 8
    assert scaling_from_factors(factors, 128, 500000.0, 131072) == meta
    other = [1.0 + 0.5 * i for i in range(64)]  # not a llama3 ramp: fixed factors, same frequencies
    sc = scaling_from_factors(other, 128, 500000.0, 131072)
    assert sc.type == "longrope" and sc.short_factor == sc.long_factor == other and sc.attention_factor == 1.0


@pytest.mark.parametrize("case", GEMMA_SCALE, indirect=True)
def test_gguf_export_of_a_gemma_scale_llama_cpp_cannot_express_is_refused(case, tmp_path):
    """query_pre_attn_scalar other than the head size is refused; the same checkpoint with the shipped models' rule
    (scalar = head_dim) round trips."""
    from fitlm.models.hf import HFFormatError

    name, hf, d, ours, mcfg, _ = case
    with pytest.raises(HFFormatError, match="query_pre_attn_scalar is .* llama.cpp's Gemma graphs"):
        export_gguf(load_model_dir(d), tmp_path / "m.gguf", "f32")
    assert not (tmp_path / "m.gguf").exists()
    fixed = copy.deepcopy(hf)
    fixed.config.query_pre_attn_scalar = fixed.config.head_dim
    fixed.save_pretrained(tmp_path / "fixed")
    src = load_model_dir(tmp_path / "fixed")
    export_gguf(src, tmp_path / "fixed.gguf", "f32")
    back = load_model_dir(tmp_path / "fixed.gguf")
    x = ids(40)
    with torch.no_grad():
        torch.testing.assert_close(back.model(x), src.model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", MOE_REFUSED, indirect=True)
def test_gguf_export_of_an_moe_llama_cpps_graph_cannot_run_is_refused(case, tmp_path):
    """Dense blocks among routed ones, or top-k weights normalized where llama.cpp's graph does the other thing
    (tests/parity/test_llama_cpp.py runs the expressible ones in llama.cpp): refused before a file is written."""
    from fitlm.models.gguf import GGUFError

    name, hf, d, *_ = case
    with pytest.raises(GGUFError, match="llama.cpp's (qwen3moe|qwen2moe|llama) graph .*--format hf"):
        export_gguf(load_model_dir(d), tmp_path / "m.gguf", "f32")
    assert not (tmp_path / "m.gguf").exists()
