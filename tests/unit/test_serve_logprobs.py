"""`fitlm serve` as evaluation tools call it: log-probabilities, echo, token-id prompts, batches of prompts, n,
best_of, seed and logit_bias, on a real uvicorn with the real `openai` client and httpx.

The numbers are held against transformers on the same checkpoint (within 1e-4) and against fitlm's own
training forward; the request shapes are lm-evaluation-harness's (`local-completions`: a batch of token-id
prompts, echo, logprobs 1, max_tokens 1, temperature 0, choices read back sorted by index).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.serve_models import chat_model_dir
from tests.unit.test_serve_api import MESSAGES, ServerThread

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from fitlm.serve.app import create_app
    from fitlm.serve.model import load_served

    d = chat_model_dir(tmp_path_factory.mktemp("serve-logprobs"), "qwen", context=256)
    served = load_served(d)
    app = create_app(served, max_batch=4)
    with ServerThread(app) as s:
        s.served, s.dir = served, d
        s.hf = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
        s.client = openai.OpenAI(base_url=s.url, api_key="x", max_retries=0)
        yield s


def post(server, path: str, **body) -> dict:
    r = httpx.post(server.url + path, json={"model": server.served.name, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def hf_logprobs(server, ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities [T, V] of the next token at each position of `ids`."""
    with torch.no_grad():
        logits = server.hf(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


PROMPTS = [[5, 17, 42, 99, 7, 64], [33, 8, 120], [71, 71, 2, 14, 150, 9, 11, 3]]


def test_lm_eval_loglikelihood_request_equals_transformers(server):
    # exactly what lm-eval's local-completions sends for a batch of loglikelihood requests
    out = post(server, "/completions", prompt=PROMPTS, max_tokens=1, logprobs=1, echo=True, temperature=0, seed=1234)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2]
    for ids, c in zip(PROMPTS, choices):
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1  # token ids taken as given (no BOS), plus the generated one
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = hf_logprobs(server, ids)
        want = [float(ref[t - 1, ids[t]]) for t in range(1, len(ids))]
        assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(want, abs=1e-4)
        generated = int(torch.argmax(ref[-1]))  # temperature 0: the greedy token, with its log-probability
        assert lp["token_logprobs"][-1] == pytest.approx(float(ref[-1, generated]), abs=1e-4)
        for t in range(1, len(ids) + 1):  # one alternative each, the most likely: lm-eval's greedy test
            top = lp["top_logprobs"][t]
            assert len(top) == 1
            greedy = int(torch.argmax(ref[t - 1]))
            assert (lp["token_logprobs"][t] == max(top.values())) == (t == len(ids) or ids[t] == greedy)
    assert out["usage"]["prompt_tokens"] == sum(map(len, PROMPTS)) and out["usage"]["completion_tokens"] == 3


def test_scores_are_the_training_forward_and_independent_of_the_batch(server):
    model = server.served.model
    alone = [post(server, "/completions", prompt=ids, max_tokens=0, echo=True, logprobs=0) for ids in PROMPTS]
    batch = post(server, "/completions", prompt=PROMPTS, max_tokens=0, echo=True, logprobs=0)["choices"]
    for ids, one, c in zip(PROMPTS, alone, sorted(batch, key=lambda c: c["index"])):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)  # the training forward
        want = [float(ref[t - 1, ids[t]]) for t in range(1, len(ids))]
        assert c["logprobs"]["token_logprobs"][1:] == pytest.approx(want, abs=1e-5)
        assert one["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(c["logprobs"]["token_logprobs"][:])
        assert c["finish_reason"] == "length" and c["logprobs"]["top_logprobs"][1] == {}  # logprobs 0: none


def test_echo_text_and_offsets(server):
    out = post(server, "/completions", prompt="The river", max_tokens=4, echo=True, logprobs=2, temperature=0)
    c = out["choices"][0]
    assert c["text"].startswith("The river")
    offsets = c["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert all(len(top) == 2 for top in c["logprobs"]["top_logprobs"][1:])


def test_chat_logprobs_in_openai_shape(server):
    r = server.client.chat.completions.create(
        model=server.served.name, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob == pytest.approx(item.top_logprobs[0].logprob)
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)
        assert item.bytes == list(item.token.encode("utf-8"))


def test_n_and_seed_give_the_same_samples_again(server):
    kw = dict(prompt="The river", max_tokens=8, temperature=1.0, n=3, seed=11)
    a, b = post(server, "/completions", **kw), post(server, "/completions", **kw)
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert [c["index"] for c in a["choices"]] == [0, 1, 2] and len({c["text"] for c in a["choices"]}) > 1
    two = post(server, "/completions", prompt=["The river", "A stone"], max_tokens=3, n=2, temperature=0)
    assert [c["index"] for c in two["choices"]] == [0, 1, 2, 3]
    assert two["choices"][0]["text"] == two["choices"][1]["text"]  # greedy: the n choices agree


def test_best_of_keeps_the_most_likely(server):
    out = post(server, "/completions", prompt="The river", max_tokens=5, temperature=1.0, best_of=4, seed=3)
    assert len(out["choices"]) == 1 and out["choices"][0]["logprobs"] is None  # not asked, not shown
    assert out["usage"]["completion_tokens"] >= 5  # every candidate is counted
    cands = post(server, "/completions", prompt="The river", max_tokens=5, temperature=1.0, n=4, seed=3, logprobs=0)
    totals = [sum(c["logprobs"]["token_logprobs"]) for c in cands["choices"]]
    best = cands["choices"][max(range(4), key=totals.__getitem__)]["text"]
    assert out["choices"][0]["text"] == best  # the same seeds: best_of's candidates are n=4's choices


def test_logit_bias_forces_a_token(server):
    token = 77
    out = post(server, "/completions", prompt=[5, 6, 7], max_tokens=4, temperature=0, logit_bias={str(token): 100})
    ids = server.served.tokenizer.encode(out["choices"][0]["text"])
    assert ids and set(ids) == {token}


def test_streamed_logprobs_equal_the_whole_response(server):
    kw = dict(prompt="The river", max_tokens=6, temperature=0, logprobs=1)
    whole = post(server, "/completions", **kw)["choices"][0]["logprobs"]["token_logprobs"]
    streamed = []
    with httpx.stream("POST", server.url + "/completions", json={**kw, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed += (c["logprobs"] or {}).get("token_logprobs", [])
    assert streamed == pytest.approx(whole)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "best_of": 2, "n": 3}, "best_of"),
        ({"prompt": "x", "best_of": 3, "n": 1, "stream": True}, "best_of"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "echo": "yes"}, "echo"),
        ({"prompt": [[1, 2], "x", []]}, "prompt"),
        ({"prompt": [[1, 10**7]]}, "prompt"),
        ({"prompt": "x", "logit_bias": {str(10**7): 5}}, "logit_bias"),
    ],
)
def test_bad_combinations_are_400s_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
