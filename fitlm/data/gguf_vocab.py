"""A tokenizer as llama.cpp names it: `tokenizer.ggml.model` (the vocabulary kind) and `tokenizer.ggml.pre` (the
split rule of a byte-level BPE), for `fitlm export --format gguf`; and the split rule of a name, for the import.

llama.cpp does not read a tokenizer.json: it knows a fixed set of split rules by name (src/llama-vocab.cpp) and
refuses a file whose name it does not know ("unknown pre-tokenizer type"). Its converter (convert_hf_to_gguf.py,
get_vocab_base_pre) encodes a check text with the model's tokenizer and looks the sha256 of the ids up in a table of
known checkpoints. fitlm does the same, in two steps:

1. the same hash, over the same check text, against the converter's table (`KNOWN_CHECKPOINTS`): a real
   checkpoint of a known model gets exactly the name llama.cpp's own converter writes;
2. otherwise, how the tokenizer's normalizer and pre-tokenizer split the check text, against how each rule of
   `RULES` splits it. This does not depend on the vocabulary, so a tokenizer trained from scratch with a
   family's rule (fitlm's own BPE, a tiny test tokenizer, a fine-tune's extended vocabulary) is named too.

A tokenizer that neither step names is refused (`UnnamedTokenizer`): llama.cpp would refuse the file, or worse,
split text with a rule the model was not trained with. SentencePiece-style vocabularies (Llama 2, Mistral v0.x,
Gemma, Phi-3: BPE with byte fallback over "▁"-spaced text) are llama.cpp's "llama" kind, which has no split rule.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from fitlm.data.errors import DataError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # gguf.TokenType
BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a SentencePiece byte-fallback token

# The check text of llama.cpp's converter (convert_hf_to_gguf.py, get_vocab_base_pre), character for character:
# whitespace runs, emoji sequences, digit runs, Khmer, Chinese, Cyrillic, punctuation runs and contractions.
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ "
    "🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE "
    "you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)

# sha256(str(ids of CHECK_TEXT)) -> name, for the checkpoints llama.cpp's converter knows (its table, the names
# that llama.cpp's loader accepts). The ids are those of the checkpoint's own vocabulary, so only that
# vocabulary (or one extended past its end) matches.
KNOWN_CHECKPOINTS: dict[str, str] = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Meta-Llama-3-8B
    "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754": "deepseek-llm",  # deepseek-llm-7b-base
    "347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821": "deepseek-coder",  # deepseek-coder-6.7b
    "8aeee3860c56296a157a1fe2fad249ec40aa59b1bb5709f4ade11c4e6fe652ed": "falcon",  # falcon-7b
    "9d032fcbd5501f4a38150912590928bfb36091efb5df11b8e2124b0390e3fb1e": "falcon3",  # Falcon3-7B-Base
    "b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166": "mpt",  # mpt-7b (and OLMo 1.7)
    "35d91631860c815f952d711435f48d356ebac988362536bed955d43bfa436e34": "starcoder",  # starcoder2-3b
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",  # openai-community/gpt2
    "32d85c31273f8019248f2559fed492d929ea28b17e51d81d3bb36fff23ca72b3": "stablelm2",  # stablelm-2-zephyr-1_6b
    "6221ad2852e85ce96f791f476e0b390cf9b474c9e3d1362f53a24a06dc8220ff": "refact",  # Refact-1_6-base
    "9c2227e4dd922002fb81bde4fc02b0483ca4f12911410dee2255e4987644e3f8": "command-r",  # c4ai-command-r-v01
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5-7B (Qwen2, 2.5, 3)
    "a8594e3edff7c29c003940395316294b2c623e09894deebbc65f33f1515df79e": "dbrx",  # dbrx-base
    "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d": "smaug-bpe",  # Smaug-Llama-3-70B
    "c7ea5862a53e4272c035c8238367063e2b270d51faa48c0f09e9d5b54746c360": "poro-chat",  # Poro-34B-chat
    "7fc505bd3104ca1083b150b17d088b59534ede9bde81f0dd2090967d7fe52cee": "viking",  # Viking-7B
    "b53802fb28e26d645c3a310b34bfe07da813026ec7c7716883404d5e0f8b1901": "jais",  # jais-13b
    "7b3e7548e4308f52a76e8229e4e6cc831195d0d1df43aed21ac6c93da05fec5f": "codeshell",  # CodeShell-7B
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",  # Mistral-Nemo-Base-2407
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM-135M (and SmolLM2)
    "3c30d3ad1d6b64202cd222813e7736c2db6e1bd6d67197090fc1211fbc612ae7": "bloom",  # bloom
    "bc01ce58980e1db43859146dc51b1758b3b88729b217a74792e9f8d43e479d21": "gpt3-finnish",  # gpt3-finnish-small
    "4e2b24cc4770243d65a2c9ec19770a72f08cffc161adbb73fcbb6b7dd45a0aae": "exaone",  # EXAONE-3.0-7.8B-Instruct
    "fcace8b9cac38ce847670c970cd5892031a753a1ef381abd1d9af00f713da085": "phi-2",  # microsoft/phi-2
    "60824e3c0d9401f89943cbb2fff727f0e2d4c545ba4df2d6e4f09a6db0f5b450": "chameleon",  # chameleon-7b
    "ad851be1dba641f2e3711822f816db2c265f788b37c63b4e1aeacb9ee92de8eb": "gigachat",  # GigaChat-20B-A3B
    "d4c8f286ea6b520b3d495c4455483cfa2302c0cfcd4be05d781b6a8a0a7cdaf1": "megrez",  # Megrez-3B-Instruct
    "877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5": "deepseek-v3",  # DeepSeek-V3
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": "deepseek-r1-qwen",  # R1-Distill-Qwen
    "ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e": "gpt-4o",  # Xenova/gpt-4o
    "b6e8e1518dc4305be2fe39c313ed643381c4da5db34a98f6a04c093f8afbe99b": "chatglm-bpe",  # glm-4-9b-chat
    "81d72c7348a9f0ebe86f23298d37debe0a5e71149e29bd283904c02262b27516": "chatglm-bpe",  # glm-4-9b-chat
    "1431a23e583c97432bc230bff598d103ddb5a1f89960c8f1d1051aaa944d0b35": "minerva-7b",  # Minerva-7B-base-v1.0
}

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
    r"|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    rf"{_CONTRACTIONS}?|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_DEEPSEEK_LETTERS = (
    "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄ"
    "ῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ"
    "\U00010400-\U0001044f𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃"
)
_DEEPSEEK_LLM = (
    "[\r\n]",
    rf"\s?[{_DEEPSEEK_LETTERS}]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    "[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
)
_DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}")


def _split(regex: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def _byte_level(own_regex: bool) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": own_regex}


def _splits(*regexes: str) -> dict[str, Any]:
    """Split by each regex in turn, then map bytes to ByteLevel's characters (how these tokenizer.json files read)."""
    return {"type": "Sequence", "pretokenizers": [*map(_split, regexes), _byte_level(False)]}


