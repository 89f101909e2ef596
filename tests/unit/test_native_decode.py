"""fitlm.infer.native_decode: a decode step in one C call gives the torch step's logits and greedy tokens, for
every family it takes (biases, q/k norms, fused projections, sliding windows, tied or untied heads), in one
stream and in SlotBatch's right-aligned batches; the families and wrappers it does not take keep the torch
step; without a compiler decoding still works."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fitlm.config import ModelConfig
from fitlm.infer import native
from fitlm.infer.batched import SlotBatch
from fitlm.infer.generate import generate, last_logits
from fitlm.infer.native_decode import NativeDecoder, unsupported
from fitlm.registry import build_model

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler to build decode_step.c")

# (name, ModelConfig fields): every model shape the C step takes
SHAPES = {
    "llama tied": dict(arch="llama", tie_embeddings=True),
    "llama untied, MHA": dict(arch="llama", tie_embeddings=False, num_kv_heads=4),
    "qwen2 (q/k/v biases)": dict(arch="qwen2"),
    "qwen3 (q/k norms)": dict(arch="qwen3"),
    "qwen3 head_dim 32 (heads x head_dim != hidden)": dict(arch="qwen3", head_dim=32),
    "phi3 (fused q/k/v and gate/up)": dict(arch="phi3"),
    "mistral-like window 5": dict(arch="llama", sliding_window=5),
    "llama3 rope scaling": dict(arch="llama", rope_scaling={"type": "llama3", "factor": 8.0}),
    "dynamic rope scaling": dict(arch="llama", rope_scaling={"type": "dynamic", "factor": 2.0}),
}


def _model(dtype: torch.dtype, **fields) -> nn.Module:
    base = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=96, max_seq_len=48)
    torch.manual_seed(0)
    model = build_model(ModelConfig(**{**base, **fields})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.5)  # (ones / zeros at init: a dropped one would go unseen)
    return model.to(dtype)


def _torch_steps(model: nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits [n, V] of feeding `tokens` one at a time after `prompt`, by the torch forward."""
    cache = model.new_kv_cache(1, len(prompt) + len(tokens))
    last_logits(model, torch.tensor([prompt]), cache)
    return torch.stack([last_logits(model, torch.tensor([[t]]), cache)[0] for t in tokens])


def _native_steps(model: nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    cache = model.new_kv_cache(1, len(prompt) + len(tokens))
    last_logits(model, torch.tensor([prompt]), cache)  # the prompt: torch's prefill, as generate runs it
    decoder = NativeDecoder.for_model(model, cache)
    assert decoder is not None, unsupported(model, cache)
    return torch.stack([decoder.step([t])[0] for t in tokens])


PROMPT, FED = [5, 17, 3, 88, 41, 9, 60], [12, 7, 95, 0, 33, 33, 71, 2, 50, 19]  # 17 positions: past the window of 5


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_c_step_gives_the_torch_steps_logits(shape, dtype):
    model = _model(dtype, **SHAPES[shape])
    with torch.inference_mode():
        ref, out = _torch_steps(model, PROMPT, FED), _native_steps(model, PROMPT, FED)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)  # float rounding: another summation order
    else:  # half rounds at the same points; a sum's last bit may differ and carry through: a few half steps
        torch.testing.assert_close(out.float(), ref.float(), atol=0.05, rtol=0.02)
        assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("shape", ["llama tied", "qwen3 (q/k norms)", "phi3 (fused q/k/v and gate/up)"])
def test_generate_runs_the_c_step_and_its_greedy_tokens_are_the_torch_steps(shape, monkeypatch):
    model = _model(torch.float32, **SHAPES[shape])
    calls = []
    step = NativeDecoder.step
    monkeypatch.setattr(NativeDecoder, "step", lambda self, *a: calls.append(1) or step(self, *a))
    fast = generate(model, PROMPT, 20)
    assert len(calls) == 19  # every token after the prompt's first
    assert generate(model, PROMPT, 20, native=False) == fast
    monkeypatch.setenv("FITLM_NATIVE", "0")
    monkeypatch.setattr(native, "_loaded", {})
    assert generate(model, PROMPT, 20) == fast
    assert len(calls) == 19  # (native=False and the off switch: the torch step)


