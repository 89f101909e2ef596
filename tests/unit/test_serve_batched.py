"""Batched decoding (fitlm/infer/batched.py, fitlm/serve/engine.py): each sequence decodes as it would alone.

Slots join and leave at different steps with different prompt lengths and budgets, on families that
take different attention paths (GQA + RoPE, learned positions, sliding window, Gemma 2's soft-capped
eager attention) and mixtures of experts: every slot's greedy tokens equal `generate`'s solo tokens, and its logits equal a
cache-free full forward within float rounding.
"""

from __future__ import annotations

import threading

import pytest
import torch

from fitlm.config import ModelConfig
from fitlm.infer import generate
from fitlm.infer.batched import SlotBatch
from fitlm.registry import build_model

V = 128
ARCHS = {
    "llama_gqa": dict(arch="llama", num_kv_heads=2),
    "gpt2": dict(arch="gpt2"),
    "llama_window5": dict(arch="llama", num_kv_heads=1, sliding_window=5),
    "gemma2_softcap_window4": dict(arch="gemma2", num_kv_heads=2, sliding_window=4, attn_logit_softcap=20.0),
    # Mixtures of experts: every token (padding included) is routed on its own, so a slot's routing and its
    # tokens are those of its solo run; a dense block among sparse ones, a gated shared expert.
    "qwen3_moe_dense_block": dict(
        arch="qwen3_moe", num_kv_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        mlp_only_layers=[1],
    ),
    "qwen2_moe_shared_expert": dict(
        arch="qwen2_moe", num_kv_heads=2, num_experts=4, num_experts_per_tok=3, moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
    ),
    "mixtral": dict(arch="mixtral", num_kv_heads=2, num_experts=4, num_experts_per_tok=2),
}  # fmt: skip
PROMPTS = [[5, 17, 99, 3, 64, 8], [1, 2, 3], list(range(10, 30)), [7], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
BUDGETS = [12, 5, 9, 14, 7]


@pytest.fixture(scope="module", params=list(ARCHS))
def model(request):
    cfg = ModelConfig(
        hidden_size=64, num_layers=2, num_heads=4, vocab_size=V, max_seq_len=64, init_std=0.2, **ARCHS[request.param]
    )
    torch.manual_seed(0)
    return build_model(cfg).eval()


def run_staggered(model, prompts, budgets, join_every=2):
    """Greedy-decode every prompt in one SlotBatch, a new slot joining every `join_every` steps; each slot
    leaves when its budget is spent. Returns tokens and per-token logits of each slot."""
    batch = SlotBatch(model)
    tokens = {i: [] for i in range(len(prompts))}
    logits = {i: [] for i in range(len(prompts))}
    pending, step = list(range(len(prompts))), 0

    def take(i, row):
        tokens[i].append(int(row.argmax()))
        logits[i].append(row)
        if len(tokens[i]) == budgets[i]:
            batch.remove(i)

    while pending or len(batch):
        if pending and step % join_every == 0:
            i = pending.pop(0)
            take(i, batch.add(i, prompts[i], len(prompts[i]) + budgets[i]))
        if len(batch):
            keys = list(batch.keys)
            rows = batch.step([tokens[k][-1] for k in keys])
            for k, row in zip(keys, rows):
                take(k, row)
        step += 1
    return tokens, logits


def test_each_slot_equals_its_solo_run(model):
    tokens, logits = run_staggered(model, PROMPTS, BUDGETS)
    for i, (prompt, n) in enumerate(zip(PROMPTS, BUDGETS)):
        assert tokens[i] == generate(model, prompt, n), f"slot {i}"
        with torch.no_grad():  # cache-free reference: the whole sequence at once
            full = model(torch.tensor([prompt + tokens[i][:-1]]))[0, len(prompt) - 1 :]
        torch.testing.assert_close(torch.stack(logits[i]), full, rtol=1e-4, atol=1e-4)
    assert len({len(p) for p in PROMPTS}) > 1 and len(set(tokens[0])) > 2


def test_add_many_equals_adding_one_at_a_time(model):
    """Slots added together (a prompt repeated, as GRPO's group of samples: one prefill for them) decode as the same
    slots added one by one, beside a slot already decoding; a key given twice is refused."""
    one, many = SlotBatch(model), SlotBatch(model)
    for batch in (one, many):
        batch.add("old", PROMPTS[0], 40)
        batch.step([3])
    slots = [(0, PROMPTS[1], 40), (1, PROMPTS[1], 40), (2, PROMPTS[2], 40)]
    first = torch.stack([one.add(*slot) for slot in slots])
    torch.testing.assert_close(many.add_many(slots), first, rtol=0, atol=0)
    assert many.keys == one.keys and many.lengths == one.lengths
    for _ in range(3):
        torch.testing.assert_close(many.step([5, 6, 6, 7]), one.step([5, 6, 6, 7]), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="already"):
        SlotBatch(model).add_many([(0, [1, 2], 5), (0, [1, 3], 5)])


def test_slot_limits_are_enforced(model):
    batch = SlotBatch(model)
    with pytest.raises(ValueError, match="max_len"):
        batch.add("a", list(range(10)), 10)  # no room to generate
    with pytest.raises(ValueError, match="context"):
        batch.add("a", [1, 2], 65)
    batch.add("a", [1, 2], 3)
    with pytest.raises(ValueError, match="already"):
        batch.add("a", [1, 2], 5)
    batch.step([4])
    with pytest.raises(ValueError, match="reached its max_len"):
        batch.step([4])


def test_engine_batches_queued_requests_and_matches_solo(tmp_path):
    """Requests queued before the engine starts are admitted together (max_batch at once, the rest wait)."""
    from fitlm.data.prep.tokenizer_train import train_tokenizer
    from fitlm.data.tokenizer import Tokenizer
    from fitlm.serve.engine import Engine, GenRequest
    from fitlm.serve.model import ServedModel
    from tests.conftest import PLAYS

    tok = Tokenizer.from_file(train_tokenizer([PLAYS / "tempest_gut.txt"], 300, tmp_path / "tokenizer.json"))
    cfg = ModelConfig(
        arch="llama",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=tok.vocab_size,
        max_seq_len=64,
        init_std=0.2,
    )
    torch.manual_seed(1)
    model = build_model(cfg).eval()
    served = ServedModel("m", model, tok, None, "none", tmp_path)
    engine = Engine(served, max_batch=3)
    events: dict[int, list] = {i: [] for i in range(len(PROMPTS))}
    done = threading.Semaphore(0)

    def emitter(i):
        def emit(ev):
            events[i].append(ev)
            if ev[0] != "delta":
                done.release()

        return emit

    broken: list = []
    # A request that fails inside the model (an id past the vocabulary) gets an error; the rest go on.
    engine.submit(GenRequest(prompt_ids=[1, 10**6], max_tokens=3, emit=broken.append))
    for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS)):
        engine.submit(GenRequest(prompt_ids=p, max_tokens=n, emit=emitter(i), temperature=0.0))
    cancelled = GenRequest(prompt_ids=[1, 2], max_tokens=5, emit=emitter(0))
    cancelled.cancel()  # a client that left while queued: never decoded
    engine.submit(cancelled)
    engine.start()
    for _ in PROMPTS:
        assert done.acquire(timeout=60)
    engine.shutdown(timeout=60)
    assert engine.peak_batch == 3 and engine.active == 0 and engine.finished["cancelled"] == 1
    assert [ev[0] for ev in broken] == ["error"] and "IndexError" in broken[0][1]
    stops = set(tok.stop_ids)
    for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS)):
        solo = generate(model, p, n, eos_id=tok.stop_ids)
        text = "".join(ev[1] for ev in events[i] if ev[0] == "delta")
        assert text == tok.decode([t for t in solo if t not in stops])
        assert events[i][-1] == ("done", "stop" if solo[-1] in stops else "length", len(solo), [])  # no logprobs
