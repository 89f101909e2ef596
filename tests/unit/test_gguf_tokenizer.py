"""GGUF tokenizers: `fitlm import model.gguf` writes tokenizer files that encode exactly as the model's own
Hugging Face tokenizer (byte-level BPE with the gpt2 / llama-bpe / qwen2 split rules, SentencePiece "llama"
vocabularies with and without a space prefix), carry BOS/EOS/PAD/end-of-turn and the chat template, and
let `fitlm data pack --format chat` use them with no manual step. The GGUF files are written here with the
gguf package's GGUFWriter, llama.cpp-style, around a tiny random Llama."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch

from fitlm.data import DataError, PackedDataset, Tokenizer
from fitlm.data.gguf_tokenizer import UnsupportedTokenizer, gguf_tokenizer_files
from tests.e2e.helpers import fitlm
from tests.unit.model_tokenizers import PHI3_TEMPLATE, STYLES, TEXTS, corpus, hf_dir

CONV = [
    {"role": "user", "content": "What is a river?"},
    {"role": "assistant", "content": "Water that flows."},
    {"role": "user", "content": "And 河流?"},
    {"role": "assistant", "content": "The same, in Chinese."},
]
SPM_TEXTS = [*TEXTS, "  leading and trailing  ", "<|user|>\nhi<|end|>\n"]  # special strings in text stay text


def write_gguf(path: Path, n_vocab: int, add_tokenizer: Callable) -> Path:
    """A llama GGUF file: a tiny random model written by `fitlm export` (no tokenizer), copied with
    GGUFWriter and `add_tokenizer(writer)` adding the tokenizer metadata as llama.cpp's converter would."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    from fitlm.config import ModelConfig
    from fitlm.export.gguf import export_gguf
    from fitlm.models.io import load_model_dir, save_model_dir
    from fitlm.registry import build_model

    cfg = ModelConfig(
        arch="llama",
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        intermediate_size=64,
        vocab_size=n_vocab,
        max_seq_len=64,
    )
    torch.manual_seed(0)
    save_model_dir(build_model(cfg), cfg, path.with_suffix(".src"))
    plain = export_gguf(load_model_dir(path.with_suffix(".src")), path.with_suffix(".plain.gguf"), "f32")["out"]
    reader = GGUFReader(plain)
    w = GGUFWriter(str(path), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            array = field.types[0] == GGUFValueType.ARRAY
            w.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1] if array else None)
    add_tokenizer(w)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def bpe_metadata(ref: Path, style: str) -> tuple[Callable, int]:
    """What llama.cpp's converter stores for the byte-level BPE tokenizer in directory `ref`."""
    import tokenizers

    s = STYLES[style]
    backend = tokenizers.Tokenizer.from_file(str(ref / "tokenizer.json"))
    vocab = backend.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    merges = json.loads((ref / "tokenizer.json").read_text())["model"]["merges"]
    bos = s["bos"] or "<|endoftext|>"  # Qwen's GGUF files name a BOS but never add it

    def add(w) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre({"llama3": "llama-bpe", "qwen": "qwen2"}[style])
        w.add_token_list(tokens)
        w.add_token_types([3 if t in special else 1 for t in tokens])
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
        w.add_bos_token_id(vocab[bos])
        w.add_eos_token_id(vocab[s["eos"]])
        w.add_eot_token_id(vocab[s["end_of_turn"]])
        if s["pad"]:
            w.add_pad_token_id(vocab[s["pad"]])
        w.add_add_bos_token(s["bos"] is not None)
        w.add_chat_template(s["template"])

    return add, len(tokens)


@pytest.fixture(scope="module")
def refs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ref")
    return {style: hf_dir(style, root) for style in ("llama3", "qwen")}


