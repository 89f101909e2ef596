"""Shared fixtures: a real tokenizer and real packed data, built once per session from the shipped corpus."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# The CPU GEMM peak that MFU is measured against is cached per machine (fitlm.hardware): tests keep theirs
# apart from the user's, and every process they start inherits the same scratch cache.
os.environ.setdefault("FITLM_CACHE_DIR", tempfile.mkdtemp(prefix="fitlm-test-cache-"))

ROOT = Path(__file__).resolve().parents[1]
PLAYS = ROOT / "examples" / "data" / "shakespeare"


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow (make test, which CI runs)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> dict[str, Path]:
    """Tokenizer (vocab 512) trained on two plays; train = macbeth, valid = tempest."""
    from fitlm.data.prep.pack import pack_corpus
    from fitlm.data.prep.tokenizer_train import train_tokenizer

    root = tmp_path_factory.mktemp("corpus")
    tok = train_tokenizer([PLAYS / "macbeth_gut.txt", PLAYS / "tempest_gut.txt"], 512, root / "tokenizer.json")
    pack_corpus([PLAYS / "macbeth_gut.txt"], tok, root / "train", show_progress=False)
    pack_corpus([PLAYS / "tempest_gut.txt"], tok, root / "valid", show_progress=False)
    return {"tokenizer": tok, "train": root / "train", "valid": root / "valid", "root": root}


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request, monkeypatch):
    """A test under tests/unit without the `process` (or `slow`) marker starts no Python process (a CLI run,
    torchrun, Ray, a server, a lock holder): `make test-unit` is pure and fast. Starting one fails the test,
    naming the marker to add. Helpers that libraries run for themselves (ldconfig, uname, ...) are let through."""
    if "tests/unit/" not in str(request.node.fspath).replace("\\", "/") or {"process", "slow"} & set(
        request.node.keywords
    ):
        yield
        return
    import subprocess

    real = subprocess.Popen.__init__

    def refuse(self, args, *a, **kw):
        argv = [args] if isinstance(args, (str, os.PathLike)) else list(args)
        program = os.path.basename(str(argv[0]).split()[0]) if argv else ""
        if not program.startswith(("python", "torchrun", "ray", "fitlm")):
            return real(self, args, *a, **kw)
        raise AssertionError(
            f"{request.node.nodeid} starts a process ({args!r:.120}); mark it @pytest.mark.process "
            "(`make test-unit` leaves those out)"
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    yield
    monkeypatch.setattr(subprocess.Popen, "__init__", real)


def pytest_terminal_summary(terminalreporter):
    """After a run that included tests/e2e/test_docs_commands.py: the table of the docs' commands that ran and of
    those that did not, with why (also `python -m tests.e2e.docs_blocks`)."""
    reports = (r for reports in terminalreporter.stats.values() for r in reports if hasattr(r, "nodeid"))
    if any("test_docs_commands.py::test_docs_commands_run" in r.nodeid for r in reports):
        from tests.e2e.docs_blocks import all_blocks, table

        terminalreporter.write_sep("-", "docs commands")
        terminalreporter.write_line(table(all_blocks()))
