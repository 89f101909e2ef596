"""Progress where the output is a log file (`fitlm train > run.log 2>&1`, nohup, CI, a cluster's job log): the real
CLI with stdout and stderr in a file, read back from the file, for training while it still runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fitlm.config import ModelConfig
from fitlm.finetune.lora import LoraSpec
from fitlm.finetune.peft_format import save_adapter
from fitlm.models.hf import save_hf_dir
from fitlm.progress import PROGRESS_INTERVAL, PROGRESS_LINES
from fitlm.registry import build_model
from tests.conftest import PLAYS
from tests.e2e.helpers import tiny_config, write_config

STEPS = 100_000  # never reached: the test stops the run once it has seen what it needs
TRAIN_LINE = re.compile(
    rf"^train: step (\d+)/{STEPS}, loss \d+\.\d{{4}}(, eval \d+\.\d{{4}})?, [\d,]+ tok/s, "
    r"elapsed \d+:\d\d, ETA [\d:]+$"
)
EVAL_LINE = re.compile(rf"^train: step (\d+)/{STEPS}, eval loss \d+\.\d{{4}}, elapsed \d+:\d\d, ETA [\d:]+$")


def log_env(**extra: str) -> dict[str, str]:
    """The environment of a command whose output goes to a file: lines come because it is not a terminal, not
    because the variable the UI sets asks for them."""
    env = {k: v for k, v in os.environ.items() if k not in (PROGRESS_LINES, PROGRESS_INTERVAL)}
    return {**env, **extra}


def start(log: Path, *args: object, **env: str) -> subprocess.Popen:
    with open(log, "w") as f:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "fitlm.cli", *map(str, args)],
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=log_env(**env),
        )


def complete_lines(log: Path) -> list[str]:
    """The lines written so far up to the last newline (a line being written is not read half)."""
    text = log.read_text(errors="replace")
    return text[: text.rfind("\n") + 1].splitlines()


def test_training_into_a_log_file_shows_each_logged_step_while_it_runs(tiny_corpus, tmp_path):
    train = {"max_steps": STEPS, "log_interval": 2, "eval_interval": 4, "eval_steps": 1, "progress": True}
    train.update(micro_batch_size=2, gradient_accumulation_steps=1)  # the shortest steps: only the lines matter
    config = write_config(tmp_path / "c.yaml", tiny_config(tiny_corpus, tmp_path / "out", train=train))
    log = tmp_path / "train.log"
    proc = start(log, "train", config)
    try:
        deadline = time.monotonic() + 240  # start-up (torch, the model) on a busy 2-core machine, then 6 steps
        while True:
            lines = complete_lines(log)
            steps = [int(m[1]) for line in lines if (m := TRAIN_LINE.match(line))]
            evals = [int(m[1]) for line in lines if (m := EVAL_LINE.match(line))]
            if evals and steps and steps[-1] > evals[0]:
                break
            assert proc.poll() is None, "\n".join(lines[-20:])  # it ended without printing its progress
            assert time.monotonic() < deadline, "no progress line in the log:\n" + "\n".join(lines[-20:])
            time.sleep(0.2)
        assert proc.poll() is None  # seen in the file while the run is still going
        assert steps[:4] == [1, 2, 4, 6] and evals[0] == 4  # each log_interval, and the evaluation
        assert ", eval " in next(line for line in lines if line.startswith(f"train: step {evals[0] + 2}/"))
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    assert not any("nan" in line for line in complete_lines(log) if line.startswith("train: "))


@pytest.fixture(scope="module")
def hf_and_adapter(tiny_corpus, tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama as a Hugging Face directory (2 blocks: 5 weight groups with embedding, norm and head) and a
    LoRA adapter for it."""
    root = tmp_path_factory.mktemp("progress")
    torch.manual_seed(0)
    cfg = ModelConfig(
        arch="llama",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=512,
        max_seq_len=64,
    )
    save_hf_dir(build_model(cfg), cfg, root / "hf")
    (root / "hf" / "tokenizer.json").write_bytes(Path(tiny_corpus["tokenizer"]).read_bytes())
    m = "model.layers.0.self_attn.q_proj"
    tensors = {f"{m}.lora_A.weight": torch.randn(4, 64), f"{m}.lora_B.weight": torch.randn(64, 4)}
    save_adapter(tensors, LoraSpec(r=4, alpha=8.0, dropout=0.0, modules=(m,)), root / "adapter")
    return {"root": root, "hf": root / "hf", "adapter": root / "adapter"}


def block_counts(log: Path) -> list[str]:
    return [m[1] for line in complete_lines(log) if (m := re.match(r"^weights \(blocks\): (\d+/\d+), elapsed ", line))]


def test_import_export_and_merge_count_their_blocks_in_the_log(hf_and_adapter):
    """FITLM_PROGRESS_INTERVAL=0: a line per block (the default paces them a few seconds apart), so the count is
    the same on any machine."""
    root, every_block = hf_and_adapter["root"], [f"{k}/5" for k in range(1, 6)]
    runs = {
        "import": ("import", hf_and_adapter["hf"], "--out", root / "base"),
        "export": ("export", root / "base", "--format", "hf", "--out", root / "exported"),
        "merge": ("merge", root / "base", "--adapter", hf_and_adapter["adapter"], "--out", root / "merged"),
    }
    for name, args in runs.items():
        log = root / f"{name}.log"
        assert start(log, *args, **{PROGRESS_INTERVAL: "0"}).wait(timeout=300) == 0, log.read_text()
        assert block_counts(log) == every_block, (name, log.read_text())


def test_data_pack_reports_bytes_read_in_the_log(tiny_corpus, tmp_path):
    log = tmp_path / "pack.log"
    args = ("data", "pack", PLAYS / "macbeth_gut.txt", "--tokenizer", tiny_corpus["tokenizer"], "--out", tmp_path / "p")
    assert start(log, *args, **{PROGRESS_INTERVAL: "0"}).wait(timeout=300) == 0, log.read_text()
    counts = [m.groups() for line in complete_lines(log) if (m := re.match(r"^packing: ([\d.]+)/([\d.]+) kB, ", line))]
    assert len(counts) > 1 and counts[-1][0] == counts[-1][1]  # the read grows line by line to the whole input
