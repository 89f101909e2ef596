"""A fitlm GGUF served by llama.cpp's OpenAI-compatible server, asked through the openai client.

The server is llama-cpp-python's (`python -m llama_cpp.server`, the `server` extra of the package the tests build
from source): the same llama.cpp library, the same /v1/chat/completions API as llama.cpp's llama-server binary. It
renders the GGUF's embedded chat template itself; greedy decoding (temperature 0, no repeat penalty) must give the
text fitlm's greedy decoding gives for the same conversation.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
from openai import OpenAI

from fitlm.data.chat import ChatEncoder, resolve_template
from fitlm.data.tokenizer import Tokenizer
from fitlm.export.gguf import export_gguf
from fitlm.infer import generate
from fitlm.models.io import load_model_dir
from tests.parity.llama_cpp_models import build

CONVERSATION = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What is a river?"},
]
NEW_TOKENS = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(proc: subprocess.Popen, client: OpenAI, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"llama_cpp.server exited:\n{proc.stdout.read()}")
        try:
            client.models.list()
            return
        except Exception:  # not listening yet
            time.sleep(0.5)
    raise AssertionError("llama_cpp.server did not answer within 120 s")


@pytest.mark.parametrize("name", ["qwen2.5", "llama3"])
def test_llama_server_chats_as_fitlm(tmp_path, name):
    d = build(name, tmp_path)
    loaded = load_model_dir(d)
    gguf = export_gguf(loaded, tmp_path / "m-f32.gguf", "f32")["out"]
    tok = Tokenizer.from_file(d)
    ids = ChatEncoder(tok, resolve_template(None, tok.path)[1]).encode(CONVERSATION, add_generation_prompt=True)[0]
    # a few tokens more than asked: the server goes on past max_tokens until the last character is whole
    ours = generate(loaded.model, ids, NEW_TOKENS + 8)

    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            "256",
            "--n_threads",
            "2",
            "--verbose",
            "false",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120)
        _wait(proc, client)
        reply = client.chat.completions.create(
            model="m", messages=CONVERSATION, max_tokens=NEW_TOKENS, temperature=0.0, extra_body={"repeat_penalty": 1.0}
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    n = reply.usage.completion_tokens
    stop = next((i for i, t in enumerate(ours[:NEW_TOKENS]) if t in tok.stop_ids), None)
    assert reply.choices[0].finish_reason == ("length" if stop is None else "stop"), name
    assert stop is not None or NEW_TOKENS <= n < NEW_TOKENS + 8, name
    # the random tiny model emits byte tokens that are not whole UTF-8 characters: the server drops those
    # bytes (llama-cpp-python decodes with errors="ignore"), fitlm's decode shows U+FFFD for them
    expected = tok.decode(ours[:n] if stop is None else ours[:stop]).replace("\ufffd", "")
    assert reply.choices[0].message.content == expected, name
    assert reply.usage.prompt_tokens == len(ids), name  # the server's rendering + tokenization is fitlm's
