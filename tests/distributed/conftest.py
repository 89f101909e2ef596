"""Fixtures shared by the layout-equivalence modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def single_process_reference(tiny_corpus, tmp_path_factory):
    """`fitlm train` of the layout tests' config in one process, per data.document_mask and
    model.tie_embeddings, run at most once per session: what every layout's losses, gradient norms and
    weights are held against."""
    from tests.distributed.test_layouts import REFERENCE, run

    runs: dict[tuple[bool, bool], dict] = {}

    def get(document_mask: bool = True, tied: bool = False) -> dict:
        key = (document_mask, tied)
        if key not in runs:
            root = tmp_path_factory.mktemp(f"ref-dm{int(document_mask)}-tied{int(tied)}")
            runs[key] = run(
                tiny_corpus,
                root,
                "single",
                {},
                REFERENCE,
                data={"document_mask": document_mask},
                model={"tie_embeddings": tied},
            )
        return runs[key]

    return get
