"""Tokenizer conventions follow the model: BOS/EOS/PAD, stop ids and the chat template of Llama 3-, Qwen-,
Gemma- and Phi-3-style tokenizers (built offline, tests/unit/model_tokenizers.py) against transformers
itself; fitlm's own tokenizers keep fitlm's convention; bad files get errors naming the key and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from fitlm.data import DataError, PackedDataset, Tokenizer
from fitlm.data.chat import BUILTIN_TEMPLATES, ChatEncoder, resolve_template
from fitlm.data.inspect import inspect_packed
from fitlm.data.prep import pack_corpus, train_tokenizer
from tests.unit.model_tokenizers import CHAT, STYLES, TEXTS, hf_dir

CONV = [
    {"role": "user", "content": "What is a river?"},
    {"role": "assistant", "content": "Water that flows."},
    {"role": "user", "content": "And 河流?"},
    {"role": "assistant", "content": "The same, in Chinese."},
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {style: hf_dir(style, root) for style in STYLES}


def _hf(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _trained_runs(tok: Tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """The decoded runs of consecutive trained tokens."""
    runs, cur = [], []
    for i, m in zip(ids + [None], mask + [0]):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur, skip_special_tokens=False))
            cur = []
    return runs


@pytest.mark.parametrize("style", list(STYLES))
def test_encoding_and_specials_equal_transformers(dirs, style):
    tok, hf, s = Tokenizer.from_file(dirs[style]), _hf(dirs[style]), STYLES[style]
    for text in TEXTS:  # BOS exactly when the model's tokenizer adds it, never twice
        assert tok.encode(text, add_bos=tok.add_bos) == hf(text)["input_ids"], (style, text)
        assert tok.decode(tok.encode(text)) == hf.decode(hf(text, add_special_tokens=False)["input_ids"])
    assert tok.add_bos == (style != "qwen")
    assert (tok.bos_id, tok.eos_id) == (hf.bos_token_id, hf.eos_token_id)
    assert tok.pad_id == (hf.pad_token_id if s["pad"] else hf.eos_token_id)  # no PAD named: pads with EOS
    assert tok.stop_ids[0] == tok.eos_id and tok.token_to_id(s["end_of_turn"]) in tok.stop_ids
    if style == "llama3":  # both ids of generation_config.json's eos_token_id list
        listed = json.loads((dirs[style] / "generation_config.json").read_text())["eos_token_id"]
        assert set(listed) <= set(tok.stop_ids)


def test_bos_from_the_post_processor_or_add_bos_token(dirs, tmp_path):
    """The post-processor's BOS stays even if add_bos_token is false (transformers 5 ignores the key beside a
    tokenizer.json); add_bos_token true alone also adds BOS (transformers 4's Llama-family classes, llama.cpp)."""
    d = tmp_path / "llama3-false"
    shutil.copytree(dirs["llama3"], d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": False}))
    tok = Tokenizer.from_file(d)
    assert tok.add_bos and tok.encode("hi there", add_bos=tok.add_bos) == _hf(d)("hi there")["input_ids"]
    only_config = Tokenizer.from_file(hf_dir("gemma", tmp_path, post_bos=False))
    assert only_config.add_bos and only_config.encode("hi", add_bos=only_config.add_bos)[0] == only_config.bos_id


@pytest.mark.parametrize("style", list(STYLES))
def test_chat_template_is_the_models_and_renders_as_transformers(dirs, style):
    tok, hf = Tokenizer.from_file(dirs[style]), _hf(dirs[style])
    name, source = resolve_template(None, tok.path)
    assert name.endswith("chat_template.jinja") and source == hf.chat_template
    enc = ChatEncoder(tok, source, name)
    for gen in (False, True):
        conv = CONV[:3] if gen else CONV
        assert enc.render(conv, add_generation_prompt=gen) == hf.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=gen
        )
    theirs = hf.apply_chat_template(CONV, tokenize=True, return_dict=True)["input_ids"]
    ids, mask = enc.encode(CONV)
    # Phi-3's template writes no BOS but its tokenizer adds one: fitlm puts it first (once); nothing else differs.
    assert ids == ([tok.bos_id] if style == "phi3" else []) + theirs
    if tok.bos_id is not None:
        assert ids.count(tok.bos_id) == 1
    eot = STYLES[style]["end_of_turn"]
    assert _trained_runs(tok, ids, mask) == [f"Water that flows.{eot}", f"The same, in Chinese.{eot}"]
    prompt = enc.encode(CONV[:3], add_generation_prompt=True)[0]
    assert (
        prompt
        == ([tok.bos_id] if style == "phi3" else [])
        + hf.apply_chat_template(CONV[:3], tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    )


def test_template_sources_and_hf_jinja_features(dirs, tmp_path):
    tok = Tokenizer.from_file(dirs["qwen"])
    # tokenizer_config.json's chat_template: a string, or a list whose "default" entry is taken
    d = tmp_path / "listed"
    shutil.copytree(dirs["qwen"], d)
    (d / "chat_template.jinja").unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    listed = [
        {"name": "tool_use", "template": "{{ raise_exception('tools') }}"},
        {"name": "default", "template": STYLES["qwen"]["template"]},
    ]
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": listed}))
    want = (str(d / "tokenizer_config.json"), STYLES["qwen"]["template"])
    assert resolve_template(None, d / "tokenizer.json") == want
    assert resolve_template(str(d))[1] == STYLES["qwen"]["template"]  # a model directory as --template
    assert resolve_template("chatml", d / "tokenizer.json")[0] == "chatml"  # an explicit choice still wins
    src = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% generation %}"
        "{{ m | tojson }}{% endgeneration %}{% endfor %}{{ strftime_now('%Y') | length }}"
    )
    text = ChatEncoder(tok, src).render(CONV)
    assert text == json.dumps(CONV[0], ensure_ascii=False) + json.dumps(CONV[1], ensure_ascii=False) + "4"


