"""A full disk (ENOSPC) half-way through `fitlm data pack`, `fitlm export` (hf, gguf, onnx), the final model
save of `fitlm train`, `fitlm merge` and an adapter save: exit status 2 with a message naming the output and
the MiB needed, no partial files left beside it, and a previous output at the same path intact byte for byte.

The disk fills inside the lowest-level write each path uses (a file that takes some bytes, then raises
OSError(ENOSPC)); one test uses a real, small tmpfs where this machine allows mounting one.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import torch

from fitlm.cli import main
from fitlm.config import ModelConfig
from fitlm.diskspace import DiskFullError, disk_full_guard
from fitlm.models.io import save_model_dir
from fitlm.registry import build_model
from tests.e2e.helpers import tiny_config, write_config

PLAYS = Path(__file__).resolve().parents[2] / "examples" / "data" / "shakespeare"
CFG = ModelConfig(
    arch="llama",
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=160,
    vocab_size=512,
    max_seq_len=64,
)


def enospc() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class FillingFile:
    """A binary file on a disk with `budget` bytes free (shared by every file of the disk): a write takes
    what fits, then raises ENOSPC, as write(2) does on a full filesystem."""

    def __init__(self, f, disk: dict):
        self._f, self._disk = f, disk

    def write(self, data) -> int:
        data = bytes(data)
        room = max(self._disk["free"], 0)
        self._f.write(data[:room])
        self._f.flush()
        self._disk["free"] -= min(len(data), room)
        if len(data) > room:
            raise enospc()
        return len(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def filling_open(free: int):
    """A stand-in for builtins.open whose binary write handles sit on a disk with `free` bytes left."""
    disk = {"free": free}

    def _open(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        return FillingFile(f, disk) if "w" in mode and "b" in mode else f

    return _open


def half_then_enospc(serialize):
    """A save function that writes the first half of what `serialize(obj)` gives to `path`, then fills up."""

    def save(obj, path, *args, **kwargs):
        data = serialize(obj, *args, **kwargs)
        Path(path).write_bytes(data[: max(len(data) // 2, 1)])
        raise enospc()

    return save


def fill_streaming_writer(monkeypatch) -> None:
    """Model weights are written tensor by tensor (fitlm.models.safetensors_io): the disk fills half-way
    through the first tensor."""
    from fitlm.models.safetensors_io import StreamingSafetensorsWriter

    def write(self, name, tensor):
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._f.write(memoryview(data)[: max(data.nbytes // 2, 1)])
        raise enospc()

    monkeypatch.setattr(StreamingSafetensorsWriter, "write", write)


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under `path` (or `path` itself), by relative name, with its bytes."""
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def leftovers(parent: Path) -> list[str]:
    """Temporary or partial names fitlm.atomic would leave beside an output if it did not clean up."""
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def assert_disk_full(code: int, err: str, out: Path) -> None:
    assert code == 2, err
    assert "error:" in err and str(out) in err and "MiB" in err and "full" in err, err
    assert "Traceback" not in err


# --------------------------------------------------------------------------- the guard itself


def test_guard_names_directory_bytes_and_lets_other_errors_pass(tmp_path):
    with pytest.raises(
        DiskFullError,
        match=r"fitlm x: the disk holding .*out is full \(about 3\.0 MiB are needed, "
        r"[\d,.]+ MiB are free\)",
    ) as info:
        with disk_full_guard(tmp_path / "out", 3 * 2**20, "fitlm x"):
            raise enospc()
    assert isinstance(info.value, ValueError) and info.value.needed == 3 * 2**20
    with pytest.raises(DiskFullError, match="about 1.0 MiB"):  # a lazy estimate, asked only on failure
        with disk_full_guard(tmp_path, lambda: 2**20, "fitlm x"):
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
    with pytest.raises(PermissionError):
        with disk_full_guard(tmp_path, 1, "fitlm x"):
            raise PermissionError(errno.EACCES, "Permission denied")


# --------------------------------------------------------------------------- fitlm data pack


def test_pack_disk_full_keeps_previous_pack_and_removes_partial_files(tiny_corpus, tmp_path, monkeypatch, capsys):
    play = tmp_path / "play.txt"
    play.write_text((PLAYS / "macbeth_gut.txt").read_text(encoding="utf-8"), encoding="utf-8")
    out = tmp_path / "packed"
    args = ["data", "pack", str(play), "--tokenizer", str(tiny_corpus["tokenizer"]), "--out", str(out)]
    assert main(args) == 0
    before = snapshot(out)
    capsys.readouterr()

    monkeypatch.setattr("fitlm.data.prep.pack.open", filling_open(free=20_000), raising=False)
    code = main([*args, "--overwrite"])
    err = capsys.readouterr().err
    assert_disk_full(code, err, out)
    assert "fitlm data pack" in err
    needed = float(err.split("about ")[1].split(" MiB")[0])
    assert 0.05 < needed < 1.0  # extrapolated from the part written: macbeth packs to about 0.1 MiB
    assert leftovers(tmp_path) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["packed", "play.txt"]
    assert snapshot(out) == before

    fresh = tmp_path / "fresh"  # no previous output: nothing at all is left
    assert main([*args[:-1], str(fresh)]) == 2
    assert not fresh.exists() and leftovers(tmp_path) == []


