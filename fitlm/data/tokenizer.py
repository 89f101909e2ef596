"""Byte-level BPE tokenizer: training (`train_tokenizer`) and the `Tokenizer` wrapper the rest of fitlm uses.

The file on disk is a plain Hugging Face `tokenizer.json` (plus a `tokenizer_config.json` naming the
special tokens), so `transformers.AutoTokenizer` and llama.cpp-style exporters can read it unchanged.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from fitlm.atomic import write_bytes_atomic
from fitlm.data.errors import DataError

# The three control tokens every fitlm tokenizer carries. Declared here once; everything else imports it.
SPECIAL_TOKENS: dict[str, str] = {"bos": "<|bos|>", "eos": "<|eos|>", "pad": "<|pad|>"}

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_BYTE_ALPHABET = 256  # byte-level BPE starts from one symbol per byte value


def min_vocab_size() -> int:
    """Smallest vocabulary a byte-level BPE with our specials can have: 256 bytes + the special tokens."""
    return _BYTE_ALPHABET + len(SPECIAL_TOKENS)


def _resolve_out(out_path: Path) -> Path:
    """`out_path` may name the tokenizer.json itself or a directory to hold it."""
    out_path = Path(out_path)
    return out_path if out_path.suffix == ".json" else out_path / TOKENIZER_FILE


def train_tokenizer(
    files: Sequence[Path | str],
    vocab_size: int,
    out_path: Path | str,
    min_frequency: int = 2,
    show_progress: bool = False,
    overwrite: bool = False,
) -> Path:
    """Train a byte-level BPE on `files` (.txt / .jsonl files or directories of them); return the tokenizer.json path.

    Special tokens get ids 0, 1, 2 (bos, eos, pad). The initial alphabet holds all 256 bytes, so any text
    encodes without an unknown token. Files are streamed document by document, never read whole.
    """
    # Imported here because pack.py imports this module; the text readers live with the packer.
    from fitlm.data.sources import expand_inputs, iter_documents

    if not files:
        raise DataError("no input files to train the tokenizer on: pass one or more .txt/.jsonl files or directories")
    floor = min_vocab_size()
    if vocab_size < floor:
        raise DataError(
            f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least {floor} "
            f"({_BYTE_ALPHABET} byte symbols + {len(SPECIAL_TOKENS)} special tokens); pass --vocab-size {floor} or more"
        )
    if min_frequency < 1:
        raise DataError(f"--min-frequency must be at least 1 (got {min_frequency})")
    paths = expand_inputs(files)
    json_path = _resolve_out(Path(out_path))
    if json_path.exists() and not overwrite:
        raise DataError(f"{json_path} already exists; choose another output path or pass --overwrite to replace it")

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps character offsets exact; the post-processor adds no tokens.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS.values()),  # listed first, so they take ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    seen = {"docs": 0}

    def texts() -> Iterable[str]:
        for doc in iter_documents(paths):
            if doc.text:  # empty documents only carry progress information
                seen["docs"] += 1
                yield doc.text

    tok.train_from_iterator(texts(), trainer=trainer)
    if seen["docs"] == 0:
        names = ", ".join(str(p) for p in paths)
        raise DataError(f"empty corpus: {names} contain(s) no text (only whitespace or nothing); "
                        "pass files that hold the text to train on")
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS.values()]
    assert ids == [0, 1, 2], f"special tokens got ids {ids}, expected [0, 1, 2]"  # a tokenizers behaviour change

    json_path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(json_path, tok.to_str(pretty=True).encode("utf-8"))
    write_bytes_atomic(json_path.with_name(TOKENIZER_CONFIG_FILE), json.dumps(_hf_config(), indent=2).encode("utf-8"))
    return json_path


def _hf_config() -> dict:
    """tokenizer_config.json that lets transformers' AutoTokenizer load the tokenizer with the right specials."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS["bos"],
        "eos_token": SPECIAL_TOKENS["eos"],
        "pad_token": SPECIAL_TOKENS["pad"],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "created_by": "fitlm",
    }


