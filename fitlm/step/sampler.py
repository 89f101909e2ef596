"""GRPO's sampling: G completions per prompt from the policy's current weights, in the training process, by
fitlm's batched decoder (`fitlm.infer.batched.SlotBatch`: one shared KV cache, one forward per new token for
every completion at once), with no second copy of the model.

Each token is drawn from softmax(logits / temperature) restricted to the top_k most likely tokens and then to
the smallest set whose mass reaches top_p (TRL's and transformers' order), on the CPU in fp32, each prompt's
group from its own `torch.Generator` seeded by (train.seed, generation batch, the prompt's place in the global
batch): a rerun (a resumed run) draws the same tokens from the same weights whatever the device, and so does
another data-parallel layout of the same global batch (which rank samples a group does not change its seed).
A completion ends at the first stop token of the tokenizer (kept, as TRL keeps EOS) or after
max_completion_length tokens (truncated).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from fitlm.config.schema import GrpoConfig
from fitlm.infer.batched import SlotBatch, last_logits


def sampling_seed(seed: int, generation: int, prompt: int) -> int:
    """The generator seed of one prompt's group: distinct per (seed, generation batch, the prompt's place in the
    global batch), fixed by them."""
    return (seed * 1_000_003 + generation) * 65_537 + prompt


def filtered_logits(logits: torch.Tensor, cfg: GrpoConfig) -> torch.Tensor:
    """logits [B, V] (fp32) / temperature, top_k then top_p applied (-inf outside): what a token is drawn from."""
    scaled = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, cfg.top_k, dim=-1).values[:, -1:]  # [B, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if cfg.top_p < 1.0:
        probs, order = torch.sort(torch.softmax(scaled, dim=-1), dim=-1, descending=True)  # [B, V]
        drop = (torch.cumsum(probs, dim=-1) - probs) >= cfg.top_p  # mass before a token already reaches top_p
        drop[:, 0] = False
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    return scaled


@dataclass
class Samples:
    """The completions of a generation batch, in prompt order (prompt i's G completions consecutive)."""

    completions: list[list[int]]  # token ids, the stop token included when one ended it
    truncated: list[bool]  # cut at max_completion_length without a stop token
    entropy_sum: float  # summed entropy (nats) of softmax(logits / temperature) over every sampled token
    tokens: int  # sampled tokens (the entropy's count)


def sample(
    model: nn.Module,
    prompts: list[list[int]],
    cfg: GrpoConfig,
    stop_ids: tuple[int, ...],
    seeds: list[int],
    peers: Callable[[int], int] | None = None,
) -> Samples:
    """cfg.num_generations completions of each prompt (token ids) from `model` (the plain module, in eval mode;
    the caller sets autocast), prompt i's group drawn with seeds[i].

    `peers(n)` is the largest n over the ranks that shard the weights (ZeRO-2/3: each forward gathers blocks from
    all of them, so every rank runs as many forwards as the busiest one: idle prefills, and decoding steps until
    every rank's completions are done); None for whole weights on this rank."""
    g, limit = cfg.num_generations, cfg.max_completion_length
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    # not packed: the weights train between rollouts, and packed copies would double them for the whole run
    slots = SlotBatch(model, packed=False, inference=peers is None)
    # one prefill per prompt for its group, one cache for the batch
    logits = slots.add_many([(i * g + j, ids, len(ids) + limit) for i, ids in enumerate(prompts) for j in range(g)])
    if peers is not None:  # a rank with repeated prompts prefilled fewer
        distinct = len({tuple(ids) for ids in prompts})
        for _ in range(peers(distinct) - distinct):
            idle_forward(model)
    count = logits.shape[0]  # [B, V]
    out: list[list[int]] = [[] for _ in range(count)]
    done = [False] * count
    entropy, tokens = 0.0, 0
    stops = set(stop_ids)
    for t in range(limit):
        scaled = logits.float().cpu() / cfg.temperature  # [B, V]
        logp = torch.log_softmax(scaled, dim=-1)
        live = torch.tensor([not d for d in done])
        entropy += float(-(logp.exp() * logp).sum(-1)[live].sum())
        probs = torch.softmax(filtered_logits(logits.float().cpu(), cfg), dim=-1)  # [B, V]
        picked = [
            token
            for i, gen in enumerate(generators)
            for token in torch.multinomial(probs[i * g : (i + 1) * g], 1, generator=gen)[:, 0].tolist()
        ]
        for i, token in enumerate(picked):
            if not done[i]:
                out[i].append(token)
                tokens += 1
                done[i] = token in stops
        if t == limit - 1 or (all(done) if peers is None else peers(int(not all(done))) == 0):
            break
        logits = slots.step(picked)  # finished slots run on (their tokens are dropped): one forward for all
    return Samples(out, [not d for d in done], entropy, tokens)


def idle_forward(model: nn.Module) -> None:
    """A one-token forward whose result is dropped: this rank's part in a peer's forward under ZeRO-2/3."""
    with torch.no_grad():  # (not inference_mode: see SlotBatch's `inference`)
        last_logits(model, torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device), None)


__all__ = ["Samples", "filtered_logits", "idle_forward", "sample", "sampling_seed"]
