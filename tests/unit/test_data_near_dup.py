"""Near-duplicate recall and precision (issue #22): per-line, per-script shingles, recall-first LSH, the
"copy of an earlier document" rule; one-document-per-line and gzip inputs; --engine errors without Ray."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fitlm.data import DataError
from fitlm.data.prep import iter_documents, pack_corpus, train_tokenizer
from fitlm.data.prep.clean import CleanOptions, clean_corpus
from fitlm.data.prep.dedup import MIN_BUCKET_RECALL, MinHashLSH, bucket_probability, jaccard, lsh_params
from fitlm.data.prep.shingles import is_unspaced, ngram_for, shingle_hashes

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import near_dup  # noqa: E402  (bench/near_dup.py: the labelled benchmark, small here)

sys.path.remove(str(REPO / "bench"))


@pytest.mark.parametrize("script", ["en", "zh", "ja"])
def test_copies_with_3_percent_edits_found_and_distinct_documents_kept(script):
    items = near_dup.build(script, 120, 12, seed=1)
    lsh = MinHashLSH()  # the defaults of `fitlm data clean`
    kept = [not lsh.seen(it.text) for it in items]
    scores = near_dup.score(items, kept)
    assert scores["original"]["rate"] >= 0.99, scores["original"]
    for variant in near_dup.VARIANTS[:-1]:  # every edit kind at 1-3%, reordered lines, boilerplate
        assert scores[variant]["rate"] >= 0.95, (variant, scores[variant])


def test_shingles_follow_the_script_and_ignore_line_order():
    zh = "今天天气很好，我们去公园散步。\n公园里有很多人在跑步。"
    assert is_unspaced(zh) and ngram_for(zh) == 3
    assert is_unspaced("東京は日本の首都です。ここには多くの人が住んでいる。")
    assert not is_unspaced("The quick brown fox jumps over the lazy dog.") and ngram_for("The fox") == 5
    assert not is_unspaced("Съешь же ещё этих мягких французских булок")
    swapped = "\n".join(reversed(zh.split("\n")))
    assert np.array_equal(shingle_hashes(zh), shingle_hashes(swapped))  # no shingle crosses a line
    assert jaccard(zh, zh + "\n版权所有") > 0.9  # an added line only adds shingles
    assert shingle_hashes("ab\ncd", 5).size == 2  # lines shorter than n are one shingle each


def test_banding_is_recall_first():
    for t in (0.5, 0.6, 0.7, 0.8):
        bands, rows = lsh_params(t, 256)
        assert bands * rows <= 256
        assert bucket_probability(t, bands, rows) >= MIN_BUCKET_RECALL
        if t >= 0.6:  # distinct documents (Jaccard <= 0.15 in the benchmark) rarely become candidates
            assert bucket_probability(0.15, bands, rows) < 0.05


def test_copy_of_a_dropped_copy_is_dropped_and_order_decides():
    base = (
        "第一行文字内容在这里出现，大家好。\n" * 1
        + "第二行的内容也很重要，请注意阅读。\n第三行结束了这篇文章的全部内容。"
    )
    step = base.replace("大家好", "大家早")
    two = step.replace("请注意", "请留意")
    lsh = MinHashLSH()
    assert [lsh.seen(t) for t in (base, step, two)] == [False, True, True]
    assert len(lsh) == 3  # every signature is kept: the rule compares with all earlier documents


def test_clean_defaults_drop_edited_chinese_copies(tmp_path):
    items = near_dup.build("zh", 40, 4, seed=2)
    src = tmp_path / "zh.jsonl"
    src.write_text("".join(json.dumps({"text": it.text}, ensure_ascii=False) + "\n" for it in items), encoding="utf-8")
    report = clean_corpus([src], tmp_path / "out", CleanOptions(min_chars=10), show_progress=False)
    originals = sum(it.kind == "original" for it in items)
    assert report["documents_out"] >= originals - 1
    assert report["dropped"]["near_duplicate"] >= 0.95 * (len(items) - originals)
    assert report["engine"] == "local" and report["options"]["ngram"] is None
    # Chinese is shingled in 3-grams: 3% substituted characters keep Jaccard >= 0.78 (5-grams: ~0.73).
    edited = [(items[it.original].text, it.text) for it in items if it.kind == "substitute 3%"]
    assert edited and all(jaccard(a, b) >= 0.78 for a, b in edited)


def test_line_split_and_gzip_inputs(tmp_path):
    lines = [f"第{i}条评论：这个产品质量很好，物流也很快，下次还会再来购买。" for i in range(30)]
    txt = tmp_path / "reviews.txt"
    txt.write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    docs = [d.text for d in iter_documents([txt], split="line") if d.text]
    assert docs == lines
    assert len([d for d in iter_documents([txt]) if d.text]) == 1  # blank-line blocks: one document
    gz = tmp_path / "docs.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in lines)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "more.txt.gz").write_bytes(gzip.compress("\n".join(lines).encode()))
    assert [d.text for d in iter_documents([gz]) if d.text] == lines
    tok = train_tokenizer([txt], 300, tmp_path / "tok")
    a = pack_corpus([txt], tok, tmp_path / "a", split="line", show_progress=False)
    b = pack_corpus([gz], tok, tmp_path / "b", show_progress=False)
    assert a["num_docs"] == b["num_docs"] == 30 and a["num_tokens"] == b["num_tokens"]
    from fitlm.data.prep.sources import expand_inputs

    assert [p.name for p in expand_inputs([tmp_path / "sub"])] == ["more.txt.gz"]


def test_bad_split_and_engine_name_the_option(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("hello world " * 20, encoding="utf-8")
    with pytest.raises(DataError, match="--split 'lines'.*'line'"):
        clean_corpus([src], tmp_path / "o", split="lines", show_progress=False)
    with pytest.raises(DataError, match="--engine 'spark'.*local.*ray"):
        pack_corpus([src], tmp_path / "tok", tmp_path / "o", engine="spark", show_progress=False)
    with pytest.raises(DataError, match="--ngram 0"):
        clean_corpus([src], tmp_path / "o", CleanOptions(ngram=0), show_progress=False)


@pytest.mark.process
def test_engine_ray_without_ray_names_the_extra(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("hello world, this is a document long enough to keep. " * 5, encoding="utf-8")
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from fitlm.cli import main\n"
        f"sys.exit(main(['data', 'clean', {str(src)!r}, '--out', {str(tmp_path / 'o')!r}, '--engine', 'ray']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode != 0
    assert "pip install 'fitlm[ray]'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "o").exists()


@pytest.mark.process
def test_unreachable_ray_address_fails_fast_naming_the_option(tmp_path):
    pytest.importorskip("ray")
    src = tmp_path / "a.txt"
    src.write_text("hello world, this is a document long enough to keep. " * 5, encoding="utf-8")
    with pytest.raises(DataError, match="--ray-address '127.0.0.1:1': nothing answers"):
        clean_corpus([src], tmp_path / "o", engine="ray", ray_address="127.0.0.1:1", show_progress=False)
    assert not (tmp_path / "o").exists()
