"""`fitlm data tokenizer`: train a byte-level BPE on text files, locally or with Ray Data reading the files.

The result is a plain Hugging Face tokenizer.json plus a tokenizer_config.json naming the special tokens
(fitlm.data.tokenizer reads both)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from fitlm.atomic import write_bytes_atomic
from fitlm.data.conventions import CONFIG_FILE as TOKENIZER_CONFIG_FILE
from fitlm.data.conventions import SPECIAL_TOKENS
from fitlm.data.errors import DataError
from fitlm.data.prep.ray_session import check_engine
from fitlm.data.prep.sources import expand_inputs, iter_documents
from fitlm.data.tokenizer import tokenizer_out_path

_BYTE_ALPHABET = 256  # byte-level BPE starts from one symbol per byte value


def min_vocab_size() -> int:
    """Smallest vocabulary a byte-level BPE with our specials can have: 256 bytes + the special tokens."""
    return _BYTE_ALPHABET + len(SPECIAL_TOKENS)


def train_tokenizer(
    files: Sequence[Path | str],
    vocab_size: int,
    out_path: Path | str,
    min_frequency: int = 2,
    show_progress: bool = False,
    overwrite: bool = False,
    engine: str = "local",
    ray_address: str | None = None,
) -> Path:
    """Train a byte-level BPE on `files` (.txt / .jsonl files or directories of them); return the tokenizer.json path.

    Special tokens get ids 0, 1, 2 (bos, eos, pad). The initial alphabet holds all 256 bytes, so any text
    encodes without an unknown token. Files are streamed document by document, never read whole.
    engine "ray": Ray Data reads the files in parallel and streams the documents, in input order, to
    the trainer here (BPE merges are learned in one place), so the tokenizer is the local engine's.
    """
    check_engine(engine)
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
    json_path = tokenizer_out_path(Path(out_path))
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

    if engine == "ray":
        from fitlm.data.prep.ray_read import ray_texts

        with ray_texts(paths, ray_address, show_progress) as stream:
            tok.train_from_iterator(_counted(stream, seen), trainer=trainer)
    else:
        tok.train_from_iterator(texts(), trainer=trainer)
    if seen["docs"] == 0:
        names = ", ".join(str(p) for p in paths)
        raise DataError(
            f"empty corpus: {names} contain(s) no text (only whitespace or nothing); "
            "pass files that hold the text to train on"
        )
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS.values()]
    assert ids == [0, 1, 2], f"special tokens got ids {ids}, expected [0, 1, 2]"  # a tokenizers behaviour change

    json_path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(json_path, tok.to_str(pretty=True).encode("utf-8"))
    write_bytes_atomic(json_path.with_name(TOKENIZER_CONFIG_FILE), json.dumps(_hf_config(), indent=2).encode("utf-8"))
    return json_path


def _counted(texts: Iterable[str], seen: dict[str, int]) -> Iterable[str]:
    for t in texts:
        seen["docs"] += 1
        yield t


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


__all__ = ["min_vocab_size", "train_tokenizer"]
