"""Fixtures of the CLI tests: the demo's data, built with the same commands `make demo` runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import PLAYS
from tests.e2e.helpers import fitlm

TRAIN_PLAYS = ["hamlet", "macbeth", "tempest", "romeo_and_juliet"]


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("demo")
    steps = [
        ("data", "tokenizer", *sorted(PLAYS.glob("*.txt")), "--vocab-size", "2048", "--out", root / "tokenizer.json"),
        (
            "data",
            "pack",
            *[PLAYS / f"{p}_gut.txt" for p in TRAIN_PLAYS],
            "--tokenizer",
            root / "tokenizer.json",
            "--out",
            root / "data" / "train",
        ),
        (
            "data",
            "pack",
            PLAYS / "lear_gut.txt",
            "--tokenizer",
            root / "tokenizer.json",
            "--out",
            root / "data" / "valid",
        ),
    ]
    for args in steps:
        proc = fitlm(*args, "--json")
        assert proc.returncode == 0, proc.stderr
    return root
