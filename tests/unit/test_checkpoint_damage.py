"""Damaged checkpoints and full disks, in one process.

- A bit flip or a truncation in the newest checkpoint is caught by its CRC-32 (recorded at save), reported
  with the file's path, and the run resumes from the previous complete checkpoint, with the reference's losses.
- A checkpoint save that runs out of space half-way removes its partial files, keeps the previous checkpoint
  the latest, and stops naming the directory and the bytes needed (or goes on, with on_save_error: continue).
"""

from __future__ import annotations

import errno
import json
import shutil

import pytest
import torch.distributed.checkpoint.filesystem as dcp_fs

from fitlm.checkpoint.errors import CheckpointError
from fitlm.checkpoint.store import META_FILE, TMP_PREFIX, checkpoints_root, list_checkpoints
from fitlm.diskspace import DiskFullError
from tests.unit.test_checkpoint import ckpt_config, losses, train_in_process


@pytest.fixture(scope="module")
def finished(tiny_corpus, tmp_path_factory):
    """A finished 8-step run with checkpoints at 4, 6 and 8."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    train_in_process(ckpt_config(tiny_corpus, out))
    return out


def shard(ckpt):
    return sorted(ckpt.glob("__0_*.distcp"))[0]


def damage_and_resume(finished, tmp_path, tiny_corpus, capsys, damage, **checkpoint):
    """The finished run as if it had stopped after step 6's checkpoint; damage that checkpoint, run again."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    shutil.rmtree(run / "model")
    root = checkpoints_root(run)
    shutil.rmtree(root / "step_00000008")
    newest = root / "step_00000006"
    damage(shard(newest))
    capsys.readouterr()
    train_in_process(ckpt_config(tiny_corpus, run, checkpoint=checkpoint))
    return run, newest, capsys.readouterr().err


def flip_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.process
def test_bit_flip_is_reported_and_the_previous_checkpoint_is_used(finished, tmp_path, tiny_corpus, capsys):
    run, damaged, err = damage_and_resume(finished, tmp_path, tiny_corpus, capsys, flip_bit)
    assert str(shard(damaged)) in err and "CRC-32" in err
    assert "step_00000004 instead" in err and "resumed from" in err and "step_00000004" in err.split("resumed from")[1]
    # Steps 5..8 retrained from step 4: the same losses as the uninterrupted run, bit for bit.
    ref = {s: (loss, g) for s, loss, g in losses(finished)}
    ours = {s: (loss, g) for s, loss, g in losses(run)}
    assert all(ours[s] == ref[s] for s in range(5, 9))
    assert damaged.is_dir()  # left for the user to inspect, no longer the newest


def test_truncated_shard_is_reported_by_size(finished, tmp_path, tiny_corpus, capsys):
    def truncate(path):
        path.write_bytes(path.read_bytes()[:100])

    _, damaged, err = damage_and_resume(finished, tmp_path, tiny_corpus, capsys, truncate)
    assert str(shard(damaged)) in err and "truncated" in err and "step_00000004 instead" in err


def test_verify_off_does_not_read_the_files(finished, tmp_path, tiny_corpus, capsys):
    # With checkpoint.verify: false a bit flip goes unseen (sizes still match): the damaged one is loaded.
    _, damaged, err = damage_and_resume(finished, tmp_path, tiny_corpus, capsys, flip_bit, verify=False)
    assert "CRC-32" not in err and f"resumed from {damaged}" in err


def test_no_intact_checkpoint_is_an_error_naming_each(finished, tmp_path, tiny_corpus):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    shutil.rmtree(run / "model")
    for _, ckpt in list_checkpoints(checkpoints_root(run)):
        flip_bit(shard(ckpt))
    with pytest.raises(CheckpointError) as err:
        train_in_process(ckpt_config(tiny_corpus, run))
    assert all(str(shard(c)) in str(err.value) for _, c in list_checkpoints(checkpoints_root(run)))


def test_checksums_are_recorded_for_every_file(finished):
    ckpt = list_checkpoints(checkpoints_root(finished))[-1][1]
    meta = json.loads((ckpt / META_FILE).read_text())
    assert set(meta["checksums"]) == set(meta["files"]) == {p.name for p in ckpt.iterdir()} - {META_FILE}


@pytest.fixture
def disk_fills_at_step_6(monkeypatch):
    """The disk fills while step 6's checkpoint is written: some bytes reach the file, then ENOSPC."""
    write = dcp_fs._write_item
    calls = {"n": 0}

    def failing(transforms, stream, data, *args, **kwargs):
        if "step_00000006" in str(getattr(stream, "name", "")):
            calls["n"] += 1
            stream.write(b"partial bytes")
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(transforms, stream, data, *args, **kwargs)

    monkeypatch.setattr(dcp_fs, "_write_item", failing)
    return calls


def test_disk_full_during_a_save_stops_and_keeps_the_previous_checkpoint(tiny_corpus, tmp_path, disk_fills_at_step_6):
    run = tmp_path / "run"
    with pytest.raises(DiskFullError) as err:
        train_in_process(ckpt_config(tiny_corpus, run))
    msg = str(err.value)
    assert disk_fills_at_step_6["n"] >= 1
    assert str(checkpoints_root(run)) in msg and "MiB are needed" in msg and "MiB are free" in msg
    root = checkpoints_root(run)
    assert [s for s, _ in list_checkpoints(root)] == [2, 4]
    assert not [p for p in root.iterdir() if p.name.startswith(TMP_PREFIX)], "the partial save was not removed"
    assert not (run / "model").exists()


def test_disk_full_with_continue_goes_on_and_saves_later(tiny_corpus, tmp_path, disk_fills_at_step_6, capsys):
    run = tmp_path / "run"
    train_in_process(ckpt_config(tiny_corpus, run, checkpoint={"on_save_error": "continue"}))
    err = capsys.readouterr().err
    assert "checkpoint of step 6 not saved" in err and "on_save_error: continue" in err
    assert [s for s, _ in list_checkpoints(checkpoints_root(run))] == [2, 4, 8]
    assert (run / "model").is_dir()