@dataclass(frozen=True)
class Rule:
    """One split rule: its llama.cpp name, its pre-tokenizer and normalizer as tokenizer.json writes them."""

    name: str
    pre_tokenizer: dict[str, Any]
    normalizer: dict[str, Any] | None = None
    aliases: tuple[str, ...] = ()  # other llama.cpp names with the same split (llama-vocab.cpp: same regexes)


# In the order names are given when two rules split the check text alike (none of these do).
RULES: tuple[Rule, ...] = (
    Rule(
        "llama-bpe",
        _splits(_LLAMA3),
        aliases=("llama3", "llama-v3", "falcon3", "pixtral", "dbrx", "smaug-bpe", "chatglm-bpe", "glm4"),
    ),
    Rule("qwen2", _splits(_QWEN2), {"type": "NFC"}, aliases=("deepseek-r1-qwen", "megrez", "stablelm2")),
    Rule(
        "smollm",
        {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _byte_level(True)]},
        aliases=("starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
    ),
    Rule("gpt-2", _byte_level(True), aliases=("gpt2", "default", "phi-2", "mpt", "olmo", "jais", "gigachat")),
    Rule("tekken", _splits(_TEKKEN)),
    Rule("deepseek-v3", _splits(*_DEEPSEEK3)),
    Rule("deepseek-llm", _splits(*_DEEPSEEK_LLM)),
    Rule("deepseek-coder", _splits(*_DEEPSEEK_CODER)),
    Rule("gpt-4o", _splits(_GPT4O), aliases=("llama4",)),
)
_BY_NAME = {n: r for r in RULES for n in (r.name, *r.aliases)}
# Names for which llama.cpp takes a piece that is a whole token as is, before merging (llama-vocab.cpp's
# ignore_merges; Llama 3's and Mistral Nemo's tokenizer.json say "ignore_merges": true).
IGNORE_MERGES = frozenset({"llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "tekken"})


class UnnamedTokenizer(DataError):
    """A tokenizer whose split rule llama.cpp has no name for, or whose vocabulary kind it does not read."""


def rule(name: str) -> Rule | None:
    """The split rule of a tokenizer.ggml.pre name (aliases included), or None for one fitlm does not reproduce."""
    return _BY_NAME.get(name)


def known_names() -> list[str]:
    return [n for r in RULES for n in (r.name, *r.aliases)]


def _rule_tokenizer(spec: dict[str, Any]):
    """A `tokenizers.Tokenizer` with an empty vocabulary and `spec`'s normalizer and pre-tokenizer."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(
        json.dumps(
            {
                "version": "1.0",
                "added_tokens": [],
                "normalizer": spec.get("normalizer"),
                "pre_tokenizer": spec.get("pre_tokenizer"),
                "post_processor": None,
                "decoder": None,
                "model": {"type": "BPE", "vocab": {}, "merges": []},
            }
        )
    )


def pieces(backend, text: str = CHECK_TEXT) -> list[str]:
    """How `backend` (a tokenizers.Tokenizer) cuts `text` before its model sees it: normalizer, then pre-tokenizer."""
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    if backend.pre_tokenizer is None:
        return [text]
    return [p for p, _ in backend.pre_tokenizer.pre_tokenize_str(text)]


@functools.cache  # the rules are constants: split the check text once per process
def _rule_pieces() -> dict[str, list[str]]:
    return {
        r.name: pieces(_rule_tokenizer({"normalizer": r.normalizer, "pre_tokenizer": r.pre_tokenizer})) for r in RULES
    }


def checkpoint_hash(ids: list[int]) -> str:
    """The converter's fingerprint of a vocabulary: sha256 of the printed list of CHECK_TEXT's ids."""
    return hashlib.sha256(str(ids).encode()).hexdigest()


def is_sentencepiece(spec: dict[str, Any]) -> bool:
    """A tokenizer.json of the SentencePiece kind (llama.cpp's "llama"): BPE with byte fallback over "▁" spaces."""
    text = json.dumps([spec.get("normalizer"), spec.get("pre_tokenizer")], ensure_ascii=False)
    model = spec.get("model") or {}
    return model.get("type") == "BPE" and bool(model.get("byte_fallback")) and "▁" in text


def _has_byte_level(spec: dict[str, Any]) -> bool:
    return '"ByteLevel"' in json.dumps(spec.get("pre_tokenizer"))


def add_space_prefix(spec: dict[str, Any]) -> bool:
    """Whether a SentencePiece-kind tokenizer.json puts "▁" before a text (Llama 2, Mistral, Phi-3; not Gemma)."""

    def walk(node) -> bool:
        if isinstance(node, dict):
            if node.get("type") == "Metaspace":
                return (
                    node.get("prepend_scheme", "always" if node.get("add_prefix_space", True) else "never") != "never"
                )
            if node.get("type") == "Prepend":
                return node.get("prepend") == "▁"
            return any(walk(v) for v in node.values())
        if isinstance(node, list):
            return any(walk(v) for v in node)
        return False

    return walk([spec.get("normalizer"), spec.get("pre_tokenizer")])


def pre_tokenizer_name(backend, check_ids: list[list[int]], source: str) -> str:
    """tokenizer.ggml.pre for the byte-level BPE `backend`: the converter's name of a known checkpoint (any of
    `check_ids`, CHECK_TEXT's ids with and without the model's BOS), else the rule that splits CHECK_TEXT alike."""
    spec = json.loads(backend.to_str())
    if (spec.get("model") or {}).get("type") != "BPE" or not _has_byte_level(spec):
        raise UnnamedTokenizer(
            f"{source}: llama.cpp reads byte-level BPE (its 'gpt2' vocabulary) and SentencePiece "
            f"BPE ('llama'); this tokenizer is {(spec.get('model') or {}).get('type')!r} without "
            "either; export with --format hf, or with --no-tokenizer to write the weights alone"
        )
    for ids in check_ids:
        name = KNOWN_CHECKPOINTS.get(checkpoint_hash(ids))
        if name is not None:
            return name
    mine = pieces(backend)
    for name, theirs in _rule_pieces().items():
        if mine == theirs:
            return name
    raise UnnamedTokenizer(
        f"{source}: its pre-tokenizer splits text as none of llama.cpp's rules that fitlm names "
        f"({', '.join(r.name for r in RULES)}), and its vocabulary is no checkpoint llama.cpp's converter knows. "
        "llama.cpp would refuse the file or split text differently from training. Export with --format hf, or with "
        "--no-tokenizer to write the weights alone (llama.cpp then loads it with tokenizer.ggml.model 'none')"
    )


def rule_tokenizer_json(name: str) -> dict[str, Any] | None:
    """The normalizer and pre-tokenizer (tokenizer.json form) of the rule named `name`, or None."""
    r = rule(name)
    return None if r is None else {"normalizer": r.normalizer, "pre_tokenizer": r.pre_tokenizer}


__all__ = [
    "BYTE",
    "BYTE_PIECE",
    "CHECK_TEXT",
    "CONTROL",
    "NORMAL",
    "UNKNOWN",
    "UNUSED",
    "USER_DEFINED",
    "IGNORE_MERGES",
    "KNOWN_CHECKPOINTS",
    "RULES",
    "Rule",
    "UnnamedTokenizer",
    "add_space_prefix",
    "checkpoint_hash",
    "is_sentencepiece",
    "known_names",
    "pieces",
    "pre_tokenizer_name",
    "rule",
    "rule_tokenizer_json",
]
