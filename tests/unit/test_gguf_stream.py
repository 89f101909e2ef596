"""GGUF weights one tensor at a time (fitlm.models.gguf.stream_gguf, model.init_from's GGUF branch).

References: for every family the GGUF tests export (tests/parity/test_gguf_families.py), the transformers
checkpoint the file was made from (fp32 round trip: exact, Gemma's stored 1 + w norms within an ulp of
1); for quantized types, the gguf package's own dequantization of the blocks written, in Hugging Face row
order (llama.cpp's q/k row permutation is applied by this test's own copy of the converter's formula, and
it commutes with row-wise quantization, so no fitlm code makes the reference); and the whole-file reader
(`read_gguf` below, through `GGUFTensors.state_dict`, and `load_model_dir`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from fitlm.config import validate_dict
from fitlm.export.gguf import export_gguf
from fitlm.export.source import load_for_export
from fitlm.finetune.init_from import resolve_init_from
from fitlm.finetune.initial_weights import base_weights
from fitlm.models.gguf import GGUFError, GGUFTensors, stream_gguf
from fitlm.models.hf import from_hf_state_dict, model_keys
from fitlm.models.io import load_model_dir
from fitlm.models.streaming import layer_group
from tests.parity.test_families import CASES, COMMON, randomize
from tests.parity.test_gguf_families import EXPORTABLE
from tests.parity.test_peft import _permute


def read_gguf(path):
    """(config, HF-named fp32 state dict, metadata) of a GGUF file read whole: the reference for streaming."""
    src = GGUFTensors(path)
    return src.config, src.state_dict(), src.meta


def _init_from(path) -> object:
    return resolve_init_from(validate_dict({"model": {"init_from": str(path)}, "data": {"seq_length": 16}}))


@pytest.fixture(params=EXPORTABLE)
def family_gguf(request, tmp_path):
    """(the checkpoint's fp32 state dict, GGUF f32 file written by `fitlm export`) for one of the GGUF tests' cases."""
    model_type, overrides, _ = CASES[request.param]
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**COMMON, **overrides})).float().eval()
    randomize(hf, seed=len(request.param))
    hf.save_pretrained(tmp_path / "hf")
    export_gguf(load_for_export(tmp_path / "hf"), tmp_path / "m.gguf", "f32")
    # fitlm's names of the checkpoint's tensors (HF's own, but for MoE experts, which fitlm holds stacked)
    return load_model_dir(tmp_path / "hf").model.state_dict(), tmp_path / "m.gguf"


def test_every_family_streams_the_checkpoints_weights(family_gguf):
    hf_sd, path = family_gguf
    cfg, specs, stream = stream_gguf(path)
    got = dict(stream)
    assert got.keys() == specs.keys() == set(model_keys(cfg))
    for name, t in got.items():
        assert (t.dtype, tuple(t.shape)) == specs[name], name
        ref = hf_sd[name].float()
        if cfg.family.gguf.norm_offset and name.endswith("norm.weight"):  # (w + 1) - 1 rounds at 1's ulp
            torch.testing.assert_close(t, ref, rtol=0, atol=2**-23)
        else:
            assert torch.equal(t, ref), name
    # The whole-file reader and a whole-model load give the same tensors, under HF and module names.
    _, whole, _ = read_gguf(path)  # HF names: through the family's adapter to module names
    assert all(torch.equal(got[k], v) for k, v in from_hf_state_dict(whole, cfg, str(path)).items())
    loaded = load_model_dir(path).model.state_dict()
    assert loaded.keys() == got.keys() and all(torch.equal(loaded[k], got[k]) for k in loaded)


def test_init_from_gguf_streams_only_the_blocks_a_rank_holds(family_gguf):
    _, path = family_gguf
    cfg = _init_from(path)
    everything = dict(base_weights(cfg))
    reference = load_model_dir(path).model.state_dict()  # what the branch handed out before it streamed
    assert everything.keys() == reference.keys()  # the tied head comes right after the embedding it shares
    assert all(torch.equal(everything[k], reference[k]) for k in reference)
    # A last pipeline stage: its block and the head (a tied head is the embedding, read for it alone).
    groups = {str(cfg.model.num_layers - 1), "model.norm.weight", "lm_head.weight"}
    part = dict(base_weights(cfg, groups))
    want = {k for k in reference if layer_group(k) in groups}
    # A tensor read comes out under every name it feeds (as from an HF directory): the tied embedding too.
    assert want <= set(part) and set(part) - want <= (
        {"model.embed_tokens.weight"} if cfg.model.tie_embeddings else set()
    )
    assert all(torch.equal(part[k], reference[k]) for k in part)


# --------------------------------------------------------------------------- quantized types

H, FFN, V, HEADS, KV = 256, 512, 64, 4, 2  # K-quants pack 256 values per block along a row
BLOCK = {  # llama.cpp name -> (HF module, rows, columns; 0: a vector)
    "attn_q": ("self_attn.q_proj", H, H),
    "attn_k": ("self_attn.k_proj", H // 2, H),
    "attn_v": ("self_attn.v_proj", H // 2, H),
    "attn_output": ("self_attn.o_proj", H, H),
    "ffn_gate": ("mlp.gate_proj", FFN, H),
    "ffn_up": ("mlp.up_proj", FFN, H),
    "ffn_down": ("mlp.down_proj", H, FFN),
    "attn_norm": ("input_layernorm", H, 0),
    "ffn_norm": ("post_attention_layernorm", H, 0),
}


def _k_blocks(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """Q4_K / Q6_K blocks (the gguf package cannot quantize to them): random quants, small finite scales."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.constants import GGMLQuantizationType as T

    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if qtype == T.Q4_K:  # d, dmin (f16) lead the block
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    else:  # Q6_K: d (f16) ends it
        raw[..., -2:] = scale
    return raw.reshape(rows, -1)


def _write_llama(path, qtype) -> dict[str, torch.Tensor]:
    """A 2-block Llama GGUF whose matrices are stored as `qtype`; returns the HF-named weights they encode."""
    import gguf
    from gguf.quants import dequantize, quantize

    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in [
        (w.add_context_length, 64),
        (w.add_embedding_length, H),
        (w.add_block_count, 2),
        (w.add_feed_forward_length, FFN),
        (w.add_head_count, HEADS),
        (w.add_head_count_kv, KV),
        (w.add_rope_freq_base, 10000.0),
        (w.add_layer_norm_rms_eps, 1e-5),
    ]:
        add(v)
    shapes = {
        "token_embd": ("model.embed_tokens", V, H),
        "output": ("lm_head", V, H),
        "output_norm": ("model.norm", H, 0),
    }
    for i in range(2):
        for g, (ours, rows, cols) in BLOCK.items():
            shapes[f"blk.{i}.{g}"] = (f"model.layers.{i}.{ours}", rows, cols)
    want = {}
    for g, (ours, rows, cols) in shapes.items():
        if not cols:  # norms stay F32, as llama.cpp keeps them
            a = rng.standard_normal(rows).astype(np.float32)
            w.add_tensor(f"{g}.weight", a)
            want[f"{ours}.weight"] = torch.from_numpy(a)
            continue
        a = rng.standard_normal((rows, cols)).astype(np.float32)
        q = _k_blocks(rows, cols, qtype, rng) if qtype in (T.Q4_K, T.Q6_K) else quantize(a, qtype)
        want[f"{ours}.weight"] = torch.from_numpy(np.asarray(dequantize(q, qtype), dtype=np.float32))
        if g.endswith(("attn_q", "attn_k")):  # llama.cpp's layout: rows permuted (whole blocks move with them)
            q = _permute(q, HEADS if g.endswith("attn_q") else KV)
        w.add_tensor(f"{g}.weight", q, raw_shape=q.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return want


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_quantized_tensors_dequantize_one_at_a_time(tmp_path, qtype):
    import gguf

    want = _write_llama(tmp_path / "m.gguf", getattr(gguf.GGMLQuantizationType, qtype))
    cfg, specs, stream = stream_gguf(tmp_path / "m.gguf")
    got = dict(stream)
    assert set(got) == set(want) == set(specs)
    for name, t in got.items():
        assert torch.equal(t, want[name]), name
    _, whole, _ = read_gguf(tmp_path / "m.gguf")
    assert all(torch.equal(whole[k], got[k]) for k in whole)


def test_truncated_gguf_is_refused_naming_the_file(tmp_path):
    import gguf

    _write_llama(tmp_path / "m.gguf", gguf.GGMLQuantizationType.Q8_0)
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFError, match=r"cut\.gguf: not a readable GGUF file.*truncated: download or convert it"):
        stream_gguf(tmp_path / "cut.gguf")
    # Cut while it is being read (the header was whole when the file was opened).
    cfg, specs, stream = stream_gguf(tmp_path / "m.gguf")
    (tmp_path / "m.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFError, match=r"m\.gguf: tensor .* is cut short; the file is truncated, download or conv"):
        dict(stream)
