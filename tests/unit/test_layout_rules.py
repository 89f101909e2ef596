"""Layout validation happens before any process group exists, and says what to change."""

from __future__ import annotations

import pytest

from fitlm.config import ConfigError, validate_dict
from fitlm.parallel.layout import layout_problems, valid_layouts

MODEL = {
    "hidden_size": 96,
    "num_layers": 2,
    "num_heads": 6,
    "num_kv_heads": 3,
    "intermediate_size": 192,
    "vocab_size": 512,
    "max_seq_len": 64,
}


def problems(parallel: dict, world: int, train: dict | None = None, model: dict | None = None) -> list[str]:
    cfg = validate_dict(
        {
            "model": {**MODEL, **(model or {})},
            "data": {"seq_length": 64},
            "parallel": parallel,
            "train": {"micro_batch_size": 4, **(train or {})},
        }
    )
    return layout_problems(cfg, world)


def test_world_size_mismatch_shows_the_arithmetic_and_valid_layouts():
    (msg,) = problems({"data_parallel": 4}, 6)
    assert "4 × 1 × 1 = 4, but 6 processes run" in msg
    # tp2/tp6 do not divide 3 kv heads, tp3 not the 512 vocabulary; 2 layers allow at most pp2
    assert msg.endswith("valid layouts for 6: dp6×tp1×pp1, dp3×tp1×pp2")


def test_tensor_parallel_must_divide_kv_heads():
    (msg,) = problems({"tensor_parallel": 2}, 2)
    assert "tensor_parallel: 2 does not divide model.num_kv_heads=3 (3 % 2 = 1)" in msg
    assert msg.endswith("divide every sharded size of this model: [1]")  # tp3 fails on the 512 vocabulary


def test_pipeline_longer_than_the_model_and_too_few_micro_batches():
    out = problems({"pipeline_parallel": 4, "micro_batch_num": 2}, 4)
    assert any("parallel.pipeline_parallel: 4 stages but model.num_layers=2" in m for m in out)
    assert any("micro_batch_num" in m for m in out)


def test_micro_batch_must_split_into_pipeline_chunks():
    out = problems({"pipeline_parallel": 2, "micro_batch_num": 3}, 2)
    assert any("train.micro_batch_size: 4 sequences cannot be split" in m for m in out)


def test_zero_stage_outside_0_to_3_is_a_config_error():
    with pytest.raises(ConfigError, match="parallel.zero_stage: must be between 0 and 3"):
        validate_dict({"parallel": {"zero_stage": 4}})


def test_valid_layouts_only_lists_layouts_that_pass():
    cfg = validate_dict({"model": MODEL, "data": {"seq_length": 64}, "train": {"micro_batch_size": 4}})
    for layout in valid_layouts(cfg, 4):
        assert layout.dp * layout.tp * layout.pp == 4 and layout.tp == 1 and layout.pp <= 2
    assert [str(x) for x in valid_layouts(cfg, 4)] == ["dp4×tp1×pp1", "dp2×tp1×pp2"]


def test_explicit_pipeline_layers_must_cover_the_model():
    out = problems({"pipeline_parallel": 2, "micro_batch_num": 2, "pipeline_layers": [2, 1]}, 2)
    assert any(m.startswith("parallel.pipeline_layers: ") and "[2, 1]" in m for m in out)
    assert problems({"pipeline_parallel": 2, "micro_batch_num": 2, "pipeline_layers": [1, 1]}, 2) == []