def _config_token(cfg: dict, key: str) -> str | None:
    # HF configs store a token either as a string or as {"content": "<s>", ...}.
    value = cfg.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """A loaded tokenizer.json with fitlm's BOS/EOS/PAD conventions. Build it with `Tokenizer.from_file`."""

    def __init__(self, backend: tokenizers.Tokenizer, path: Path, names: dict[str, str], sha256: str):
        self._tok = backend
        self.path = path
        self.sha256 = sha256
        self.special_tokens = dict(names)
        self.bos_id: int = backend.token_to_id(names["bos"])
        self.eos_id: int = backend.token_to_id(names["eos"])
        self.pad_id: int = backend.token_to_id(names["pad"])
        # Embedding rows needed = largest id + 1 (a foreign vocab may have holes, so not len(vocab)).
        self.vocab_size: int = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        # Special-token strings inside data are encoded as plain text, so a document that happens to
        # contain "<|eos|>" cannot forge a document boundary. Control ids are added only by add_bos/add_eos.
        self._tok.encode_special_tokens = True

    @classmethod
    def from_file(cls, path: Path | str, bos: str | None = None, eos: str | None = None,
                  pad: str | None = None) -> Tokenizer:
        """Load a tokenizer.json (or a directory holding one) and check it has BOS, EOS and PAD.

        Token names come from the arguments, else from a tokenizer_config.json beside the file, else
        SPECIAL_TOKENS.
        """
        path = Path(path)
        json_path = path / TOKENIZER_FILE if path.is_dir() else path
        if not json_path.is_file():
            where = f"no {TOKENIZER_FILE} in directory {path}" if path.is_dir() else f"tokenizer file {path} does not exist"
            raise DataError(f"{where}; train one with `fitlm data tokenizer` or pass the path of a tokenizer.json")
        raw = json_path.read_bytes()
        try:
            backend = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise DataError(f"{json_path} is not a valid tokenizer.json ({e}); "
                            "re-create it with `fitlm data tokenizer`") from None
        cfg = {}
        cfg_path = json_path.with_name(TOKENIZER_CONFIG_FILE)
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError):
                cfg = {}  # a broken HF side file must not block loading; the checks below still apply
        given = {"bos": bos, "eos": eos, "pad": pad}
        names = {k: given[k] or _config_token(cfg, f"{k}_token") or SPECIAL_TOKENS[k] for k in SPECIAL_TOKENS}
        missing = [f"{k.upper()} {v!r}" for k, v in names.items() if backend.token_to_id(v) is None]
        if missing:
            raise DataError(
                f"tokenizer {json_path} lacks the special token(s) {', '.join(missing)}; fitlm needs BOS, EOS "
                f"and PAD in the vocabulary. Fix: retrain it with `fitlm data tokenizer` (which adds "
                f"{', '.join(SPECIAL_TOKENS.values())}), add the missing token(s) to its added_tokens, or name "
                f"tokens it already has with bos=/eos=/pad= (e.g. pad='</s>')"
            )
        return cls(backend, json_path, names, hashlib.sha256(raw).hexdigest())

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of `text`; BOS/EOS are added only when asked (the tokenizer itself adds none)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return self._wrap(ids, add_bos, add_eos)

    def encode_batch(self, texts: Sequence[str], add_bos: bool = False, add_eos: bool = False) -> list[list[int]]:
        """Encode many texts at once (in parallel inside tokenizers)."""
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [self._wrap(e.ids, add_bos, add_eos) for e in encodings]

    def _wrap(self, ids: list[int], add_bos: bool, add_eos: bool) -> list[int]:
        if add_bos:
            ids = [self.bos_id, *ids]
        if add_eos:
            ids = [*ids, self.eos_id]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (a list, numpy array or tensor); special tokens dropped unless asked for."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def copy_to(self, directory: Path) -> list[Path]:
        """Copy tokenizer.json (and tokenizer_config.json when present) byte for byte into `directory`."""
        directory.mkdir(parents=True, exist_ok=True)
        out = [directory / TOKENIZER_FILE]
        shutil.copyfile(self.path, out[0])
        cfg = self.path.with_name(TOKENIZER_CONFIG_FILE)
        if cfg.is_file():
            out.append(directory / TOKENIZER_CONFIG_FILE)
            shutil.copyfile(cfg, out[-1])
        return out

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, sha256={self.sha256[:12]})"
