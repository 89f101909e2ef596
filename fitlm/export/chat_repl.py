"""`fitlm chat`: multi-turn chat in the terminal with the model's own chat template, streaming tokens.

The conversation is re-rendered with the template every turn (the same template and sandbox that
rendered the training data, fitlm/data/chat.py), so the model sees exactly the format it was tuned
on. Oldest turns are dropped when the conversation outgrows the context. No KV cache is kept across
turns: each turn re-reads the (short) history once, then decodes with a cache.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TextIO

from fitlm.data.chat import ChatEncoder, resolve_template
from fitlm.data.tokenizer import Tokenizer
from fitlm.infer.generate import check_sampling, generate
from fitlm.infer.text import StreamDecoder
from fitlm.models.io import ModelDirError, load_model_dir


@dataclass
class ChatSession:
    """One conversation: history, template, and how to turn it into prompt ids."""

    encoder: ChatEncoder
    max_context: int
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)

    def reset(self) -> None:
        self.messages.clear()

    def prompt_ids(self, reserve: int) -> list[int]:
        """Ids of the conversation plus the assistant prompt, dropping the oldest turns to leave `reserve` tokens."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        while True:
            # The training encoder with the generation prompt: BOS only if the model adds it, no EOS appended.
            ids = self.encoder.encode(head + self.messages, add_generation_prompt=True)[0]
            if len(ids) + reserve <= self.max_context or len(self.messages) <= 1:
                return ids[-(self.max_context - 1) :] if len(ids) >= self.max_context else ids
            self.messages.pop(0)


def run_chat(
    model_path: str,
    stdin: TextIO = sys.stdin,
    stdout: TextIO = sys.stdout,
    stderr: TextIO = sys.stderr,
    template: str | None = None,
    system: str | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> int:
    """Read user turns from stdin until /exit or end of input; stream each reply to stdout."""
    check_sampling(temperature, top_p)  # before the model loads or a turn is read
    loaded = load_model_dir(model_path)
    if loaded.tokenizer_path is None:
        raise ModelDirError(f"{model_path}: no tokenizer.json beside the weights; chat needs the model's tokenizer")
    tok = Tokenizer.from_file(loaded.tokenizer_path)
    name, source = resolve_template(template, loaded.tokenizer_path)
    session = ChatSession(ChatEncoder(tok, source, name), loaded.config.model.max_seq_len, system)
    stops = set(tok.stop_ids)  # EOS and the model's end-of-turn tokens (generation_config.json, GGUF, ...)

    def say(s: str) -> None:
        stderr.write(s)
        stderr.flush()

    say(f"chatting with {loaded.path} (template: {name}). /reset clears the history, /exit quits.\n")
    interactive = stdin.isatty()
    turn = 0
    while True:
        if interactive:
            say("you> ")
        line = stdin.readline()
        if not line:
            break
        text = line.strip()
        if text == "/exit":
            break
        if text == "/reset":
            session.reset()
            say("(history cleared)\n")
            continue
        if not text:
            continue
        session.messages.append({"role": "user", "content": text})
        ids = session.prompt_ids(reserve=min(max_new_tokens, session.max_context // 2))

        def emit(piece: str) -> None:
            stdout.write(piece)
            stdout.flush()

        new = generate(
            loaded.model,
            ids,
            max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            eos_id=stops,
            seed=seed + turn,
            stream=StreamDecoder(tok, emit),
        )
        stdout.write("\n")
        stdout.flush()
        reply = tok.decode([i for i in new if i not in stops])
        session.messages.append({"role": "assistant", "content": reply.strip() or "..."})
        turn += 1
    return 0
