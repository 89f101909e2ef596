"""`fitlm data clean`: filters, exact and near-duplicate removal (incl. Chinese), bad input, counts."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from fitlm.data import DataError
from fitlm.data.prep.clean import CleanOptions, check_document, clean_corpus
from fitlm.data.prep.dedup import MinHashLSH, jaccard, lsh_params

REPO = Path(__file__).resolve().parents[2]
PLAYS = REPO / "examples" / "data" / "shakespeare"
ZH = (
    "人工智能是计算机科学的一个分支，它企图了解智能的实质，并生产出一种新的能以人类智能相似的方式做出反应的智能机器。"
    "该领域的研究包括机器人、语言识别、图像识别、自然语言处理和专家系统等。自诞生以来，理论和技术日益成熟，应用领域也不断扩大。"
)
ZH_CHARS = "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产种面而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机当使点从业本去把性好应开它合还因由其些然前外天政四日那社义事平形相全表间样与关各重新线内数正心反你明看原又么利比或但质气第向道命此变条只没结解问意建月公无系军很情者最立代想已通并提直题党程展五果料象员革位入常文总次品式活设及管特件长求老头基资边流路级少图山统接知较将组见计别她手角期根论运农指几九区强放决西被干做必战先回则任取据处队南给色光门即保治北造百规热领七海口东导器压志世金增争济阶油思术极交受联什认六共权收证改清己美再采转更单风切打白教速花带安场身车例真务具万每目至达走积示议声报斗完类八离华名确才科张信马节话米整空元况今集温传土许步群广石记需段研界拉林律叫且究观越织装影算低持音众书布复容儿须际商非验连断深难近矿千周委素技备半办青省列习响约支般史感劳便团往酸历市克何除消构府称太准精值号率族维划选标写存候毛亲快效斯院查江型眼王按格养易置派层片始却专状育厂京识适属圆包火住调满县局照参红细引听该铁价严"


def _zh_doc(rng: random.Random, n: int = 300) -> str:
    return "".join(rng.choice(ZH_CHARS) for _ in range(n)) + "。"


def _en_doc(rng: random.Random, words: list[str], n: int = 60) -> str:
    return " ".join(rng.choice(words) for _ in range(n)).capitalize() + "."


def _perturb(text: str, rng: random.Random, edits: int) -> str:
    chars = list(text)
    for _ in range(edits):
        chars[rng.randrange(len(chars))] = rng.choice("abcdefghij的一是")
    return "".join(chars)


def test_near_duplicates_found_with_few_false_positives():
    rng = random.Random(0)
    words = PLAYS.joinpath("hamlet_gut.txt").read_text().split()[:4000]
    originals = [_en_doc(rng, words) for _ in range(60)] + [_zh_doc(rng) for _ in range(60)]
    lsh = MinHashLSH(threshold=0.7, num_perm=128)
    assert all(not lsh.seen(t) for t in originals)  # distinct random documents: no false positives
    near = [_perturb(t, rng, 3) for t in originals[::4]]  # a few characters changed
    assert all(jaccard(a, b) > 0.8 for a, b in zip(originals[::4], near))  # 3 edits touch <= 15 of ~300 shingles
    found = sum(lsh.seen(t) for t in near)
    assert found >= 0.9 * len(near), found  # Chinese and English near duplicates alike
    far = [_perturb(t, rng, 60) for t in originals[1::8]]  # heavily edited: well below the threshold
    assert all(jaccard(a, b) < 0.5 for a, b in zip(originals[1::8], far))
    assert sum(lsh.seen(t) for t in far) <= 1
    assert lsh_params(0.8, 128)[0] * lsh_params(0.8, 128)[1] <= 128


def test_filters_work_without_spaces_and_name_their_reason():
    o = CleanOptions()
    rng = random.Random(1)
    assert check_document(ZH, o)[0] is None  # Chinese prose passes every filter
    assert check_document(_zh_doc(rng, 80), o)[0] is None
    assert check_document("短", o)[0] == "too_short"
    assert check_document("哈哈哈哈哈哈哈哈哈哈" * 40, o)[0] == "repetition"
    assert check_document("\ufffd\ufffd\ufffd" + ZH, o)[0] == "garbled"
    assert check_document("!!! ??? ### ... $$$ " * 10 + "abc", o)[0] == "symbols"
    assert check_document("12.5% | 13.1% | 7.2% | 8.8% | 9.9% | 10.1% | 11.4% | 3.3% " * 3, o)[0] in (
        "symbols",
        "few_letters",
    )
    code = "def f(x):\n    return x + 1;\nclass A {\n  int y;\n}\nimport os\nfor (i = 0; i < n; i++) {\n}\n"
    assert (
        check_document(code * 3, CleanOptions(drop_code=True, max_symbols=0.9, max_dup_lines=1.0, min_compress=0.0))[0]
        == "code"
    )
    page = ZH + "\n版权所有 © 2024\n登录 | 注册\nAccept cookie policy\n"
    reason, text = check_document(page, CleanOptions(drop_boilerplate=True, max_boilerplate=0.8))
    assert reason is None and "登录" not in text and "cookie" not in text and ZH in text
    assert check_document(page, CleanOptions(drop_boilerplate=True))[0] == "boilerplate"  # 3 of 4 lines


def test_clean_corpus_counts_each_filter_and_dedups(tmp_path):
    rng = random.Random(2)
    words = PLAYS.joinpath("macbeth_gut.txt").read_text().split()[:3000]
    docs = [_en_doc(rng, words) for _ in range(20)] + [_zh_doc(rng) for _ in range(20)]
    rows = docs + [
        docs[3],
        docs[25],
        docs[25].replace("。", "."),
        _perturb(docs[7], rng, 2),
        _perturb(docs[30], rng, 2),
        "tiny",
        "哈" * 300,
        "ｆｕｌｌｗｉｄｔｈ " + _en_doc(rng, words) + "\u200b\x07",
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in rows), encoding="utf-8")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(("\n".join(_en_doc(rng, words) for _ in range(2))).encode() + b" caf\xe9 \xff end of it all now.\n")
    report = clean_corpus([src, bad], tmp_path / "out", CleanOptions(jaccard=0.7), split="file", show_progress=False)
    d = report["dropped"]
    assert d["exact_duplicate"] == 2 and d["near_duplicate"] >= 2 and d["too_short"] == 1 and d["repetition"] == 1
    assert report["replaced_invalid_utf8"] == 2 and report["control_chars_removed"] == 2
    assert report["documents_in"] == len(rows) + 1
    assert report["documents_out"] == report["documents_in"] - sum(d.values())
    kept = [json.loads(line)["text"] for line in (tmp_path / "out" / "clean-00000.jsonl").open(encoding="utf-8")]
    assert len(kept) == report["documents_out"] and any(t.startswith("fullwidth ") for t in kept)  # NFKC applied
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == report


def test_empty_after_cleaning_is_an_error_and_writes_nothing(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("too short\n\nalso short\n")  # blank-line blocks join into one short document
    with pytest.raises(DataError, match=r"empty after cleaning: all 1 document\(s\).*too_short=1.*--min-chars"):
        clean_corpus([src], tmp_path / "out", show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


def test_parquet_input_reads_or_names_the_extra(tmp_path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        (tmp_path / "x.parquet").write_bytes(b"PAR1")
        with pytest.raises(DataError, match=r"x\.parquet: reading \.parquet needs pyarrow.*fitlm\[data\]"):
            clean_corpus([tmp_path / "x.parquet"], tmp_path / "out", show_progress=False)
        return
    pq.write_table(pa.table({"text": [ZH, ZH, "x"], "id": [1, 2, 3]}), tmp_path / "x.parquet")
    report = clean_corpus([tmp_path / "x.parquet"], tmp_path / "out", show_progress=False)
    assert report["documents_in"] == 3 and report["documents_out"] == 1 and report["dropped"]["exact_duplicate"] == 1
