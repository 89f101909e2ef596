"""`fitlm serve`'s HTTP API on a real uvicorn, called with the real `openai` client, httpx and curl.

The model is a transformers-made Qwen2 checkpoint with a ChatML tokenizer (tests/unit/serve_models.py):
greedy chat completions equal transformers' `generate` and fitlm's `generate` on the template-rendered
prompt; streamed deltas join to the plain text; concurrent requests each equal their solo result; bad
requests get OpenAI-style 400s naming the parameter while the server keeps serving; a client that
disconnects frees its slot.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from fitlm.serve.cli import bind_socket
from tests.unit.serve_models import chat_model_dir

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a river?"}]
N = 16


class ServerThread:
    """`with ServerThread(create_app(...)) as s:` serves at `s.url` (.../v1) until the block ends: uvicorn in a
    background thread on a free loopback port, the server `fitlm serve` runs in its main thread."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.sock = bind_socket(host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True, name="fitlm-serve-http"
        )

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        for _ in range(600):  # start-up takes well under a second; give up after 30 s
            if self.server.started:
                return self
            if not self.thread.is_alive():
                break
            time.sleep(0.05)
        self.sock.close()
        raise RuntimeError("uvicorn did not start serving")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from fitlm.serve.app import create_app
    from fitlm.serve.model import load_served

    d = chat_model_dir(tmp_path_factory.mktemp("serve"), "qwen", context=1024)
    served = load_served(d)
    app = create_app(served, max_batch=3)
    with ServerThread(app) as s:
        s.served, s.engine, s.dir = served, app.state.engine, d
        s.client = openai.OpenAI(base_url=s.url, api_key="x", max_retries=0)
        yield s


def chat(server, messages=MESSAGES, **kw):
    kw = {"max_tokens": N, "temperature": 0, **kw}
    return server.client.chat.completions.create(model=server.served.name, messages=messages, **kw)


def stream_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    parts = [c.choices[0].delta.content or "" for c in chunks if c.choices and hasattr(c.choices[0], "delta")]
    parts += [c.choices[0].text for c in chunks if c.choices and hasattr(c.choices[0], "text")]
    return "".join(parts), chunks


def test_models_lists_the_served_model(server):
    models = server.client.models.list().data
    assert [m.id for m in models] == [server.served.name] == ["qwen-chat"]


def test_greedy_chat_equals_transformers_and_fitlm_generate(server):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fitlm.infer import generate

    tok = server.served.tokenizer
    hf_tok = AutoTokenizer.from_pretrained(server.dir)
    ids = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    ids = list(ids if isinstance(ids, list) else ids["input_ids"])
    assert ids == server.served.chat_ids(MESSAGES)  # the same template, rendered the same way
    hf = AutoModelForCausalLM.from_pretrained(server.dir, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    ref = hf.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=N,
        do_sample=False,
        eos_token_id=list(tok.stop_ids),
        pad_token_id=tok.pad_id,
    )[0, len(ids) :].tolist()
    assert ref == generate(server.served.model, ids, N, eos_id=tok.stop_ids)
    r = chat(server)
    assert r.choices[0].message.content == tok.decode([t for t in ref if t not in tok.stop_ids])
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    assert r.choices[0].finish_reason == ("stop" if ref[-1] in tok.stop_ids else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(ref))
    assert r.usage.total_tokens == len(ids) + len(ref) and len(r.choices[0].message.content) > 3


def test_streamed_deltas_join_to_the_plain_text(server):
    plain = chat(server).choices[0].message.content
    text, chunks = stream_text(chat(server, stream=True, stream_options={"include_usage": True}))
    assert text == plain
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert len({c.id for c in chunks}) == 1 and sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) > 2


def test_completions_plain_stream_and_stop_strings(server):
    c = server.client.completions
    full = c.create(model="qwen-chat", prompt="Once upon a time", max_tokens=N, temperature=0)
    text = full.choices[0].text
    assert full.object == "text_completion"
    assert full.usage.prompt_tokens == len(server.served.text_ids("Once upon a time"))
    streamed, _ = stream_text(
        c.create(model="qwen-chat", prompt="Once upon a time", max_tokens=N, temperature=0, stream=True)
    )
    assert streamed == text
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # a stop string from the middle of the greedy text
    cut = c.create(model="qwen-chat", prompt="Once upon a time", max_tokens=N, temperature=0, stop=[stop, "@@@"])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed_cut, _ = stream_text(
        c.create(model="qwen-chat", prompt="Once upon a time", max_tokens=N, temperature=0, stop=stop, stream=True)
    )
    assert streamed_cut == cut.choices[0].text