# --------------------------------------------------------------------------- fitlm export


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_corpus) -> Path:
    torch.manual_seed(0)
    model = build_model(CFG)
    model.init_weights()
    return save_model_dir(
        model.eval(), CFG, tmp_path_factory.mktemp("disk_full") / "model", tokenizer_path=tiny_corpus["tokenizer"]
    )


def test_export_hf_disk_full_keeps_previous_export(model_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "hf"
    args = ["export", str(model_dir), "--format", "hf", "--out", str(out)]
    assert main(args) == 0
    (out / "README.md").write_text("a previous export")
    before = snapshot(out)
    capsys.readouterr()

    fill_streaming_writer(monkeypatch)
    code = main(args)
    err = capsys.readouterr().err
    assert_disk_full(code, err, out)
    assert "fitlm export --format hf" in err
    assert leftovers(tmp_path) == [] and [p.name for p in tmp_path.iterdir()] == ["hf"]
    assert snapshot(out) == before

    fresh = tmp_path / "deeper" / "hf"  # a new path: neither the directory nor its new parents are left
    assert main([*args[:-1], str(fresh)]) == 2
    assert not (tmp_path / "deeper").exists()


def test_export_gguf_disk_full_while_spilling_tensors(model_dir, tmp_path, monkeypatch, capsys):
    """The streamed GGUF export spills encoded tensors to a temporary file beside the output before GGUF's table
    is written: a full disk there is reported as one (exit 2), with nothing left behind."""
    import tempfile

    import fitlm.export.gguf as gguf_export

    out = tmp_path / "model.gguf"
    real = tempfile.TemporaryFile

    class Full:  # the spill file on a disk that fills up after some bytes
        def __init__(self, **kw):
            self.f, self.room = real(**kw), 3000

        def write(self, b):
            self.room -= len(b)
            if self.room < 0:
                raise enospc()
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(gguf_export.tempfile, "TemporaryFile", lambda **kw: Full(**kw))
    code = main(["export", str(model_dir), "--format", "gguf", "--dtype", "f32", "--out", str(out)])
    err = capsys.readouterr().err
    assert_disk_full(code, err, out)
    assert "fitlm export --format gguf" in err
    assert leftovers(tmp_path) == [] and not out.exists()


def test_export_gguf_disk_full_keeps_previous_file(model_dir, tmp_path, monkeypatch, capsys):
    from gguf import GGUFWriter

    out = tmp_path / "model.gguf"
    args = ["export", str(model_dir), "--format", "gguf", "--dtype", "f32", "--out", str(out)]
    assert main(args) == 0
    before = snapshot(out)
    capsys.readouterr()

    def fill_up(self, *, progress=False):  # the header and metadata are on disk; half a tensor more fits
        for fout in self.fout:
            fout.write(b"\0" * 5000)
            fout.flush()
        raise enospc()

    monkeypatch.setattr(GGUFWriter, "write_tensors_to_file", fill_up)
    code = main(args)
    err = capsys.readouterr().err
    assert_disk_full(code, err, out)
    assert "fitlm export --format gguf" in err
    needed = float(err.split("about ")[1].split(" MiB")[0])
    assert needed >= len(before[out.name]) / 2**20 * 0.9  # an f32 file of about the size the first export wrote
    # the Ollama Modelfile beside it is the first (successful) export's
    assert leftovers(tmp_path) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["model.Modelfile", "model.gguf"]
    assert snapshot(out) == before


def test_export_onnx_disk_full_keeps_previous_file(model_dir, tmp_path, monkeypatch, capsys):
    onnx = pytest.importorskip("onnx", reason="ONNX export needs the optional onnx package")

    out = tmp_path / "model.onnx"
    args = ["export", str(model_dir), "--format", "onnx", "--seq-len", "8", "--out", str(out)]
    assert main(args) == 0
    before = snapshot(out)
    capsys.readouterr()

    monkeypatch.setattr(onnx, "save", half_then_enospc(lambda proto: proto.SerializeToString()))
    code = main(args)
    err = capsys.readouterr().err
    assert_disk_full(code, err, out)
    assert "fitlm export --format onnx" in err
    assert leftovers(tmp_path) == [] and [p.name for p in tmp_path.iterdir()] == ["model.onnx"]
    assert snapshot(out) == before


# --------------------------------------------------------------------------- fitlm merge and adapters


def _adapter():
    from fitlm.finetune.lora import LoraSpec

    m = "model.layers.0.self_attn.q_proj"
    g = torch.Generator().manual_seed(1)
    tensors = {
        f"{m}.lora_A.weight": torch.randn(4, 64, generator=g),
        f"{m}.lora_B.weight": torch.randn(64, 4, generator=g),
    }
    return tensors, LoraSpec(r=4, alpha=8.0, dropout=0.0, modules=(m,))


def test_merge_and_adapter_save_disk_full_keep_previous_results(model_dir, tmp_path, monkeypatch, capsys):
    from safetensors.torch import save

    from fitlm.finetune.peft_format import save_adapter

    tensors, spec = _adapter()
    adapter = save_adapter(tensors, spec, tmp_path / "adapter")
    out = tmp_path / "merged"
    args = ["merge", str(model_dir), "--adapter", str(adapter), "--out", str(out)]
    assert main(args) == 0
    merged_before, adapter_before = snapshot(out), snapshot(adapter)
    capsys.readouterr()

    fill = half_then_enospc(lambda sd, metadata=None: save(sd, metadata))
    fill_streaming_writer(monkeypatch)
    code = main(args)
    err = capsys.readouterr().err
    assert_disk_full(code, err, out)
    assert "fitlm merge" in err

    monkeypatch.setattr("fitlm.finetune.peft_format.save_file", fill)
    with pytest.raises(DiskFullError, match=f"adapter save: the disk holding {adapter} is full.*MiB"):
        save_adapter(tensors, spec, adapter)
    assert leftovers(tmp_path) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "merged"]
    assert snapshot(out) == merged_before and snapshot(adapter) == adapter_before


