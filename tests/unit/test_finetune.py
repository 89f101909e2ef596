"""Fine-tuning: LoRA injection and merging, layer freezing, trainer runs, adapters on disk, early stopping."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fitlm.config import ModelConfig, validate_dict
from fitlm.finetune.apply import apply_finetune
from fitlm.finetune.early_stopping import EarlyStopping
from fitlm.finetune.errors import FinetuneError
from fitlm.finetune.lora import LoraError, apply_lora, merge_lora, split_lora_state_dict
from fitlm.finetune.peft_format import load_adapter
from fitlm.models.io import load_model_dir
from fitlm.registry import build_model
from fitlm.train.trainer import Trainer
from tests.e2e.helpers import read_metrics, tiny_config
from tests.helpers import attach_adapter
from tests.unit.counting import trainable_parameter_count

MODEL = dict(
    arch="llama",
    hidden_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=96,
    vocab_size=128,
    max_seq_len=32,
)


def tiny(**kw):
    torch.manual_seed(0)
    return build_model(ModelConfig(**{**MODEL, **kw}))


def cfg_with(finetune: dict, memory: dict | None = None):
    return validate_dict({"model": MODEL, "data": {"seq_length": 32}, "finetune": finetune, "memory": memory or {}})


def ids():
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def test_trainable_parameter_counts_per_method():
    full = tiny()
    n_full = trainable_parameter_count(full)
    assert n_full == sum(p.numel() for p in full.parameters())
    # LoRA q/v: per layer r·(in+out) for q (64 -> 64) and v (64 -> 32, GQA).
    m = tiny()
    apply_finetune(m, cfg_with({"method": "lora", "lora": {"r": 4}}))
    assert trainable_parameter_count(m) == 4 * (4 * (64 + 64) + 4 * (64 + 32))
    m = tiny()
    apply_finetune(m, cfg_with({"method": "lora", "lora": {"r": 2, "target_modules": ["all-linear"]}}))
    per_layer = sum(2 * (i + o) for i, o in [(64, 64), (64, 32), (64, 32), (64, 64), (64, 96), (64, 96), (96, 64)])
    assert trainable_parameter_count(m) == 4 * per_layer  # lm_head is never a target
    m = tiny()
    apply_finetune(m, cfg_with({"method": "freeze", "freeze_layers": 0.5, "freeze_embeddings": True}))
    block = sum(p.numel() for p in m.model.layers["0"].parameters())
    emb = m.model.embed_tokens.weight.numel()
    assert trainable_parameter_count(m) == n_full - 2 * block - emb
    assert not m.model.layers["1"].self_attn.q_proj.weight.requires_grad
    assert m.model.layers["2"].self_attn.q_proj.weight.requires_grad


def test_lora_at_step_zero_equals_the_base_model_and_keeps_parameter_names():
    base, lora = tiny(), tiny()
    names = set(base.state_dict())
    apply_lora(lora, r=4, alpha=8, dropout=0.1, target_modules=["q_proj", "v_proj"])
    lora.eval()
    assert torch.equal(lora(ids()), base.eval()(ids()))  # B = 0: exactly the base model
    added = set(lora.state_dict()) - names
    assert names <= set(lora.state_dict())  # every base weight keeps its name
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in added and len(added) == 16


def test_merged_weights_give_the_adapter_models_logits():
    m = tiny()
    spec = apply_lora(m, r=4, alpha=16, dropout=0.0, target_modules=["all-linear"])
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    m.eval()
    expected = m(ids())
    base, adapter = split_lora_state_dict(m.state_dict())
    merged = tiny()
    merged.load_state_dict(merge_lora(base, adapter, spec.scaling))
    torch.testing.assert_close(merged.eval()(ids()), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(tiny().eval()(ids()), expected, atol=1e-3)  # the adapter did change the model


def test_bad_lora_inputs_get_clear_errors(tmp_path):
    with pytest.raises(LoraError, match="qq_proj match no linear layer.*q_proj"):
        apply_lora(tiny(), r=4, alpha=8, dropout=0.0, target_modules=["qq_proj"])
    other = tiny(hidden_size=32, num_heads=2, num_kv_heads=None)
    spec = apply_lora(other, r=2, alpha=4, dropout=0.0, target_modules=["q_proj"])
    from fitlm.finetune.peft_format import save_adapter

    save_adapter(split_lora_state_dict(other.state_dict())[1], spec, tmp_path / "a")
    with pytest.raises(LoraError, match="another base model"):
        attach_adapter(tiny(), tmp_path / "a")
    with pytest.raises(LoraError, match="another base model"):
        spec2, t = load_adapter(tmp_path / "a")
        merge_lora(tiny().state_dict(), t, spec2.scaling)
    pickled = tmp_path / "p"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(LoraError, match="pickle"):
        load_adapter(pickled)
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "use_dora": True}))
    with pytest.raises(LoraError, match="DoRA"):
        load_adapter(tmp_path / "a")
    with pytest.raises(FinetuneError, match="between 0.0 and 1.0"):
        from fitlm.finetune.freeze import frozen_layer_count

        frozen_layer_count(4, 1.5)


def phi3_lora_under_tensor_parallel(targets: list[str]) -> None:
    with torch.device("meta"):  # structure only: the check needs no weights
        model = build_model(ModelConfig(**{**MODEL, "arch": "phi3"}))
    apply_finetune(
        model,
        validate_dict(
            {
                "model": {**MODEL, "arch": "phi3"},
                "data": {"seq_length": 32},
                "parallel": {"tensor_parallel": 2},
                "finetune": {"method": "lora", "lora": {"target_modules": targets}},
            }
        ),
    )


def test_layouts_that_cannot_shard_or_split_the_trained_part_are_refused_naming_the_key():
    from fitlm.parallel.pipeline import check_every_stage_trains

    # Phi-3 under tensor parallel: the fused projections are split, so their adapters cannot be sharded.
    with pytest.raises(LoraError, match=r"target_modules: qkv_proj are fused .* only \['o_proj', 'down_proj'\]"):
        phi3_lora_under_tensor_parallel(["qkv_proj", "o_proj"])
    phi3_lora_under_tensor_parallel(["o_proj"])
    # Pipeline parallel: a stage holding only frozen blocks and embeddings would have nothing to train.
    m = tiny()
    apply_finetune(m, cfg_with({"method": "freeze", "freeze_layers": 0.5, "freeze_embeddings": True}))
    with pytest.raises(ValueError, match=r"finetune.freeze_layers: pipeline stage 0 \(blocks 0-1 and the embed"):
        check_every_stage_trains(m, 2)
    check_every_stage_trains(m, 2, [3, 1])  # block 2 (trained) on stage 0
    check_every_stage_trains(tiny(), 4)
    # A tied head is the embedding: stage 0 trains it though the last stage's head holds the same parameter.
    tied = tiny(tie_embeddings=True)
    apply_finetune(tied, cfg_with({"method": "freeze", "freeze_layers": 0.5}))
    check_every_stage_trains(tied, 2)


def test_o2_stores_the_frozen_base_in_half_and_adapters_in_fp32():
    m = tiny()
    apply_finetune(m, cfg_with({"method": "lora"}, {"mixed_precision": "O2", "half_dtype": "bf16"}))
    for n, p in m.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16), n


def test_early_stopping_counts_evaluations_without_improvement():
    s = EarlyStopping(2)
    assert [s.should_stop(x) for x in (3.0, 2.0, 2.5, 1.9, 2.0, 2.1)] == [False, False, False, False, False, True]
    assert s.best == 1.9
    assert not any(EarlyStopping(0).should_stop(x) for x in (1.0, 2.0, 3.0))


@pytest.fixture(scope="module")
def lora_run(tiny_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "run"
    cfg = tiny_config(
        tiny_corpus,
        out,
        finetune={"method": "lora", "lora": {"r": 4, "alpha": 8}},
        train={"max_steps": 6, "eval_interval": 3, "lr": 5e-2, "warmup_steps": 0, "peak_tflops": 1.0},
    )
    trainer = Trainer(validate_dict(cfg))
    before = {k: v.clone() for k, v in trainer.pm.model.state_dict().items()}
    result = trainer.fit()
    return trainer, before, result


def test_lora_training_changes_only_adapters_and_saves_merged_model_plus_peft_adapter(lora_run):
    trainer, before, result = lora_run
    after = trainer.pm.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_" in k for k in changed)  # frozen params unchanged
    assert any(".lora_B." in k for k in changed)
    state_params = {id(p) for g in trainer.step.optimizer.param_groups for p in g["params"]}
    named = dict(trainer.pm.model.named_parameters())
    assert {n for n, p in named.items() if id(p) in state_params} == {n for n in named if ".lora_" in n}
    # model/ holds merged full weights (no lora tensors); adapter/ the PEFT adapter.
    assert not any("lora" in k for k in load_file(str(result.model_dir / "model.safetensors")))
    spec, tensors = load_adapter(result.output_dir / "adapter")
    assert spec.r == 4 and spec.scaling == 2.0 and len(tensors) == 8
    x = ids() % 512
    trainer.pm.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(load_model_dir(result.model_dir).model(x), trainer.pm.model(x), rtol=1e-5, atol=1e-5)
    assert any("eval_loss" in r for r in read_metrics(result.output_dir))


def test_freeze_keeps_the_bottom_layers_unchanged(tiny_corpus, tmp_path):
    cfg = tiny_config(
        tiny_corpus,
        tmp_path / "out",
        finetune={"method": "freeze", "freeze_layers": 0.5},
        train={"max_steps": 2, "eval_interval": 0, "warmup_steps": 0, "peak_tflops": 1.0},
    )
    trainer = Trainer(validate_dict(cfg))
    before = {k: v.clone() for k, v in trainer.pm.model.state_dict().items()}
    trainer.fit()
    after = trainer.pm.model.state_dict()
    for k in before:
        same = torch.equal(before[k], after[k])
        assert same == k.startswith("model.layers.0."), k  # 2 layers × 0.5 = layer 0 frozen


def test_early_stopping_stops_the_run_and_still_saves_the_model(tiny_corpus, tmp_path):
    # lr so high the validation loss cannot keep improving: patience 1 stops at the first non-improvement.
    cfg = tiny_config(
        tiny_corpus,
        tmp_path / "out",
        train={
            "max_steps": 40,
            "eval_interval": 2,
            "lr": 1.0,
            "warmup_steps": 0,
            "peak_tflops": 1.0,
            "early_stopping_patience": 1,
            "grad_clip": 0.0,
        },
    )
    result = Trainer(validate_dict(cfg)).fit()
    stop = [r for r in read_metrics(result.output_dir) if r.get("early_stop")]
    assert len(stop) == 1 and result.steps == stop[0]["step"] < 40
    assert (result.model_dir / "model.safetensors").is_file()


def test_a_lora_run_resumes_from_its_checkpoint_exactly(tiny_corpus, tmp_path):
    lora = {"method": "lora", "lora": {"r": 2, "target_modules": ["all-linear"]}}
    first = tiny_config(
        tiny_corpus,
        tmp_path / "a",
        finetune=lora,
        checkpoint={"interval": 2},
        train={"max_steps": 4, "eval_interval": 0, "warmup_steps": 0, "peak_tflops": 1.0},
    )
    Trainer(validate_dict(first)).fit()
    second = tiny_config(
        tiny_corpus,
        tmp_path / "b",
        finetune=lora,
        checkpoint={"resume": str(tmp_path / "a" / "checkpoints" / "step_00000002")},
        train={"max_steps": 4, "eval_interval": 0, "warmup_steps": 0, "peak_tflops": 1.0},
    )
    Trainer(validate_dict(second)).fit()
    ref = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "a") if "loss" in r}
    got = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "b") if "loss" in r}
    assert sorted(got) == [3, 4] and all(got[s] == ref[s] for s in got)
    a = load_file(str(tmp_path / "a" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "b" / "adapter" / "adapter_model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
