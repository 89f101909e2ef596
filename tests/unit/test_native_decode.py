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
    "head_dim 64 (registers hold a head's weighted values)": dict(arch="llama", hidden_size=256, num_heads=4),
    "head_dim 128, window 20": dict(arch="qwen2", hidden_size=256, num_heads=2, sliding_window=20),
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
    more = [[7, 7], [90, 1, 2], [11] * 9, [5, 4, 3, 2, 1], [60, 61], [2] * 4]  # 10 streams: 2 passes of 8 rows
    for dtype in (torch.float32, torch.bfloat16):
        model = _model(dtype, **SHAPES["qwen2 (q/k/v biases)"])
        prompts = [[3, 9, 27], [81, 5, 60, 22, 14, 70, 1], [44], [8, 8, 8, 8, 2]] + more
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
    for dtype in (torch.float32, torch.bfloat16):
        m = _model(dtype, arch="llama")
        assert unsupported(m, m.new_kv_cache(16, 8)) is None
        assert "more than 16" in unsupported(m, m.new_kv_cache(17, 8))  # (oneDNN's GEMM beyond)
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


def _packed_linear(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [m, n] @ w [rows, n]^T by decode_step.c's packed products (fitlm_linear), in w's dtype."""
    import ctypes

    from fitlm.infer.native_decode import DTYPES, pack_panels

    lib = native.library("decode_step")
    assert lib is not None
    lib.fitlm_linear.argtypes = (
        [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    )
    panels, y = pack_panels(w), torch.empty(x.shape[0], w.shape[0], dtype=w.dtype)
    args = (x.shape[0], x.shape[1], w.shape[0], DTYPES[w.dtype], y.data_ptr(), torch.get_num_threads())
    assert lib.fitlm_linear(panels.data_ptr(), None, x.contiguous().data_ptr(), *args) == 0
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, n", [(70, 33), (32, 64), (5, 7), (100, 130)])
def test_the_packed_products_equal_torchs_linear_and_a_rows_sum_never_depends_on_the_batch(dtype, rows, n):
    """Panels with rows past the weight's end, an odd number of inputs (bf16's unpaired last one), batches of 1
    to 17 rows (8 at a time): torch's product to float rounding, and each row bit-equal to its own 1-row call."""
    torch.manual_seed(rows + n)
    w, x = torch.randn(rows, n).to(dtype), torch.randn(17, n).to(dtype)
    ref = (x.double() @ w.double().T).to(dtype)  # [17, rows]
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    for m in (1, 3, 8, 9, 17):
        got = _packed_linear(w, x[:m])
        torch.testing.assert_close(got.float(), ref[:m].float(), rtol=tol, atol=tol * n**0.5)
    solo = torch.cat([_packed_linear(w, x[i : i + 1]) for i in range(17)])
    assert torch.equal(_packed_linear(w, x), solo)


def test_weights_changed_in_place_between_steps_are_packed_again():
    """The products read packed copies of the weights: an in-place update (an optimizer step between an RL
    trainer's samplings) must reach the next step and the next decoder, never the stale copy."""
    model = _model(torch.float32, arch="llama", tie_embeddings=True)
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    def update() -> None:
        with torch.no_grad():
            model.model.layers["1"].mlp.down_proj.weight.mul_(-2.0)
            model.model.embed_tokens.weight.add_(0.25)  # (also the tied head)

    cache = model.new_kv_cache(1, 16)
    last_logits(model, torch.tensor([PROMPT]), cache)
    decoder = NativeDecoder.for_model(model, cache)
    assert decoder is not None
    decoder.step([12])
    update()
    got = decoder.step([7])[0]
    model.load_state_dict(saved)
    ref = _torch_steps(model, PROMPT, [12])  # (the first step before the update, the second after, as above)
    torch_cache = model.new_kv_cache(1, 16)
    last_logits(model, torch.tensor([PROMPT]), torch_cache)
    last_logits(model, torch.tensor([[12]]), torch_cache)
    update()
    want = last_logits(model, torch.tensor([[7]]), torch_cache)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(ref[0], want)  # (the update changed the logits: the check above can fail)
    assert generate(model, PROMPT, 6) == generate(model, PROMPT, 6, native=False)  # (a new decoder: repacked too)


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


