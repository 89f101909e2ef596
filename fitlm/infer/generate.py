"""Autoregressive generation with a KV cache: greedy or temperature + top-p (nucleus) sampling.

The prompt is run once through the model, filling the cache; every later step feeds only the newest
token. The returned tokens include the stop token when generation stops on one (as Hugging Face does);
callers that print text decode with special tokens skipped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Collection, cast

import torch
import torch.nn as nn

from fitlm.infer.native_decode import NativeDecoder
from fitlm.infer.packed_linear import packed_linears

if TYPE_CHECKING:
    from fitlm.models.causal_lm import CausalLM


class GenerationError(ValueError):
    """Sampling settings or a prompt that generation cannot use; the message names the option and the fix."""


def check_sampling(temperature: float, top_p: float) -> None:
    """Refuse sampling settings outside their ranges, naming the command-line option (GenerationError)."""
    problems = []
    if not temperature >= 0:  # also NaN
        problems.append(
            f"--temperature {temperature}: temperature must be >= 0 (0 = greedy decoding; e.g. 0.8 to sample)"
        )
    if not 0.0 < top_p <= 1.0:
        problems.append(
            f"--top-p {top_p}: top_p must be in (0, 1], the probability mass sampled from (e.g. 0.9; 1.0 = every token)"
        )
    if problems:
        raise GenerationError("; ".join(problems))


def _max_seq_len(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "max_seq_len"):
        raise TypeError("generate() needs a fitlm model (one with .config.max_seq_len and .new_kv_cache())")
    return int(cfg.max_seq_len)


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """Pick a token from last-position logits [V]: argmax when temperature == 0, else nucleus sampling."""
    if temperature == 0.0:
        # In fp32: the same index (the cast is exact), and torch's CPU argmax over bf16 is ~5x slower than the cast
        # and an fp32 argmax together (~0.16 ms of a ~16 ms step at vocab 49k).
        return int(torch.argmax(logits.float()))
    # Sample on the CPU in fp32: seeded results then do not depend on the device or its kernels.
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)  # [V]
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)  # [V]
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
        keep = (torch.cumsum(sorted_p, dim=0) - sorted_p) < top_p
        keep[0] = True
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def last_logits(model: nn.Module, ids: torch.Tensor, cache, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [B,V] of the last position of ids [B,T], filling `cache`; the one forward every decoder shares
    (generate, chat, the batched server), so their numbers agree."""
    lm = cast("CausalLM", model)  # (a family's model)
    h = lm.hidden_states(ids, position_ids, kv_cache=cache)[:, -1]  # [B,C]; only the last position is needed
    return lm.logits(h)  # [B,V]: the training forward's logits (Gemma 2's soft cap included)


def check_prompt(model: nn.Module, prompt_ids: list[int]) -> int:
    """GenerationError unless `prompt_ids` can be continued by `model`; its context length otherwise."""
    if not prompt_ids:
        raise GenerationError(
            "the prompt is empty: generation needs at least one token (e.g. the BOS token); pass a non-empty --prompt"
        )
    limit = _max_seq_len(model)
    if len(prompt_ids) > limit:
        raise GenerationError(
            f"the prompt has {len(prompt_ids)} tokens but the model handles at most {limit} "
            f"(model.max_seq_len); shorten the prompt"
        )
    return limit


def generate(
    model: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_id: int | Collection[int] | None = None,
    seed: int | None = None,
    stream: Callable[[int], None] | None = None,
    packed: bool = True,
    native: bool = True,
) -> list[int]:
    """Continue `prompt_ids`; return only the new tokens (ending with EOS if it was produced). `packed`: decode
    through oneDNN-packed weights (fitlm.infer.packed_linear) and the C step (`native`, fitlm.infer.native_decode);
    False in a training process. `native` False: every step by the torch forward.

    `eos_id` is one id or several (a model may end a text and a turn differently, e.g. Llama 3's
    <|end_of_text|> and <|eot_id|>: pass `Tokenizer.stop_ids`); generation stops at any of them.

    max_new_tokens is lowered so prompt + new tokens fit model.config.max_seq_len. `seed` makes
    sampling reproducible (it does not touch the global RNG); `stream` is called with each new token
    as soon as it is chosen.
    """
    check_sampling(temperature, top_p)
    limit = check_prompt(model, prompt_ids)
    max_new_tokens = min(max_new_tokens, limit - len(prompt_ids))
    if max_new_tokens <= 0:
        return []
    eos = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    device = next(model.parameters()).device
    out: list[int] = []
    with torch.inference_mode(), packed_linears(model, packed):  # (the weights read once per step, see packed_linear)
        cache = cast("CausalLM", model).new_kv_cache(1, len(prompt_ids) + max_new_tokens)  # (_max_seq_len: ours)
        # Steps after the prompt in one C call each where the model allows (fitlm.infer.native_decode).
        fast = NativeDecoder.for_model(model, cache) if packed and native else None
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1,T]
        token = -1
        for step in range(max_new_tokens):
            if fast is not None and step > 0:
                logits = fast.step([token])[0]  # [V]
            else:
                logits = last_logits(model, ids, cache)[0]  # [V]
            token = sample_next(logits, temperature, top_p, generator)
            out.append(token)
            if stream is not None:
                stream(token)
            if token in eos:
                break
            ids = torch.tensor([[token]], dtype=torch.long, device=device)  # [1,1]
    return out
