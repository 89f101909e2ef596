"""Text in, text out: load a model directory and its tokenizer, generate, decode (with streaming)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from fitlm.data.tokenizer import Tokenizer
from fitlm.infer.generate import check_prompt, check_sampling, generate
from fitlm.models.io import LoadedModel, ModelDirError, load_model_dir


class StreamDecoder:
    """Turns a growing token list into text pieces; holds back an incomplete UTF-8 character.

    Byte-level BPE can split one character over several tokens, so decoding token by token would
    print replacement characters; decoding the whole tail and emitting the new suffix does not.
    """

    def __init__(self, tokenizer: Tokenizer, emit: Callable[[str], None]):
        self.tokenizer, self.emit = tokenizer, emit
        self.ids: list[int] = []
        self.sent = ""

    def __call__(self, token_id: int) -> None:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        self.emit(text[len(self.sent) :])
        self.sent = text


def _gguf_tokenizer(path) -> Tokenizer:
    """The tokenizer stored in a GGUF file, converted as `fitlm import` converts it (in a scratch directory)."""
    import tempfile

    from fitlm.data.gguf_tokenizer import UnsupportedTokenizer, write_gguf_tokenizer
    from fitlm.models.gguf import read_gguf_metadata

    with tempfile.TemporaryDirectory() as tmp:
        try:
            write_gguf_tokenizer(read_gguf_metadata(path), Path(tmp), str(path))
        except UnsupportedTokenizer as e:
            raise ModelDirError(
                f"{path}: {e}; generate from an imported directory with a tokenizer.json "
                f"(`fitlm import {path} --out DIR`, then copy the model's tokenizer into DIR)"
            ) from None
        return Tokenizer.from_file(Path(tmp))


def load_tokenizer(loaded: LoadedModel, model_path: str | Path) -> Tokenizer:
    """The tokenizer of a loaded MODEL: its tokenizer.json, or the one stored in its GGUF file."""
    if loaded.tokenizer_path is None and loaded.source == "gguf":
        return _gguf_tokenizer(loaded.path)
    if loaded.tokenizer_path is None:
        raise ModelDirError(
            f"{model_path}: no tokenizer.json beside the weights; copy the tokenizer the model was "
            "trained with into that directory"
        )
    return Tokenizer.from_file(loaded.tokenizer_path)


def generate_text(
    model_path: str,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = 0,
    stream: Callable[[str], None] | None = None,
    ready: Callable[[], None] | None = None,
) -> dict:
    """Continue `prompt` with the model at `model_path`. `ready` is called once the model, its tokenizer and the
    prompt are loaded and checked, before the first token: `fitlm generate` echoes the prompt there, so an error
    is never printed after it."""
    check_sampling(temperature, top_p)  # before the model is read
    loaded = load_model_dir(model_path)
    tok = load_tokenizer(loaded, model_path)
    # BOS exactly when the model's tokenizer adds it (fitlm's own tokenizers: always; Qwen: never).
    prompt_ids = tok.encode(prompt, add_bos=tok.add_bos)
    check_prompt(loaded.model, prompt_ids)
    if ready is not None:
        ready()
    decoder = StreamDecoder(tok, stream) if stream else None
    new_ids = generate(
        loaded.model,
        prompt_ids,
        max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        eos_id=tok.stop_ids,
        seed=seed,
        stream=decoder,
    )
    return {"prompt": prompt, "text": tok.decode(new_ids), "token_ids": new_ids}