def test_seeded_sampling_is_reproducible(server):
    a = chat(server, temperature=1.0, top_p=0.9, seed=7).choices[0].message.content
    assert a == chat(server, temperature=1.0, top_p=0.9, seed=7).choices[0].message.content
    others = {chat(server, temperature=1.0, seed=s).choices[0].message.content for s in range(3)}
    assert len(others | {a}) > 1


def test_concurrent_requests_each_equal_their_solo_result(server):
    convs = [
        [{"role": "user", "content": q}]
        for q in (
            "Hi",
            "What is a river?",
            "Tell me about the sea and the mountains, please.",
            "Why?",
            "Good morning",
            "Name a colour",
        )
    ]
    solo = [chat(server, m, max_tokens=N + i).choices[0].message.content for i, m in enumerate(convs)]
    with ThreadPoolExecutor(len(convs)) as pool:  # 6 clients, 3 slots: some wait, all overlap
        together = list(
            pool.map(lambda im: chat(server, im[1], max_tokens=N + im[0]).choices[0].message.content, enumerate(convs))
        )
    assert together == solo
    assert len(set(solo)) == len(solo)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": 4}, "messages"),
        ({"messages": [], "max_tokens": 4}, "messages"),
        ({"messages": MESSAGES, "max_tokens": -3}, "max_tokens"),
        ({"messages": MESSAGES, "max_tokens": 2.5}, "max_tokens"),
        ({"messages": MESSAGES, "temperature": "hot"}, "temperature"),
        ({"messages": MESSAGES, "top_p": 0}, "top_p"),
        ({"messages": MESSAGES, "stop": [1, 2]}, "stop"),
        ({"messages": MESSAGES, "stream": "yes"}, "stream"),
        ({"messages": MESSAGES, "n": 0}, "n"),
        ({"messages": MESSAGES, "n": 2, "best_of": 1}, "best_of"),
        ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": MESSAGES, "logprobs": 3}, "logprobs"),
        ({"messages": MESSAGES, "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"messages": MESSAGES, "logit_bias": {"5": 101}}, "logit_bias"),
        ({"messages": MESSAGES, "seed": "1"}, "seed"),
        ({"messages": MESSAGES, "frobnicate": 1}, "frobnicate"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "word " * 1100}], "max_tokens": 4}, "messages"),
        ({"messages": MESSAGES, "max_tokens": 5000}, "max_tokens"),
    ],
)
def test_bad_requests_get_openai_400s_naming_the_parameter(server, body, param):
    r = httpx.post(server.url + "/chat/completions", json={"model": "qwen-chat", **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert param.split("[")[0] in err["message"] and set(err) == {"message", "type", "param", "code"}


def test_errors_through_the_openai_client_and_the_server_keeps_serving(server):
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, max_tokens=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as e:
        server.client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "qwen-chat" in e.value.body["message"]
    bad = httpx.post(server.url + "/completions", content=b"{not json", timeout=60)
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    assert chat(server, max_tokens=3).usage.completion_tokens >= 1


@pytest.mark.process
def test_curl_plain_and_streaming(server):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    body = json.dumps({"model": "qwen-chat", "messages": MESSAGES, "max_tokens": N, "temperature": 0})
    args = [curl, "-sS", "--max-time", "60", server.url + "/chat/completions", "-H", "Content-Type: application/json"]
    plain = json.loads(subprocess.run(args + ["-d", body], capture_output=True, text=True, check=True).stdout)
    streamed = subprocess.run(
        args + ["-N", "-d", json.dumps({**json.loads(body), "stream": True})],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    events = [line[len("data: ") :] for line in streamed.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text == plain["choices"][0]["message"]["content"] == chat(server).choices[0].message.content


def test_client_disconnect_frees_its_slot(server):
    engine = server.engine
    before = engine.finished["cancelled"]
    body = {"model": "qwen-chat", "messages": MESSAGES, "max_tokens": 900, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if '"content": "' in line and '"content": ""' not in line:
                break  # generation is under way; leave without reading the rest
    for _ in range(600):  # bounded wait (60 s) for the engine to notice; no timing assertion
        if engine.finished["cancelled"] > before and engine.active == 0:
            break
        time.sleep(0.1)
    assert engine.finished["cancelled"] == before + 1 and engine.active == 0
    assert chat(server, max_tokens=2).usage.completion_tokens >= 1
