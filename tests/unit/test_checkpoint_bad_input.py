"""Checkpoints that cannot be used are refused with a message naming the file or key and the fix,
through the real CLI entry point (exit status 2), and nothing of the run is lost."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from fitlm.checkpoint.store import META_FILE
from fitlm.cli import main
from tests.e2e.helpers import write_config
from tests.unit.test_checkpoint import ckpt_config, train_in_process


@pytest.fixture(scope="module")
def run(tiny_corpus, tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("bad") / "run"
    train_in_process(ckpt_config(tiny_corpus, out, train={"max_steps": 4}))
    return out


def cli(capsys, *args) -> tuple[int, str]:
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def copy_ckpt(run: Path, tmp_path: Path, step: int = 4) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(run / "checkpoints" / f"step_{step:08d}", dst)
    return dst


def resume_from(capsys, tiny_corpus, tmp_path, ckpt: Path, **sections) -> tuple[int, str]:
    cfg = ckpt_config(tiny_corpus, tmp_path / "new", checkpoint={"resume": str(ckpt)}, **sections)
    return cli(capsys, "train", write_config(tmp_path / "c.yaml", cfg))


@pytest.mark.process
def test_checkpoint_of_another_model_shape(capsys, tiny_corpus, tmp_path, run):
    code, err = resume_from(
        capsys, tiny_corpus, tmp_path, run / "checkpoints" / "step_00000004", model={"intermediate_size": 192}
    )
    assert code == 2
    assert "belongs to a different run" in err and "model.intermediate_size: 176 -> 192" in err
    assert "Resume with the config it was saved with" in err


def test_tensor_shapes_are_checked_even_when_the_config_agrees(run):
    """A second line of defence: names and shapes in the index against the model built now."""
    import torch

    from fitlm.checkpoint.errors import CheckpointError
    from fitlm.checkpoint.state import check_model_keys
    from fitlm.checkpoint.store import read_dcp_metadata

    md = read_dcp_metadata(run / "checkpoints" / "step_00000004")
    with pytest.raises(CheckpointError, match=r"model.norm.weight: checkpoint \[64\] vs model \[32\]"):
        check_model_keys({"model.norm.weight": torch.zeros(32)}, md, "ckpt")
    with pytest.raises(CheckpointError, match="missing tensors model.layers.9.mlp.up_proj.weight"):
        check_model_keys({"model.layers.9.mlp.up_proj.weight": torch.zeros(1)}, md, "ckpt")


def test_checkpoint_of_another_tokenizer(capsys, tiny_corpus, tmp_path, run):
    ckpt = copy_ckpt(run, tmp_path)
    meta = json.loads((ckpt / META_FILE).read_text())
    meta["tokenizer_sha256"] = "0" * 64  # what a run with another tokenizer.json would have recorded
    (ckpt / META_FILE).write_text(json.dumps(meta))
    code, err = resume_from(capsys, tiny_corpus, tmp_path, ckpt)
    assert code == 2 and "trained with another tokenizer" in err and "data.tokenizer" in err


def test_truncated_shard(capsys, tiny_corpus, tmp_path, run):
    ckpt = copy_ckpt(run, tmp_path)
    shard = ckpt / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    code, err = resume_from(capsys, tiny_corpus, tmp_path, ckpt)
    assert code == 2 and f"checkpoint file {shard} has 1000 bytes" in err and "truncated" in err
    code, err = cli(capsys, "ckpt", "inspect", ckpt)
    assert code == 2 and "truncated" in err
    code, err = cli(capsys, "ckpt", "merge", ckpt, "--out", tmp_path / "m.safetensors")
    assert code == 2 and "truncated" in err and not (tmp_path / "m.safetensors").exists()


def test_missing_metadata(capsys, tiny_corpus, tmp_path, run):
    ckpt = copy_ckpt(run, tmp_path)
    (ckpt / META_FILE).unlink()
    code, err = resume_from(capsys, tiny_corpus, tmp_path, ckpt)
    assert code == 2 and f"has no {META_FILE}" in err and "Delete it to resume from the previous checkpoint" in err
    code, err = cli(capsys, "ckpt", "inspect", ckpt)
    assert code == 2 and META_FILE in err


def test_index_that_would_run_code_is_refused(capsys, tmp_path, run):
    class Evil:
        def __reduce__(self):
            return (print, ("owned",))

    ckpt = copy_ckpt(run, tmp_path)
    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil()))
    meta = json.loads((ckpt / META_FILE).read_text())
    meta["files"][".metadata"] = (ckpt / ".metadata").stat().st_size  # a crafted checkpoint is self-consistent
    (ckpt / META_FILE).write_text(json.dumps(meta))
    code, err = cli(capsys, "ckpt", "inspect", ckpt)
    assert code == 2 and "builtins.print is not allowed" in err


def test_output_dir_whose_config_differs_in_a_key_that_matters(capsys, tiny_corpus, tmp_path, run):
    work = tmp_path / "run"
    shutil.copytree(run, work)
    shutil.rmtree(work / "model")  # an unfinished run
    before = sorted(p.name for p in (work / "checkpoints").iterdir())
    cfg = ckpt_config(tiny_corpus, work, train={"max_steps": 4, "seed": 8, "micro_batch_size": 2})
    code, err = cli(capsys, "train", write_config(tmp_path / "c.yaml", cfg))
    assert code == 2 and "cannot continue" in err
    assert "train.seed: 7 -> 8" in err and "global batch" in err and "8 -> 4" in err
    assert "train.micro_batch_size" in err
    assert sorted(p.name for p in (work / "checkpoints").iterdir()) == before  # nothing lost


def test_output_dir_whose_config_differs_only_in_harmless_keys_resumes(capsys, tiny_corpus, tmp_path, run):
    work = tmp_path / "run"
    shutil.copytree(run, work)
    # same global batch of 8 split differently, another lr, more steps, recompute: all the same run
    cfg = ckpt_config(
        tiny_corpus,
        work,
        train={"max_steps": 6, "lr": 5e-3, "log_interval": 2, "micro_batch_size": 2, "gradient_accumulation_steps": 4},
        memory={"recompute": "full"},
        checkpoint={"save_on_signal": False},  # what a stop does is no part of the run
    )
    code, err = cli(capsys, "train", write_config(tmp_path / "c.yaml", cfg))
    assert code == 0, err
    assert "resumed from" in err and "step_00000004" in err


def test_finished_run_with_the_same_config_is_still_refused(capsys, tiny_corpus, tmp_path, run):
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    code, err = cli(
        capsys, "train", write_config(tmp_path / "c.yaml", ckpt_config(tiny_corpus, run, train={"max_steps": 4}))
    )
    assert code == 2 and "already holds a run of this config" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_resume_path_that_does_not_exist(capsys, tiny_corpus, tmp_path):
    code, err = resume_from(capsys, tiny_corpus, tmp_path, tmp_path / "nowhere")
    assert code == 2 and "checkpoint.resume" in err and "nowhere" in err
    assert not (tmp_path / "new").exists()


def test_merge_refuses_to_overwrite_a_directory(capsys, tmp_path, run):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    code, err = cli(capsys, "ckpt", "merge", run, "--out", tmp_path / "taken", "--format", "hf")
    assert code == 2 and "not an empty directory" in err
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("fmt,name", [("safetensors", "w.safetensors"), ("hf", "hf")])
def test_interrupted_merge_leaves_nothing_behind(monkeypatch, tmp_path, run, fmt, name):
    from fitlm.checkpoint import merge
    from fitlm.models.safetensors_io import StreamingSafetensorsWriter

    def fail_half_way(self, tensors):
        next(iter(tensors))  # some bytes are written, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(StreamingSafetensorsWriter, "write_all", fail_half_way)
    with pytest.raises(KeyboardInterrupt):
        merge.merge_checkpoint(run, tmp_path / "out" / name, fmt)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
