"""GRPO's pieces between the prompts and the loss: top-k/top-p filtering, seeded sampling by the batched engine,
the right-padded sequences and their per-token log-probabilities, and the prompt stream's batches."""

from __future__ import annotations

import torch

from fitlm.config import ModelConfig
from fitlm.config.schema import GrpoConfig
from fitlm.data.prompts import PromptRow, PromptStream
from fitlm.models.loss import IGNORE_INDEX
from fitlm.registry import build_model
from fitlm.step.rollout import sequences, token_logps
from fitlm.step.sampler import filtered_logits, sample, sampling_seed

CFG = ModelConfig(
    arch="llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=64
)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(CFG.model_copy(update={"max_seq_len": 64})).eval()


def test_top_k_then_top_p_keep_what_transformers_keeps():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    kept = lambda **kw: torch.isfinite(filtered_logits(logits, GrpoConfig(**kw)))[0].tolist()  # noqa: E731
    assert kept(top_k=2) == [True, True, False, False, False]
    assert kept(top_p=0.75) == [True, True, False, False, False]  # 0.5 + 0.3 reaches 0.75
    assert kept(top_p=0.81) == [True, True, True, False, False]
    assert kept(top_k=4, top_p=0.95) == [True, True, True, True, False]
    assert torch.allclose(filtered_logits(logits, GrpoConfig(temperature=2.0)), logits / 2)


def test_sampling_is_fixed_by_its_seed_and_stops_at_a_stop_token():
    m, prompts = model(), [[1, 2, 3], [4, 5, 6, 7, 8]]
    g = GrpoConfig(num_generations=3, max_completion_length=6)
    seeds = [sampling_seed(7, 2, i) for i in range(2)]
    a = sample(m, prompts, g, (0,), seeds)
    assert a == sample(m, prompts, g, (0,), seeds)
    assert a.completions != sample(m, prompts, g, (0,), [sampling_seed(7, 3, i) for i in range(2)]).completions
    # a group's draws depend on its own seed only, not on the groups sampled beside it
    assert sample(m, prompts[1:], g, (0,), seeds[1:]).completions == a.completions[3:]
    assert len(a.completions) == 6 and all(1 <= len(c) <= 6 for c in a.completions)
    for c, cut in zip(a.completions, a.truncated):
        assert cut == (0 not in c) and (cut or c.index(0) == len(c) - 1)
    # a stop token every completion draws first ends them all at one token
    first = int(torch.argmax(m(torch.tensor([prompts[0]]))[0, -1]))
    greedy = GrpoConfig(num_generations=2, max_completion_length=6, top_k=1)
    assert sample(m, prompts[:1], greedy, (first,), [0]).completions == [[first], [first]]


def test_ranks_that_shard_the_weights_run_as_many_forwards_as_the_busiest_and_sample_the_same():
    """Under ZeRO-2/3 every forward gathers from all ranks: a rank whose completions end early, or whose repeated
    prompts need fewer prefills, runs on in lockstep (fitlm.step.sampler.sample's `peers`), drawing the same."""
    m, prompts = model(), [[1, 2, 3], [1, 2, 3]]  # one prompt twice: one prefill
    forwards = []
    m.model.layers["0"].register_forward_pre_hook(lambda *_: forwards.append(1))
    first = int(torch.argmax(m(torch.tensor([prompts[0]]))[0, -1]))
    greedy = GrpoConfig(num_generations=2, max_completion_length=6, top_k=1)  # every completion stops at once
    forwards.clear()
    alone = sample(m, prompts, greedy, (first,), [0, 1])
    assert alone.completions == [[first]] * 4 and len(forwards) == 1
    answers = [3, 1, 1, 1, 0]  # the busiest peer's: 3 distinct prompts, then not done three times, then done
    asked = []

    def peers(n: int) -> int:
        asked.append(n)
        return max(n, answers[len(asked) - 1])

    forwards.clear()
    assert sample(m, prompts, greedy, (first,), [0, 1], peers) == alone
    assert asked == [1, 0, 0, 0, 0]  # this rank: 1 distinct prompt, then done from the first token on
    assert len(forwards) == 1 + 2 + 3  # its prefill, 2 idle ones, then a step each time the peer was not done


def test_log_probs_are_those_of_the_completion_tokens_under_the_tempered_model():
    m = model()
    prompts, completions = [[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]]
    ids, labels = sequences(prompts, completions, pad_id=63)
    assert ids.tolist() == [[1, 2, 3, 6, 7], [4, 5, 8, 9, 10]]
    assert (labels != IGNORE_INDEX).sum(-1).tolist() == [2, 3]
    with torch.no_grad():
        got = token_logps(m(ids), labels, temperature=0.7)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            logits = m(torch.tensor([p + c]))[0] / 0.7  # the row alone, unpadded
            want = torch.log_softmax(logits, -1)[torch.arange(len(p) - 1, len(p) + len(c) - 1), torch.tensor(c)]
            torch.testing.assert_close(got[i][labels[i] != IGNORE_INDEX], want, rtol=1e-5, atol=1e-5)
    assert (got[labels == IGNORE_INDEX] == 0).all()


def test_prompt_stream_gives_ranks_disjoint_slices_and_is_a_function_of_the_batch():
    class Data:
        rows = [PromptRow([i], str(i), {}) for i in range(10)]

    ranks = [PromptStream(Data(), 2, seed=3, rank=r, world_size=2) for r in range(2)]  # type: ignore[arg-type]
    seen = [row.text for g in range(5) for s in ranks for row in s.batch(g)]
    assert sorted(seen[:10]) == [str(i) for i in range(10)]  # the first epoch: every prompt once
    assert ranks[0].batch(3) == PromptStream(Data(), 2, seed=3, rank=0, world_size=2).batch(3)  # type: ignore[arg-type]
    assert [r.text for r in ranks[0].batch(0)] != [r.text for r in PromptStream(Data(), 2, 4, 0, 2).batch(0)]  # type: ignore[arg-type]


def test_rewards_are_logged_under_their_function_names_as_trl_does():
    from fitlm.step.rewards import Reward
    from fitlm.step.rollout import reward_keys

    def fn(prompts, completions, **columns):
        return [0.0] * len(completions)

    names = ["answer_equals:solution", "length:20", "my_rewards.py:check", "pkg.mod:check", "format_regex"]
    assert reward_keys([Reward(n, fn) for n in names]) == [
        "answer_equals",
        "length",
        "check_2",
        "check_3",
        "format_regex",
    ]
