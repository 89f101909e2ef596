"""`--engine ray` (issue #22): the local engine's documents, tokenizer and packed tokens, on a local Ray
with 2 CPUs shared by the whole module; duplicates across files are found; errors stay one-liners."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the Ray engine tests need `pip install 'fitlm[ray]'`")

from fitlm.data import DataError  # noqa: E402
from fitlm.data.prep import pack_corpus, train_tokenizer  # noqa: E402
from fitlm.data.prep.clean import clean_corpus  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import near_dup  # noqa: E402

sys.path.remove(str(REPO / "bench"))


@pytest.fixture(scope="module")
def local_ray():
    ray.init(
        num_cpus=2,
        object_store_memory=200 * 1024**2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[Path]:
    """Four .jsonl files and a .txt: Chinese and English originals, near copies and exact copies spread
    over different files than their originals."""
    root = tmp_path_factory.mktemp("corpus")
    items = near_dup.build("zh", 60, 3, seed=3) + near_dup.build("en", 40, 2, seed=3)
    random.Random(0).shuffle(items)
    texts = [it.text for it in items]
    texts += [texts[5], texts[17], texts[5]]  # exact copies, into files other than their originals'
    files = []
    for k in range(4):
        files.append(root / f"part-{k}.jsonl")
        files[-1].write_text(
            "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts[k::4]), encoding="utf-8"
        )
    files.append(root / "lines.txt")
    files[-1].write_text("\n".join(t.replace("\n", " ") for t in texts[:10]) + "\n", encoding="utf-8")
    return files


def _docs(out: Path) -> list[str]:
    return [json.loads(line)["text"] for f in sorted(out.glob("clean-*.jsonl")) for line in f.open(encoding="utf-8")]


@pytest.mark.process
def test_clean_on_ray_keeps_the_local_documents(local_ray, corpus, tmp_path):
    local = clean_corpus(corpus, tmp_path / "local", split="line", show_progress=False)
    on_ray = clean_corpus(corpus, tmp_path / "ray", split="line", show_progress=False, engine="ray")
    assert local["dropped"]["exact_duplicate"] >= 3 and local["dropped"]["near_duplicate"] >= 20
    assert _docs(tmp_path / "ray") == _docs(tmp_path / "local")
    assert {k: v for k, v in on_ray.items() if k != "engine"} == {k: v for k, v in local.items() if k != "engine"}
    assert on_ray["engine"] == "ray"


@pytest.mark.process
def test_tokenizer_and_pack_on_ray_match_local(local_ray, corpus, tmp_path):
    tok = train_tokenizer(corpus, 400, tmp_path / "tok-local")
    tok_ray = train_tokenizer(corpus, 400, tmp_path / "tok-ray", engine="ray")
    assert tok_ray.read_bytes() == tok.read_bytes()
    a = pack_corpus(corpus, tok, tmp_path / "a", split="line", shard_tokens=20_000, show_progress=False)
    b = pack_corpus(
        corpus, tok, tmp_path / "b", split="line", shard_tokens=20_000, show_progress=False, engine="ray", workers=2
    )
    assert a["num_tokens"] == b["num_tokens"] and a["num_docs"] == b["num_docs"] and len(a["shards"]) > 1
    assert [s["checksums"] for s in a["shards"]] == [s["checksums"] for s in b["shards"]]
    chat = REPO / "examples" / "data" / "chat" / "chatterbot_corpus.jsonl"
    c = pack_corpus([chat], tok, tmp_path / "c", data_format="chat", max_length=64, show_progress=False)
    d = pack_corpus([chat], tok, tmp_path / "d", data_format="chat", max_length=64, show_progress=False, engine="ray")
    assert c["chat"] == d["chat"] and [s["checksums"] for s in c["shards"]] == [s["checksums"] for s in d["shards"]]


@pytest.mark.process
def test_errors_in_ray_tasks_read_as_on_the_local_engine(local_ray, tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "a fine document " * 10}) + "\n", encoding="utf-8")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": broken\n', encoding="utf-8")
    with pytest.raises(DataError) as local:
        clean_corpus([good, bad], tmp_path / "o1", show_progress=False)
    with pytest.raises(DataError) as on_ray:
        clean_corpus([good, bad], tmp_path / "o2", show_progress=False, engine="ray")
    assert str(on_ray.value) == str(local.value) and "bad.jsonl:2" in str(on_ray.value)
    assert not (tmp_path / "o2").exists()