def test_a_batch_of_right_aligned_rows_equals_each_rows_solo_run():
    """SlotBatch's layout (each row right-aligned, its own position and first cell): every stream's greedy tokens
    are its solo generate's, in bf16 too (each row's products round on their own, not as a batch)."""
    for dtype, more in ((torch.float32, []), (torch.bfloat16, [[7, 7], [90, 1, 2], [11] * 9])):
        model = _model(dtype, **SHAPES["qwen2 (q/k/v biases)"])
        prompts = [[3, 9, 27], [81, 5, 60, 22, 14, 70, 1], [44], [8, 8, 8, 8, 2]] + more  # bf16: 7 streams
        solo = [generate(model, p, 12) for p in prompts]
        batch, out = SlotBatch(model), {i: [] for i in range(len(prompts))}
        first = batch.add_many([(i, p, len(p) + 13) for i, p in enumerate(prompts)])
        tokens = [int(row.float().argmax()) for row in first]
        assert batch._native_decoder(batch.cache) is not None  # the C step runs the batch
        for _ in range(11):
            for i, t in enumerate(tokens):
                out[i].append(t)
            tokens = [int(row.float().argmax()) for row in batch.step(tokens)]
        for i, t in enumerate(tokens):
            out[i].append(t)
        assert [out[i] for i in range(len(prompts))] == solo, dtype