def test_a_model_loaded_under_inference_mode_decodes_in_c(tmp_path):
    from fitlm.models.io import load_model_dir, save_model_dir

    model = _model(torch.float32, arch="llama")
    save_model_dir(model, model.config, tmp_path / "m")
    with torch.inference_mode():
        inference = load_model_dir(tmp_path / "m").model  # (its tensors: inference tensors, without versions)
        cache = inference.new_kv_cache(1, 16)
        assert NativeDecoder.for_model(inference, cache) is not None
        assert generate(inference, PROMPT, 4) == generate(inference, PROMPT, 4, native=False)


def _cpu_has(*flags: str) -> bool:
    from pathlib import Path

    info = Path("/proc/cpuinfo")
    have = set(info.read_text().split()) if info.exists() else set()
    return all(f in have for f in flags)


# the other vector paths of decode_step.c than this CPU's best: built for an older target and checked here
TARGETS = {
    "x86-64 (no vectors: the scalar loops)": ("x86-64", ()),
    "x86-64-v3 (AVX2)": ("x86-64-v3", ("avx2", "fma", "f16c")),
    "skylake-avx512 (AVX-512 without BF16 pair products)": ("skylake-avx512", ("avx512f", "avx512bw", "avx512vl")),
}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_vector_path_gives_the_same_products_and_steps(target, monkeypatch):
    import platform

    march, flags = TARGETS[target]
    if platform.machine() != "x86_64" or not _cpu_has(*flags):
        pytest.skip(f"this CPU cannot run code built for {march}")
    monkeypatch.setattr(native, "FLAGS", [f"-march={march}" if f == "-march=native" else f for f in native.FLAGS])
    monkeypatch.setattr(native, "_loaded", {})
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        test_the_packed_products_equal_torchs_linear_and_a_rows_sum_never_depends_on_the_batch(dtype, 70, 33)
        test_a_c_step_gives_the_torch_steps_logits("qwen2 (q/k/v biases)", dtype)
    test_a_batch_of_right_aligned_rows_equals_each_rows_solo_run()


def test_without_memory_for_the_packed_copies_decoding_keeps_the_torch_step(monkeypatch):
    import fitlm.infer.native_decode as native_decode

    model = _model(torch.bfloat16, arch="llama", tie_embeddings=False)
    ref = generate(model, PROMPT, 6, native=False)
    monkeypatch.setattr(native_decode, "_PANELS", native_decode.WeakIdKeyDictionary())  # (nothing packed yet)
    monkeypatch.setattr(native_decode, "available_host_memory", lambda: 2 * 64 * 64 * 2)  # (under 2 weights' bytes)
    with pytest.warns(UserWarning, match="GiB of weights into its packed layout"):
        assert NativeDecoder.for_model(model, model.new_kv_cache(1, 16)) is None
    with pytest.warns(UserWarning):
        assert generate(model, PROMPT, 6) == ref
    monkeypatch.setattr(native_decode, "available_host_memory", lambda: None)  # (unknown: no check)
    assert NativeDecoder.for_model(model, model.new_kv_cache(1, 16)) is not None


def test_a_model_cast_or_given_new_weights_after_decoding_is_packed_again():
    """model.to(dtype) and `param.data = ...` keep the Parameters (and may keep their version counters at 0):
    the packed copies must follow the new tensors, not the Parameters' identities."""
    model = _model(torch.float32, arch="llama", tie_embeddings=False)
    generate(model, PROMPT, 4)  # (packs the fp32 weights)
    model.to(torch.bfloat16)
    assert generate(model, PROMPT, 8) == generate(model, PROMPT, 8, native=False)
    with torch.no_grad():
        for p in model.model.layers["0"].parameters():
            p.data = torch.randn_like(p)
    assert generate(model, PROMPT, 8) == generate(model, PROMPT, 8, native=False)


def test_a_changed_header_builds_the_kernel_again(monkeypatch, tmp_path):
    """The library's name hashes the source and the headers beside it: editing products.h alone must not load the
    library built from the old one."""
    (tmp_path / "k.c").write_text('#include "k.h"\nint fitlm_k(void) { return K; }\n')
    (tmp_path / "k.h").write_text("#define K 1\n")
    monkeypatch.setattr(native, "source", lambda name: tmp_path / f"{name}.c")
    monkeypatch.setenv("FITLM_CACHE_DIR", str(tmp_path / "cache"))
    cc = native.compiler()
    first = native.build("k", cc)
    (tmp_path / "k.h").write_text("#define K 2\n")
    second = native.build("k", cc)
    assert first != second and second.exists()
    import ctypes

    assert ctypes.CDLL(str(second)).fitlm_k() == 2