def test_no_doubled_eos_and_qwen_packs_without_bos(dirs, tmp_path):
    """EOS == the template's end of turn (<|im_end|>) is not appended again; `fitlm data inspect --doc 1` shows it."""
    tok = Tokenizer.from_file(dirs["qwen"])
    ids, mask = ChatEncoder(tok, BUILTIN_TEMPLATES["chatml"], "chatml").encode(CONV)
    assert ids.count(tok.eos_id) == len(CONV) and ids[-1] != tok.eos_id  # chatml ends "<|im_end|>\n"
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps({"messages": CONV[: 2 + 2 * (i % 2)]}) + "\n" for i in range(6)))
    m = pack_corpus([src], dirs["qwen"] / "tokenizer.json", tmp_path / "p", show_progress=False, data_format="chat")
    assert m["chat_template"].endswith("chat_template.jinja") and m["bos_id"] is None and m["eos_id"] == tok.eos_id
    report = inspect_packed(tmp_path / "p", sample_tokens=500, sample_doc=1)
    assert report["sample_text"].count("<|im_end|>") == 5 and "<|im_end|>\n<|im_end|>" not in report["sample_text"]
    assert report["sample_text"].startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")
    ds = PackedDataset(tmp_path / "p")
    assert ds.bos_id is None and (ds.path / "chat_template.jinja").is_file()  # the conventions travel with the data
    assert ds.load_tokenizer().special_tokens == tok.special_tokens
    text = tmp_path / "t.txt"
    text.write_text("one document\n", encoding="utf-8")
    pack_corpus([text], dirs["qwen"], tmp_path / "t", show_progress=False)
    assert PackedDataset(tmp_path / "t").document(0).tolist() == tok.encode("one document", add_eos=True)


def test_fitlm_tokenizers_keep_fitlm_convention(tmp_path):
    path = train_tokenizer([CHAT], 600, tmp_path / "tok")
    tok = Tokenizer.from_file(path)
    assert tok.fitlm_convention and tok.add_bos and tok.stop_ids == (tok.eos_id,)
    assert tok.special_tokens == {"bos": "<|bos|>", "eos": "<|eos|>", "pad": "<|pad|>"}
    bare = tmp_path / "bare" / "tokenizer.json"  # without tokenizer_config.json: the same convention
    bare.parent.mkdir()
    shutil.copyfile(path, bare)
    assert Tokenizer.from_file(bare).add_bos and resolve_template(None, bare)[0] == "chatml"
    ids, _ = ChatEncoder(tok, BUILTIN_TEMPLATES["chatml"]).encode(CONV)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and ids.count(tok.eos_id) == 1


def test_generation_stops_at_any_of_the_models_eos_ids(dirs, tmp_path):
    from fitlm.config import ModelConfig
    from fitlm.infer.generate import generate
    from fitlm.infer.text import generate_text
    from fitlm.models.io import save_model_dir
    from fitlm.registry import build_model

    tok = Tokenizer.from_file(dirs["llama3"])
    cfg = ModelConfig(
        arch="llama",
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        intermediate_size=64,
        vocab_size=tok.vocab_size,
        max_seq_len=64,
        init_std=0.5,
    )
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    prompt = tok.encode("Hello", add_bos=True)
    free = generate(model, prompt, 12)
    stop = next(t for t in free[2:] if t not in free[:2])  # a token the model emits on its own, not first
    gen = {"eos_token_id": [tok.eos_id, stop]}
    d = tmp_path / "tok"
    shutil.copytree(dirs["llama3"], d)
    (d / "generation_config.json").write_text(json.dumps(gen))
    out = save_model_dir(model, cfg, tmp_path / "m", tokenizer_path=d)
    assert json.loads((out / "generation_config.json").read_text()) == gen  # copied beside the weights
    got = generate_text(str(out), "Hello", max_new_tokens=12, seed=None)["token_ids"]
    assert got == free[: free.index(stop) + 1]


def test_bad_tokenizer_files_are_named(dirs, tmp_path):
    def broken(name: str, content: str) -> Path:
        d = tmp_path / f"b{len(list(tmp_path.iterdir()))}"
        shutil.copytree(dirs["qwen"], d)
        (d / name).write_text(content)
        return d

    with pytest.raises(DataError, match=r"tokenizer_config\.json is not valid JSON"):
        Tokenizer.from_file(broken("tokenizer_config.json", "{oops"))
    with pytest.raises(DataError, match=r"generation_config\.json: eos_token_id must be a token id"):
        Tokenizer.from_file(broken("generation_config.json", '{"eos_token_id": [1, "x"]}'))
    with pytest.raises(DataError, match=r"eos_token must be a token string"):
        Tokenizer.from_file(broken("tokenizer_config.json", '{"eos_token": 5}'))
    with pytest.raises(DataError, match=r"no EOS token is named.*--eos"):
        Tokenizer.from_file(broken("tokenizer_config.json", '{"bos_token": null}'))
    d = broken("tokenizer_config.json", json.dumps({"eos_token": "<|im_end|>", "chat_template": [{"name": "x"}]}))
    (d / "chat_template.jinja").unlink()
    with pytest.raises(DataError, match=r'chat_template is a list without a "default" entry'):
        resolve_template(None, d / "tokenizer.json")
    with pytest.raises(DataError, match="neither chat_template.jinja nor"):
        resolve_template(str(tmp_path))
    qwen = Tokenizer.from_file(dirs["qwen"])
    with pytest.raises(DataError, match="has no BOS token"):
        qwen.encode("x", add_bos=True)