def test_the_batch_step_equals_the_torch_batch_step():
    model = _model(torch.float32, **SHAPES["llama tied"])
    prompts = [[3, 9, 27, 4], [81, 5], [44, 1, 2, 3, 4, 5, 6]]
    runs = []
    for use_c in (True, False):
        batch = SlotBatch(model, native=use_c)
        batch.add_many([(i, p, 30) for i, p in enumerate(prompts)])
        assert (batch._native_decoder(batch.cache) is not None) == use_c
        runs.append(torch.stack([batch.step([7, 8, 9]), batch.step([10, 11, 12])]))
    torch.testing.assert_close(runs[0], runs[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fields", [dict(arch="gemma2"), dict(arch="gpt2"), dict(arch="qwen3_moe", num_experts=4)])
def test_other_families_keep_the_torch_step(fields):
    model = _model(torch.float32, **fields)
    assert unsupported(model, model.new_kv_cache(1, 8)) is not None
    assert NativeDecoder.for_model(model, model.new_kv_cache(1, 8)) is None
    assert len(generate(model, PROMPT, 3)) == 3


def test_wrapped_or_hooked_layers_and_big_batches_keep_the_torch_step():
    from fitlm.finetune.lora import LoraSpec, inject_lora

    model = _model(torch.float32, arch="llama")
    cache = model.new_kv_cache(1, 8)
    assert unsupported(model, cache) is None
    assert "more than 4" in unsupported(model, model.new_kv_cache(5, 8))  # fp32: oneDNN's GEMM beyond 4 streams
    half = _model(torch.bfloat16, arch="llama")
    assert unsupported(half, half.new_kv_cache(8, 8)) is None and "more than 8" in unsupported(
        half, half.new_kv_cache(9, 8)
    )
    handle = model.model.layers["1"].mlp.register_forward_hook(lambda *a: None)
    assert "hooks" in unsupported(model, cache)
    handle.remove()
    inject_lora(model, LoraSpec(r=2, alpha=4, dropout=0.0, modules=("model.layers.0.self_attn.q_proj",)))
    assert unsupported(model, cache) is not None  # (the adapter wraps or hooks q_proj: the torch step runs it)


def test_without_a_compiler_decoding_keeps_the_torch_step(monkeypatch, tmp_path):
    model = _model(torch.float32, arch="llama")
    ref = generate(model, PROMPT, 6)
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("FITLM_CACHE_DIR", str(tmp_path))  # (nothing built there: the build must run)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    with pytest.warns(UserWarning, match="no C compiler"):
        assert NativeDecoder.for_model(model, model.new_kv_cache(1, 16)) is None
    assert generate(model, PROMPT, 6) == ref


def test_a_broken_build_says_why_and_keeps_the_torch_step(monkeypatch, tmp_path):
    fake_cc = tmp_path / "cc"
    fake_cc.write_text("#!/bin/sh\necho 'cc: error: unsupported option' >&2\nexit 1\n")
    fake_cc.chmod(0o755)
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("FITLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(fake_cc))
    with pytest.warns(UserWarning, match="unsupported option"):
        assert native.library("decode_step") is None


def test_weights_still_in_their_file_are_copied_once_and_the_model_still_trains(tmp_path):
    """A model loaded from safetensors keeps its weights in the file's pages (copy-on-write), which stream slower
    per token: the C decoder gives them process memory first; the values, the Parameters and training stay."""
    from fitlm.infer.file_backed import copy_file_backed, file_ranges
    from fitlm.models.io import load_model_dir, save_model_dir

    model = _model(torch.float32, arch="llama", tie_embeddings=True)
    save_model_dir(model, model.config, tmp_path / "m")
    loaded = load_model_dir(tmp_path / "m").model

    def in_files(m: nn.Module) -> int:
        ranges = file_ranges()
        return sum(any(a <= p.data_ptr() < b for a, b in ranges) for p in m.parameters())

    if in_files(loaded) == 0:
        pytest.skip("this safetensors build reads into process memory: nothing is file-backed")
    params, values = list(loaded.parameters()), [p.detach().clone() for p in loaded.parameters()]
    ref = generate(loaded, PROMPT, 8, native=False)
    assert generate(loaded, PROMPT, 8) == ref  # (the C decoder: copies on its way)
    assert in_files(loaded) == 0 and copy_file_backed(loaded) == 0
    assert list(loaded.parameters()) == params and all(torch.equal(p, v) for p, v in zip(params, values))
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # (still tied)
    loaded(torch.tensor([PROMPT])).sum().backward()  # plain tensors, not inference ones
    assert loaded.model.layers["0"].mlp.down_proj.weight.grad is not None


def test_bad_steps_and_replaced_tensors_are_refused_before_the_c_call():
    from fitlm.models.layers import KVCache

    model = _model(torch.float32, arch="llama")
    cache = model.new_kv_cache(2, 16)
    last_logits(model, torch.tensor([PROMPT[:3], PROMPT[3:6]]), cache)
    decoder = NativeDecoder.for_model(model, cache)
    assert decoder is not None
    with pytest.raises(ValueError, match="first cells"):
        decoder.step([1, 2], [3, 3], [0, -1])  # (a cell before the row: reads and writes out of it)
    with pytest.raises(ValueError, match="first cells"):
        decoder.step([1, 2], [3, 3], [0, 4])  # (past the cell written now: nothing to attend to)
    with pytest.raises(ValueError, match="vocabulary"):
        decoder.step([1, 96])
    with torch.no_grad():
        model.lm_head.weight.data = model.lm_head.weight.data.clone()  # (another tensor: the C struct's is stale)
    with pytest.raises(RuntimeError, match="replaced"):
        decoder.step([1, 2])
    other = KVCache(2, 1, 16, 2, 8)  # head_dim 8, not the model's 16
    assert "KV cache" in unsupported(model, other)


def test_inference_and_shared_parameters_are_not_copied(tmp_path):
    from fitlm.infer.file_backed import copy_file_backed
    from fitlm.models.io import load_model_dir, save_model_dir

    model = _model(torch.float32, arch="llama")
    save_model_dir(model, model.config, tmp_path / "m")
    with torch.inference_mode():
        inference = load_model_dir(tmp_path / "m").model  # (its tensors: inference tensors)
    assert copy_file_backed(inference) == 0
    with torch.inference_mode():
        assert len(generate(inference, PROMPT, 4)) == 4  # and it still decodes
    shared = _model(torch.float32, arch="llama").share_memory()
    pointers = [p.data_ptr() for p in shared.parameters()]
    assert copy_file_backed(shared) == 0 and [p.data_ptr() for p in shared.parameters()] == pointers
