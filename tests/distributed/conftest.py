"""Fixtures shared by the layout-equivalence modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def single_process_reference(tiny_corpus, tmp_path_factory):
    """`fitlm train` of the layout tests' config in one process, per data.document_mask, run at most once per
    session: what every layout's losses, gradient norms and weights are held against."""
    from tests.distributed.test_layouts import REFERENCE, run

    runs: dict[bool, dict] = {}

    def get(document_mask: bool = True) -> dict:
        if document_mask not in runs:
            root = tmp_path_factory.mktemp(f"ref-dm{int(document_mask)}")
            runs[document_mask] = run(tiny_corpus, root, "single", {}, REFERENCE, data={"document_mask": document_mask})
        return runs[document_mask]

    return get
