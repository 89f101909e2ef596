"""What a model's tokenizer files say about BOS, EOS, PAD, stop tokens and the chat template.

Hugging Face spreads a tokenizer's conventions over several files beside tokenizer.json; fitlm reads
them so that its encodings follow the model instead of one fixed rule:

    tokenizer_config.json    bos_token / eos_token / pad_token (a string, {"content": ...}, or null = none),
                             add_bos_token / add_eos_token, chat_template (a string or [{name, template}])
    special_tokens_map.json  the same token names (written by older transformers)
    generation_config.json   bos/eos/pad_token_id; eos_token_id may be a list: every id generation stops at
    chat_template.jinja      the chat template (what transformers writes now)
    tokenizer.json           its post-processor, when it inserts BOS itself (Llama 3's TemplateProcessing)

BOS is added when the tokenizer.json post-processor inserts it (what transformers 5 follows; fitlm then
does not add a second one) or tokenizer_config.json has add_bos_token: true (what transformers 4's
Llama-family classes and llama.cpp follow); real models state both. fitlm's own convention (BOS before
every text; names <|bos|> <|eos|> <|pad|> unless given) applies to tokenizers trained by `fitlm data tokenizer`
(created_by: fitlm) and to a bare
tokenizer.json with neither tokenizer_config.json nor special_tokens_map.json beside it.
A model that names no PAD token (Llama 3, ...) pads with EOS: padded positions never reach the loss, so
PAD only has to be a real token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from fitlm.data.errors import DataError

CONFIG_FILE = "tokenizer_config.json"
SPECIALS_MAP_FILE = "special_tokens_map.json"
GENERATION_FILE = "generation_config.json"
TEMPLATE_FILE = "chat_template.jinja"
# The files beside tokenizer.json that carry conventions; they travel with it (packed data, model dirs).
SIDE_FILES = (CONFIG_FILE, SPECIALS_MAP_FILE, GENERATION_FILE, TEMPLATE_FILE)
# The three control tokens every fitlm-trained tokenizer carries (ids 0, 1, 2). Declared here once.
SPECIAL_TOKENS: dict[str, str] = {"bos": "<|bos|>", "eos": "<|eos|>", "pad": "<|pad|>"}
# End-of-turn tokens of common chat formats (ChatML, Llama 3, Phi-3, Gemma, GPT-2 style). Generation also
# stops at them when the tokenizer has them as special tokens, even where no file lists them.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


@dataclass(frozen=True)
class Conventions:
    """Token names and rules of one tokenizer; `stops` lists the tokens generation ends at, EOS first."""

    bos: str | None
    eos: str
    pad: str
    add_bos: bool
    stops: tuple[str, ...]
    fitlm_convention: bool


def read_json(path: Path, what: str = "") -> dict[str, Any]:
    """A JSON object file, {} when absent; a broken one is an error: it would silently change the conventions."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON ({e}); fix or delete it{what}") from None
    if not isinstance(data, dict):
        raise DataError(f"{path} must hold a JSON object, not {type(data).__name__}; fix or delete it{what}")
    return data


def _token_name(cfg: dict, key: str, path: Path) -> str | None:
    # HF stores a token as a string, as {"content": "<s>", ...} (an AddedToken), or null for "none".
    value = cfg.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise DataError(f'{path}: {key} must be a token string, {{"content": ...}} or null, got {value!r}')
    return value


def _id_list(gen: dict, key: str, path: Path, vocab_rows: int) -> list[int]:
    value = gen.get(key)
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_rows for i in ids):
        raise DataError(
            f"{path}: {key} must be a token id or a list of token ids below the vocabulary size "
            f"{vocab_rows}, got {value!r}; fix it or delete the key"
        )
    return ids


def post_processor_wrap(backend: tokenizers.Tokenizer) -> tuple[list[int], list[int]]:
    """(ids before, ids after) the text that the tokenizer.json post-processor adds to a single sequence."""
    # Asking the post-processor itself covers every processor type (TemplateProcessing, Roberta, Sequence...).
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i], full[i + len(plain) :]
    return [], []


