"""`fitlm data tokenizer MODEL --out DIR` with an existing tokenizer instead of text: import it.

Accepted: a Hugging Face `tokenizer.json` (copied byte for byte, with its tokenizer_config.json), or a
SentencePiece `.model` of the Unigram type (Llama-1/2, T5, ... style), converted to an equivalent
tokenizer.json: pieces and scores, the precompiled normalisation map, byte fallback, Metaspace
pre-tokenization. The .model file is a protobuf; the few fields needed are read by a minimal
wire-format reader here, so neither `sentencepiece` nor `protobuf` is needed.
Not converted (refused with a message): SentencePiece BPE/word/char models.

fitlm needs BOS, EOS and PAD to be real tokens of the vocabulary; names come from --bos/--eos/--pad,
else the tokenizer's config, else the model's own (<s>, </s>, <pad>). An imported tokenizer.json keeps
its model's conventions (the side files of fitlm.data.conventions are copied with it); a converted
SentencePiece model adds BOS (add_bos_token), as Llama-style models do. A model without a PAD token is
refused: the guide warns that a PAD outside the vocabulary silently breaks training; name an existing
token with --pad (e.g. --pad "</s>" or "<unk>").
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

from fitlm.atomic import write_bytes_atomic
from fitlm.data.conventions import CONFIG_FILE as TOKENIZER_CONFIG_FILE
from fitlm.data.conventions import SIDE_FILES, read_json
from fitlm.data.errors import DataError
from fitlm.data.tokenizer import TOKENIZER_FILE, Tokenizer, tokenizer_out_path

_UNIGRAM, _BPE = 1, 2
_PIECE_TYPES = {1: "normal", 2: "unknown", 3: "control", 4: "user_defined", 5: "unused", 6: "byte"}


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7


def _fields(buf: bytes) -> list[tuple[int, int, Any]]:
    """(field number, wire type, value) of one protobuf message (values: int, bytes, or 4/8 raw bytes)."""
    out: list[tuple[int, int, Any]] = []
    i = 0
    v: Any  # int (varint) or bytes
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _varint(buf, i)
        elif wt == 1:
            v, i = buf[i : i + 8], i + 8
        elif wt == 2:
            n, i = _varint(buf, i)
            v, i = buf[i : i + n], i + n
        elif wt == 5:
            v, i = buf[i : i + 4], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wt}")
        out.append((num, wt, v))
    return out


def read_spm(path: Path) -> dict[str, Any]:
    """The fields of a SentencePiece ModelProto that conversion needs."""
    try:
        top = _fields(path.read_bytes())
        pieces = []
        trainer: dict[int, Any] = {}
        charsmap = b""
        add_dummy_prefix = True
        remove_extra_ws = True
        for num, _, v in top:
            if num == 1:  # SentencePiece {piece=1, score=2 (float), type=3}
                f = {n: val for n, _, val in _fields(v)}
                score = struct.unpack("<f", f[2])[0] if 2 in f else 0.0
                pieces.append((f.get(1, b"").decode("utf-8"), score, _PIECE_TYPES.get(f.get(3, 1), "normal")))
            elif num == 2:  # TrainerSpec
                trainer = {n: val for n, _, val in _fields(v)}
            elif num == 3:  # NormalizerSpec {name=1, precompiled_charsmap=2, add_dummy_prefix=3, remove_extra_ws=4}
                f = {n: val for n, _, val in _fields(v)}
                charsmap = f.get(2, b"")
                add_dummy_prefix = bool(f.get(3, 1))
                remove_extra_ws = bool(f.get(4, 1))
    except (ValueError, IndexError, UnicodeDecodeError, struct.error) as e:
        raise DataError(
            f"{path} is not a SentencePiece model ({e}); pass a .model file written by sentencepiece "
            "or a tokenizer.json"
        ) from None
    if not pieces:
        raise DataError(f"{path} holds no vocabulary pieces; it is not a SentencePiece model")
    return {
        "pieces": pieces,
        "model_type": trainer.get(3, _UNIGRAM),
        "byte_fallback": bool(trainer.get(35, 0)),
        "unk_id": trainer.get(40, 0),
        "charsmap": charsmap,
        "add_dummy_prefix": add_dummy_prefix,
        "remove_extra_whitespaces": remove_extra_ws,
    }


def spm_to_tokenizers(path: Path):
    """A `tokenizers.Tokenizer` equivalent to the SentencePiece Unigram model at `path`."""
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import Unigram

    spm = read_spm(path)
    if spm["model_type"] != _UNIGRAM:
        kind = {2: "BPE", 3: "word", 4: "char"}.get(spm["model_type"], str(spm["model_type"]))
        raise DataError(
            f"{path} is a SentencePiece {kind} model; fitlm converts only Unigram SentencePiece models. "
            "Convert it with transformers' convert_slow_tokenizer and pass the tokenizer.json, or "
            "train a byte-level BPE with `fitlm data tokenizer TEXT... --vocab-size N`"
        )
    vocab = [(p, s) for p, s, _ in spm["pieces"]]
    tok = HFTokenizer(Unigram(vocab, spm["unk_id"], spm["byte_fallback"]))
    norms: list[normalizers.Normalizer] = [normalizers.Precompiled(spm["charsmap"])] if spm["charsmap"] else []
    if spm["remove_extra_whitespaces"]:  # sentencepiece strips the ends and collapses runs of spaces
        norms += [normalizers.Strip(left=True, right=True), normalizers.Replace(Regex(" {2,}"), " ")]
    tok.normalizer = normalizers.Sequence(norms)
    scheme = "always" if spm["add_dummy_prefix"] else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    decs: list[decoders.Decoder] = [decoders.Replace("▁", " ")]
    if spm["byte_fallback"]:
        decs = [decoders.ByteFallback(), decoders.Fuse(), *decs]
    tok.decoder = decoders.Sequence([*decs, decoders.Strip(" ", 1, 0)] if scheme == "always" else decs)
    tok.add_special_tokens(
        [AddedToken(p, special=True, normalized=False) for p, _, t in spm["pieces"] if t in ("control", "unknown")]
    )
    return tok, spm


def import_tokenizer(
    src: Path,
    out_path: Path,
    overwrite: bool = False,
    bos: str | None = None,
    eos: str | None = None,
    pad: str | None = None,
) -> Path:
    """Copy or convert the tokenizer at `src` into `out_path` (a tokenizer.json path or a directory)."""
    src = Path(src)
    json_path = tokenizer_out_path(Path(out_path))
    if json_path.exists() and not overwrite:
        raise DataError(f"{json_path} already exists; choose another output path or pass --overwrite to replace it")
    names: dict[str, str] = {}
    if src.suffix == ".json" or (src.is_dir() and (src / TOKENIZER_FILE).is_file()):
        json_src = src / TOKENIZER_FILE if src.is_dir() else src
        cfg = read_json(json_src.with_name(TOKENIZER_CONFIG_FILE))
        src_tok = Tokenizer.from_file(json_src, bos=bos, eos=eos, pad=pad)  # refuses one without the specials
        if src_tok.fitlm_convention and cfg.get("created_by") != "fitlm":
            # A bare tokenizer.json follows fitlm's convention; the config written below must say so explicitly.
            cfg = {"add_bos_token": src_tok.add_bos, **{f"{k}_token": v for k, v in src_tok.special_tokens.items()}}
        json_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(json_src, json_path)
        for name in SIDE_FILES:  # the model's conventions (EOS list, chat template) travel with it
            if (
                name != TOKENIZER_CONFIG_FILE
                and json_src.with_name(name).is_file()
                and json_src.with_name(name).resolve() != json_path.with_name(name).resolve()
            ):
                shutil.copyfile(json_src.with_name(name), json_path.with_name(name))
    else:
        tok, spm = spm_to_tokenizers(src)
        have = {p for p, _, _ in spm["pieces"]}
        defaults = {"bos": "<s>", "eos": "</s>", "pad": "<pad>"}
        json_path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(json_path, tok.to_str(pretty=True).encode("utf-8"))
        for k, given in (("bos", bos), ("eos", eos), ("pad", pad)):
            if given is None and defaults[k] not in have:
                json_path.unlink()
                raise DataError(
                    f"{src} has no {k.upper()} token {defaults[k]!r}; PAD/BOS/EOS must be real tokens of "
                    f'the vocabulary. Name an existing token with --{k} (e.g. --{k} "</s>")'
                )
        names = {k: given or defaults[k] for k, given in (("bos", bos), ("eos", eos), ("pad", pad))}
        cfg = {"add_bos_token": True}  # Llama-style SentencePiece models put BOS before every text
    given_names = {k: v for k, v in (("bos", bos), ("eos", eos), ("pad", pad)) if v}
    merged = {**cfg, **{f"{k}_token": v for k, v in {**names, **given_names}.items()}}
    merged.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    merged["imported_by"] = "fitlm"
    write_bytes_atomic(json_path.with_name(TOKENIZER_CONFIG_FILE), json.dumps(merged, indent=2).encode("utf-8"))
    try:
        Tokenizer.from_file(json_path)
    except DataError:
        json_path.unlink(missing_ok=True)
        json_path.with_name(TOKENIZER_CONFIG_FILE).unlink(missing_ok=True)
        raise
    return json_path


def is_tokenizer_file(path: Path) -> bool:
    """True for a tokenizer.json or SentencePiece .model (inputs that are imported, not trained on)."""
    return (
        path.suffix in (".model",)
        or path.name == TOKENIZER_FILE
        or (path.is_dir() and (path / TOKENIZER_FILE).is_file())
    )
