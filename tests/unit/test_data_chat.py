"""Chat / SFT data: templates (built-in and sandboxed Jinja), assistant-only loss, packing and bad samples."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fitlm.data import IGNORE_INDEX, DataError, PackedDataset, SequenceLoader, Tokenizer
from fitlm.data.chat import BUILTIN_TEMPLATES, ChatEncoder, resolve_template
from fitlm.data.prep import pack_corpus, train_tokenizer

REPO = Path(__file__).resolve().parents[2]
CHAT = REPO / "examples" / "data" / "chat" / "chatterbot_corpus.jsonl"
CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is a river? <|eos|>"},
    {"role": "assistant", "content": "Water that flows."},
    {"role": "user", "content": "And 河流?"},
    {"role": "assistant", "content": "The same, in Chinese."},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    root = tmp_path_factory.mktemp("chat-tok")
    return Tokenizer.from_file(train_tokenizer([CHAT], 600, root / "tok"))


def _trained_text(tok, ids, mask) -> str:
    return tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)


@pytest.mark.parametrize("name", ["chatml", "inst", "plain"])
def test_loss_mask_is_on_assistant_tokens_only(tok, name):
    enc = ChatEncoder(tok, BUILTIN_TEMPLATES[name], name)
    ids, mask = enc.encode(CONV)
    assert len(ids) == len(mask) and ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    trained = _trained_text(tok, ids, mask)
    assert "Water that flows." in trained and "The same, in Chinese." in trained
    for text in ("Be brief", "river", "河流", "[INST]", "User", "user"):
        assert text not in trained, (name, text, trained)
    # The user's literal "<|eos|>" stays text: exactly the template's/closing EOS ids exist.
    want_eos = 2 if name == "inst" else 1
    assert ids.count(tok.eos_id) == want_eos
    assert "<|eos|>" in tok.decode(ids, skip_special_tokens=True)  # decoded from plain bytes, not an id


def test_inst_template_renders_llama2_format(tok):
    enc = ChatEncoder(tok, BUILTIN_TEMPLATES["inst"], "inst")
    text = enc.render(CONV)
    assert text.startswith("<|bos|>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nWhat is a river? <|eos|> [/INST] Water")
    assert " [/INST] The same, in Chinese. <|eos|>" in text
    ids, mask = enc.encode(CONV)
    eos_at = [i for i, t in enumerate(ids) if t == tok.eos_id]
    assert all(mask[i] == 1 for i in eos_at)  # the model learns to end its turn


def test_jinja_template_from_tokenizer_config_is_sandboxed(tok, tmp_path):
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"}))
    name, src = resolve_template(str(cfg))
    ids, mask = ChatEncoder(tok, src, name).encode(CONV)
    assert "Water that flows." in _trained_text(tok, ids, mask)
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(DataError, match="unsafe|failed to render"):
        ChatEncoder(tok, evil, "evil").render(CONV)
    with pytest.raises(DataError, match="template raised: no system"):
        ChatEncoder(tok, "{{ raise_exception('no system') }}", "strict").render(CONV)
    with pytest.raises(DataError, match="does not reproduce message"):
        ChatEncoder(tok, "{% for m in messages %}{{ m.content | upper }}{% endfor %}", "upper").encode(CONV)
    with pytest.raises(DataError, match="neither a built-in"):
        resolve_template("nope")


def _write_chat(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def test_pack_chat_counts_bad_samples_and_loader_trains_on_assistant_only(tok, tmp_path):
    long_answer = " ".join(["flows"] * 300)
    rows = [
        {"messages": CONV},
        {"messages": [{"role": "user", "content": "hello?"}]},  # no assistant turn
        {"messages": [{"role": "user", "content": "tell me"}, {"role": "assistant", "content": long_answer}]},
        *(
            {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i}"}]}
            for i in range(40)
        ),
    ]
    src = _write_chat(tmp_path / "chat.jsonl", rows)
    limit = max(64, len(ChatEncoder(tok, BUILTIN_TEMPLATES["inst"]).encode(CONV)[0]))  # CONV fits, the long one not
    m = pack_corpus(
        [src],
        tok.path,
        tmp_path / "t",
        show_progress=False,
        data_format="chat",
        template="inst",
        max_length=limit,
        overlong="truncate",
    )
    assert m["data_format"] == "chat" and m["chat"]["no_assistant"] == 1 and m["chat"]["truncated"] == 1
    assert m["num_docs"] == 42 and m["chat"]["conversations"] == 43 and m["chat_template"] == "inst"
    d = pack_corpus(
        [src],
        tok.path,
        tmp_path / "d",
        show_progress=False,
        data_format="chat",
        template="inst",
        max_length=limit,
        overlong="drop",
    )
    assert d["chat"]["dropped_overlong"] == 1 and d["num_docs"] == 41
    ds = PackedDataset(tmp_path / "t")
    assert ds.data_format == "chat" and all(s.mask is not None for s in ds.shards)
    assert np.diff(ds.doc_offsets).max() == limit
    loader = SequenceLoader(ds, seq_length=limit - 1, micro_batch_size=2, seed=0)
    assert loader.packing == "docs"  # whole conversations per row
    trained = []
    for _ in range(loader.batches_per_epoch):
        b = next(loader)
        keep = b["labels"] != IGNORE_INDEX
        trained.append(tok.decode(b["labels"][keep].tolist(), skip_special_tokens=False))
        assert (b["labels"][b["input_ids"] == ds.pad_id] == IGNORE_INDEX).all()
        boundary = b["document_ids"][:, 1:] != b["document_ids"][:, :-1]  # (the last label looks one token past T)
        assert boundary.any() and (b["labels"][:, :-1][boundary] == IGNORE_INDEX).all()
    joined = " ".join(trained)
    assert "answer 7" in joined and "Water that flows." in joined
    assert "q7" not in joined and "What is a river" not in joined and "[INST]" not in joined


def test_chat_bad_inputs(tok, tmp_path):
    only_users = _write_chat(tmp_path / "u.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 3)
    with pytest.raises(DataError, match="empty corpus.*no conversation with an assistant turn"):
        pack_corpus([only_users], tok.path, tmp_path / "o", show_progress=False, data_format="chat")
    bad_role = _write_chat(tmp_path / "r.jsonl", [{"messages": [{"role": "bot", "content": "x"}]}])
    with pytest.raises(DataError, match=r"r\.jsonl:1: message 0 must be"):
        pack_corpus([bad_role], tok.path, tmp_path / "o", show_progress=False, data_format="chat")
    no_field = _write_chat(tmp_path / "n.jsonl", [{"text": "plain"}])
    with pytest.raises(DataError, match=r'n\.jsonl:1: no "messages" field'):
        pack_corpus([no_field], tok.path, tmp_path / "o", show_progress=False, data_format="chat")
    assert not (tmp_path / "o").exists()


def test_pad_must_be_a_real_token(tmp_path):
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers

    hf = HF(models.BPE(vocab={"a": 0, "<s>": 1, "</s>": 2}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel()
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    with pytest.raises(DataError, match="lacks the special token.*PAD"):
        Tokenizer.from_file(path, bos="<s>", eos="</s>")
    assert Tokenizer.from_file(path, bos="<s>", eos="</s>", pad="</s>").pad_id == 2


def test_example_chat_set_packs(tok, tmp_path):
    m = pack_corpus([CHAT], tok.path, tmp_path / "ex", show_progress=False, data_format="chat", workers=2)
    assert m["num_docs"] > 1000 and m["chat"]["no_assistant"] == 0 and m["chat_template"] == "chatml"
    ds = PackedDataset(tmp_path / "ex")
    multi = [
        i for i in range(50) if tok.decode(ds.document(i), skip_special_tokens=False).count("<|im_start|>assistant") > 1
    ]
    assert multi or ds.num_docs > 0


def test_text_pack_after_chat_pack_in_one_process(tok, tmp_path):
    """The inline encoder state must not leak a chat template into a later text pack."""
    src = _write_chat(tmp_path / "c.jsonl", [{"messages": CONV}] * 3)
    pack_corpus([src], tok.path, tmp_path / "chat", show_progress=False, data_format="chat")
    txt = tmp_path / "t.txt"
    txt.write_text("plain text document\n", encoding="utf-8")
    m = pack_corpus([txt], tok.path, tmp_path / "text", show_progress=False)
    assert (
        m["data_format"] == "text" and tok.decode(PackedDataset(tmp_path / "text").document(0)) == "plain text document"
    )