def read_conventions(json_path: Path, backend: tokenizers.Tokenizer, given: dict[str, str | None]) -> Conventions:
    """The conventions of the tokenizer.json at `json_path`; `given` names (not None) win over the files."""
    folder = json_path.parent
    cfg_path, map_path, gen_path = folder / CONFIG_FILE, folder / SPECIALS_MAP_FILE, folder / GENERATION_FILE
    cfg, smap, gen = read_json(cfg_path), read_json(map_path), read_json(gen_path)
    fitlm_style = cfg.get("created_by") == "fitlm" or not (cfg_path.is_file() or map_path.is_file())
    vocab_rows = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    gen_ids = {k: _id_list(gen, f"{k}_token_id", gen_path, vocab_rows) for k in ("bos", "eos", "pad")}
    before = post_processor_wrap(backend)[0]  # what it appends (add_eos) is never put on a prompt
    if len(before) > 1:
        raise DataError(
            f"{json_path}: its post_processor puts {len(before)} tokens before each text; fitlm adds "
            f"at most one (BOS). Use a tokenizer.json whose post_processor adds BOS only (or nothing)"
        )

    def name(key: str) -> str | None:
        if given.get(key):
            return given[key]
        for source, path in ((cfg, cfg_path), (smap, map_path)):
            if f"{key}_token" in source:
                return _token_name(source, f"{key}_token", path)
        if gen_ids[key]:
            return backend.id_to_token(gen_ids[key][0])
        if key == "bos" and before:
            return backend.id_to_token(before[0])
        return SPECIAL_TOKENS[key] if fitlm_style else None

    bos, eos, pad = name("bos"), name("eos"), name("pad")
    if eos is None:
        raise DataError(
            f"{json_path}: no EOS token is named by {cfg_path.name} (eos_token), {map_path.name} or "
            f'{gen_path.name} (eos_token_id); add "eos_token": "..." to {cfg_path} or name one with '
            f"--eos (`fitlm data tokenizer TOKENIZER --eos TOKEN --out DIR`)"
        )
    pad = pad or eos  # documented fallback: PAD positions are masked out, any real token will do
    if before and before[0] != backend.token_to_id(bos or ""):
        raise DataError(
            f"{json_path}: its post_processor adds {backend.id_to_token(before[0])!r} before each text "
            f"but bos_token is {bos!r}; make {cfg_path.name}'s bos_token that token"
        )
    # BOS when the post-processor inserts it (all transformers 5 looks at) or add_bos_token says so (what
    # transformers 4's Llama-family classes and llama.cpp follow); real models state both. No BOS token, no BOS.
    add_bos = bos is not None and (fitlm_style or bool(before) or cfg.get("add_bos_token") is True)
    stops = [eos, *(backend.id_to_token(i) for i in gen_ids["eos"])]
    specials = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    stops += [t for t in END_OF_TURN if t in specials]
    return Conventions(bos, eos, pad, add_bos, tuple(dict.fromkeys(s for s in stops if s)), fitlm_style)


def _config_template(cfg: dict, path: Path) -> str | None:
    tmpl = cfg.get("chat_template")
    if isinstance(tmpl, list):  # HF allows [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        if not isinstance(named.get("default"), str):
            raise DataError(
                f'{path}: chat_template is a list without a "default" entry (it has '
                f"{', '.join(map(str, named)) or 'none'}); add one, or pass --template with a .jinja file"
            )
        return named["default"]
    if tmpl is not None and not isinstance(tmpl, str):
        raise DataError(
            f'{path}: chat_template must be a string or a list of {{"name", "template"}}, got '
            f"{type(tmpl).__name__}; fix it or pass --template"
        )
    return tmpl


def model_chat_template(folder: Path) -> tuple[str, str] | None:
    """(where, Jinja source) of the model's own chat template in `folder`: chat_template.jinja, else
    tokenizer_config.json's chat_template; None when it has neither."""
    jinja = folder / TEMPLATE_FILE
    if jinja.is_file():
        return str(jinja), jinja.read_text(encoding="utf-8")
    cfg_path = folder / CONFIG_FILE
    tmpl = _config_template(read_json(cfg_path), cfg_path)
    return (str(cfg_path), tmpl) if tmpl else None


def config_chat_template(path: Path) -> str:
    """The chat_template of a tokenizer_config.json passed as --template; an error when it has none."""
    tmpl = _config_template(read_json(path, " or pass --template NAME"), path)
    if not path.is_file() or not tmpl:
        raise DataError(f"{path} has no string chat_template; pass --template with a built-in or a .jinja file")
    return tmpl


__all__ = [
    "CONFIG_FILE",
    "Conventions",
    "END_OF_TURN",
    "GENERATION_FILE",
    "SIDE_FILES",
    "SPECIAL_TOKENS",
    "SPECIALS_MAP_FILE",
    "TEMPLATE_FILE",
    "config_chat_template",
    "model_chat_template",
    "post_processor_wrap",
    "read_conventions",
    "read_json",
]