# --------------------------------------------------------------------------- the final model save of fitlm train


def test_final_model_save_disk_full_keeps_previous_model(tiny_corpus, tmp_path, monkeypatch, capsys):
    run, model = tmp_path / "run", tmp_path / "run" / "model"
    small = {"max_steps": 2, "eval_interval": 0, "gradient_accumulation_steps": 1, "micro_batch_size": 2}
    config = write_config(tmp_path / "run.yaml", tiny_config(tiny_corpus, run, train=small, checkpoint={"interval": 1}))

    # The disk fills while the trained model is written: no model/ and no partial directory are left.
    fill_streaming_writer(monkeypatch)
    code = main(["train", str(config)])
    err = capsys.readouterr().err
    assert_disk_full(code, err, model)
    assert "final model save" in err
    assert not model.exists() and leftovers(run) == []
    assert (run / "checkpoints").is_dir()  # what the run saved before the final model stays

    monkeypatch.undo()  # space freed: the same command again resumes at the last step and writes the model
    assert main(["train", str(config)]) == 0
    assert (model / "fitlm.json").is_file()
    before, names = snapshot(model), sorted(os.listdir(run))
    capsys.readouterr()

    # The run extended by a step (checkpoint.resume: auto) finds the disk full: the previous model/ stays.
    longer = write_config(
        tmp_path / "longer.yaml",
        tiny_config(tiny_corpus, run, train={**small, "max_steps": 3}, checkpoint={"interval": 1}),
    )
    fill_streaming_writer(monkeypatch)
    code = main(["train", str(longer)])
    err = capsys.readouterr().err
    assert_disk_full(code, err, model)
    assert leftovers(run) == [] and sorted(os.listdir(run)) == names
    assert snapshot(model) == before


# --------------------------------------------------------------------------- a real full filesystem


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 192 KiB tmpfs, where this machine lets the test mount one (root, mount(8), no sandbox refusal)."""
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a real tmpfs needs root and mount(8); the injected ENOSPC tests cover the same paths")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(
            f"mounting a tmpfs is not allowed here ({r.stderr.strip() or r.returncode}); the injected "
            f"ENOSPC tests cover the same paths"
        )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.process
def test_pack_on_a_full_tmpfs(tiny_corpus, tmp_path, small_tmpfs, capsys):
    small, big = tmp_path / "small.txt", tmp_path / "big.txt"
    text = (PLAYS / "macbeth_gut.txt").read_text(encoding="utf-8")
    small.write_text(text[:20_000], encoding="utf-8")
    big.write_text(text + (PLAYS / "hamlet_gut.txt").read_text(encoding="utf-8"), encoding="utf-8")
    out = small_tmpfs / "packed"
    args = ["--tokenizer", str(tiny_corpus["tokenizer"]), "--out", str(out)]
    assert main(["data", "pack", str(small), *args]) == 0
    before = snapshot(out)
    capsys.readouterr()

    code = main(["data", "pack", str(big), *args, "--overwrite"])
    err = capsys.readouterr().err
    assert_disk_full(code, err, out)
    assert "No space left on device" in err
    assert leftovers(small_tmpfs) == [] and [p.name for p in small_tmpfs.iterdir()] == ["packed"]
    assert snapshot(out) == before