def _hf(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.mark.process
@pytest.mark.parametrize("style", ["llama3", "qwen"])
def test_byte_level_gguf_imports_with_specials_and_template_then_packs_chat(refs, tmp_path, style):
    add, n = bpe_metadata(refs[style], style)
    gguf = write_gguf(tmp_path / "m.gguf", n, add)
    r = fitlm("import", gguf, "--out", tmp_path / "m", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokenizer"] is True
    out, ref, s = tmp_path / "m", _hf(refs[style]), STYLES[style]
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"} <= {
        p.name for p in out.iterdir()
    }
    tok, theirs = Tokenizer.from_file(out), _hf(out)
    for text in TEXTS:  # the model's own tokenizer, fitlm, and transformers on the imported files agree
        want = ref(text)["input_ids"]
        assert tok.encode(text, add_bos=tok.add_bos) == want == theirs(text)["input_ids"], (style, text)
        assert tok.decode(want) == ref.decode(want, skip_special_tokens=True)
    assert tok.add_bos == (style == "llama3") and tok.eos_id == ref.eos_token_id
    gen = json.loads((out / "generation_config.json").read_text())  # tokenizer.ggml.eot_token_id is a stop id
    stops = list(dict.fromkeys([tok.eos_id, tok.token_to_id(s["end_of_turn"])]))  # Qwen: eot is eos
    assert gen["eos_token_id"] == (stops if len(stops) > 1 else stops[0]) and list(tok.stop_ids[: len(stops)]) == stops
    assert tok.pad_id == (ref.eos_token_id if ref.pad_token_id is None else ref.pad_token_id)
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": CONV}) + "\n")
    r = fitlm("data", "pack", chat, "--format", "chat", "--tokenizer", out / "tokenizer.json", "--out", tmp_path / "p")
    assert r.returncode == 0, r.stderr
    ds = PackedDataset(tmp_path / "p")
    assert ds.manifest["chat_template"].endswith("chat_template.jinja")
    # The template's own BOS and end-of-turn tokens, none doubled, nothing appended.
    want = ref.apply_chat_template(CONV, tokenize=True, return_dict=True)["input_ids"]
    assert ds.document(0).tolist() == want


def spm_reference(root: Path, prefix: bool) -> Path:
    """A SentencePiece-style (Llama 2 / Phi-3 layout) HF tokenizer: <unk> <s> </s>, 256 byte pieces, then BPE
    pieces trained on "▁"-spaced text in merge order; byte fallback; Phi-3's chat tokens added last."""
    from tokenizers import AddedToken, decoders, models, normalizers, processors, trainers
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import PreTrainedTokenizerFast

    spaces = normalizers.Replace(" ", "▁")
    norm = normalizers.Sequence([normalizers.Prepend("▁"), spaces]) if prefix else spaces
    trained = HFTokenizer(models.BPE())
    trained.normalizer = norm
    trainer = trainers.BpeTrainer(vocab_size=900, limit_alphabet=120, show_progress=False)  # rare chars: byte fallback
    trained.train_from_iterator(corpus(300), trainer)
    spec = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in sorted(spec["vocab"], key=spec["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = norm
    decs = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(decs + [decoders.Strip(" ", 1, 0)] if prefix else decs)
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t in ("<unk>", "<s>", "</s>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>")
        ]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="<|endoftext|>", unk_token="<unk>", pad_token="<|endoftext|>"
    )
    hf.chat_template = PHI3_TEMPLATE
    out = root / f"spm-{prefix}"
    hf.save_pretrained(out)
    return out


def spm_metadata(ref: Path, prefix: bool) -> tuple[Callable, int]:
    """What llama.cpp stores for a SentencePiece vocabulary: pieces, scores (merge order), token types."""
    import tokenizers

    backend = tokenizers.Tokenizer.from_file(str(ref / "tokenizer.json"))
    vocab = backend.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    types = [
        2 if t == "<unk>" else 6 if 3 <= i < 259 else 3 if i < 3 or t.startswith("<|") else 1
        for i, t in enumerate(tokens)
    ]

    def add(w) -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores([-float(i) if k == 1 else 0.0 for i, k in enumerate(types)])
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(vocab["<|endoftext|>"])
        w.add_unk_token_id(0)
        w.add_eot_token_id(vocab["<|end|>"])
        w.add_add_bos_token(True)
        w.add_add_space_prefix(prefix)
        w.add_chat_template(PHI3_TEMPLATE)

    return add, len(tokens)


@pytest.mark.parametrize("prefix", [True, False], ids=["llama2-phi3", "gemma-no-prefix"])
def test_sentencepiece_gguf_encodes_as_the_hf_tokenizer(tmp_path, prefix):
    from fitlm.data.chat import ChatEncoder, resolve_template
    from fitlm.finetune.importer import import_model

    ref_dir = spm_reference(tmp_path, prefix)
    add, n = spm_metadata(ref_dir, prefix)
    summary = import_model(write_gguf(tmp_path / "m.gguf", n, add), tmp_path / "m")
    assert summary["tokenizer"] is True
    ref, tok, theirs = _hf(ref_dir), Tokenizer.from_file(tmp_path / "m"), _hf(tmp_path / "m")
    assert ref("hi")["input_ids"][0] == 1 and tok.add_bos
    for text in SPM_TEXTS:
        want = ref(text, split_special_tokens=True)["input_ids"]
        assert tok.encode(text, add_bos=tok.add_bos) == want == theirs(text, split_special_tokens=True)["input_ids"]
        assert tok.decode(want) == ref.decode(want, skip_special_tokens=True)
    assert [tok.id_to_token(i) for i in tok.stop_ids] == ["<|endoftext|>", "<|end|>"]
    name, source = resolve_template(None, tok.path)
    ids, _ = ChatEncoder(tok, source, name).encode(CONV)
    assert ids == [1] + ref.apply_chat_template(CONV, tokenize=True, return_dict=True)["input_ids"]


def test_fitlm_export_round_trip_keeps_the_split_rule_and_specials(refs, tmp_path):
    """fitlm's GGUF export names the pre-tokenizer (llama-bpe) and the end-of-turn id; import reads them back."""
    from fitlm.config import ModelConfig
    from fitlm.export.gguf import export_gguf
    from fitlm.finetune.importer import import_model
    from fitlm.models.io import load_model_dir, save_model_dir
    from fitlm.registry import build_model

    ref = Tokenizer.from_file(refs["llama3"])
    cfg = ModelConfig(
        arch="llama",
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        intermediate_size=64,
        vocab_size=ref.vocab_size,
        max_seq_len=64,
    )
    save_model_dir(build_model(cfg), cfg, tmp_path / "src", tokenizer_path=refs["llama3"])
    export_gguf(load_model_dir(tmp_path / "src"), tmp_path / "m.gguf", "f32")
    import_model(tmp_path / "m.gguf", tmp_path / "back")
    back = Tokenizer.from_file(tmp_path / "back")
    for text in TEXTS:
        assert back.encode(text, add_bos=back.add_bos) == ref.encode(text, add_bos=ref.add_bos)
    assert back.stop_ids == ref.stop_ids and back.special_tokens["bos"] == ref.special_tokens["bos"]


def test_unsupported_and_bad_gguf_tokenizers_are_explained(refs, tmp_path):
    from fitlm.finetune.importer import import_model

    base = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "ab", "</s>"],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.eos_token_id": 3,
    }
    assert json.loads(gguf_tokenizer_files(base, "x.gguf")["tokenizer_config.json"])["eos_token"] == "</s>"
    cases = [
        ({"tokenizer.ggml.model": "bert"}, UnsupportedTokenizer, r"\.model 'bert' is not converted"),
        ({"tokenizer.ggml.pre": "bloom"}, UnsupportedTokenizer, r"tokenizer\.ggml\.pre 'bloom'"),
        ({"tokenizer.ggml.eos_token_id": 9}, DataError, r"tokenizer\.ggml\.eos_token_id = 9 is not a token id"),
        ({"tokenizer.ggml.eos_token_id": None}, DataError, r"tokenizer\.ggml\.eos_token_id is missing"),
        ({"tokenizer.ggml.merges": ["a c"]}, DataError, r"tokenizer\.ggml\.merges holds 'a c'"),
        ({"tokenizer.ggml.model": "llama"}, DataError, r"tokenizer\.ggml\.scores is missing"),
        ({"tokenizer.ggml.token_type": [1]}, DataError, r"token_type has 1 entries for 4 tokens"),
    ]
    for change, error, message in cases:
        with pytest.raises(error, match=message):
            gguf_tokenizer_files({**base, **change}, "x.gguf")

    def bert(w) -> None:
        w.add_tokenizer_model("bert")
        w.add_token_list(["[CLS]", "a"])

    summary = import_model(write_gguf(tmp_path / "b.gguf", 8, bert), tmp_path / "b")
    assert summary["tokenizer"] is False and "'bert' is not converted" in summary["tokenizer_note"]
    assert not (tmp_path / "b" / "tokenizer.json").exists()
