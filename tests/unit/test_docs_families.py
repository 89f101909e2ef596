"""The README's model families table is generated from the registry and must equal it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fitlm import docs, registry

ROOT = Path(__file__).resolve().parents[2]


def _families_block(readme: str) -> str:
    assert docs.FAMILIES_BEGIN in readme and docs.FAMILIES_END in readme, "README has no model families markers"
    return readme.split(docs.FAMILIES_BEGIN, 1)[1].split(docs.FAMILIES_END, 1)[0]


def test_readme_families_table_is_current():
    readme = (ROOT / "README.md").read_text()
    assert _families_block(readme) == "\n" + docs.families_table_markdown(), (
        "README model families table is stale: run `make docs`"
    )
    assert docs.render(readme) == readme, "README generated blocks are stale: run `make docs`"


def test_table_has_one_row_per_registered_family():
    table = docs.families_table_markdown()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [r.split("|")[1].strip() for r in rows] == [f"`{f.spec.name}`" for f in registry.families()]
    for family, row in zip(registry.families(), rows):
        for model_type in family.spec.hf_model_types:
            assert f"`{model_type}`" in row
        for linear in family.lora_linears:
            assert f"`{linear}`" in row
        assert family.hf_architecture in row
        if family.gguf is not None:
            assert f"`{family.gguf.arch}`" in row


def test_changing_a_family_changes_the_table():
    families = registry.families()
    llama = next(f for f in families if f.spec.name == "llama")
    spec = dataclasses.replace(llama.spec, features=("a feature no family has",), tensor_parallel=False)
    changed = [dataclasses.replace(f, spec=spec) if f is llama else f for f in families]
    readme = (ROOT / "README.md").read_text()
    before, after = docs.families_table_markdown(families), docs.families_table_markdown(changed)
    assert before != after and "a feature no family has" in after and "a feature no family has" not in before
    # The README check above would fail against the changed registry.
    assert docs.render(readme, changed) != readme


def test_changing_lora_linears_or_hf_types_changes_the_table():
    families = registry.families()
    gpt2 = next(f for f in families if f.spec.name == "gpt2")
    for changed_gpt2 in (
        dataclasses.replace(gpt2, lora_linears=("c_attn",)),
        dataclasses.replace(gpt2, spec=dataclasses.replace(gpt2.spec, hf_model_types=("gpt2", "gpt_bigcode"))),
        dataclasses.replace(gpt2, spec=dataclasses.replace(gpt2.spec, pipeline_parallel=False)),
    ):
        changed = [changed_gpt2 if f is gpt2 else f for f in families]
        assert docs.families_table_markdown(changed) != docs.families_table_markdown(families), changed_gpt2


def test_gguf_out_follows_export_module(monkeypatch):
    import fitlm.export.gguf as gguf_export

    families = {f.spec.name: f for f in registry.families()}
    # Today every family with llama.cpp names is written; GPT-2 has none.
    assert all(docs.gguf_exportable(f) == (f.gguf is not None) for f in families.values())
    assert not docs.gguf_exportable(families["gpt2"]) and docs.gguf_exportable(families["gemma3"])
    monkeypatch.setattr(gguf_export, "EXPORTABLE", lambda f: f.spec.name == "qwen2")  # the column reads the exporter
    assert docs.gguf_exportable(families["qwen2"]) and not docs.gguf_exportable(families["llama"])


def test_missing_markers_are_an_error():
    readme = (ROOT / "README.md").read_text()
    without = readme.replace(docs.FAMILIES_BEGIN, "")
    with pytest.raises(ValueError, match="no generated block"):
        docs.render(without)


def test_each_generated_block_is_in_exactly_one_doc_file():
    texts = {f: (ROOT / f).read_text() for f in docs.DOC_FILES}
    for what, begin, end, _ in docs.blocks():
        holders = [f for f, t in texts.items() if begin in t and end in t]
        assert len(holders) == 1, f"the {what} is in {holders or 'no file'} of {docs.DOC_FILES}"
        assert docs.render(texts[holders[0]]) == texts[holders[0]], f"{holders[0]} is stale: run `make docs`"
