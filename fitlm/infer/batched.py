"""Batched decoding: many sequences share each forward, every one with its own positions and mask.

Layout of the shared KV cache: one write offset F (`cache.length`) for the whole batch, and each
slot's tokens right-aligned at physical cells [F - len, F). A step writes every slot's new key at
cell F, so a slot's tokens stay contiguous and the physical distance between two of its tokens is
their real distance: sliding-window layers, which the model bounds by physical offsets, stay right.
The cells before a slot's first token hold another slot's history or nothing; a boolean mask hides
them, and positions (RoPE or learned) are each slot's own. When a slot joins or leaves, the cache is
rebuilt right-aligned to the longest slot, so F stays the longest slot's length and never exceeds
the model's context.

A joining slot's prompt runs alone (a batch of one, as `generate` runs it), then its keys and values
are copied in. When every slot has the same length (one slot alone) no mask is passed and a step is
`generate`'s own code path; otherwise the masked attention computes the same scores over extra,
masked cells, so a slot's greedy tokens are those of its solo run (logits agree to float rounding).

The mask reaches attention through a forward pre-hook on each `SelfAttention` for the duration of
one step: the model families' forward code stays as it is.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import TYPE_CHECKING, Hashable, Iterator, cast

import torch
import torch.nn as nn

from fitlm.infer.generate import last_logits
from fitlm.infer.native_decode import NativeDecoder
from fitlm.infer.packed_linear import packed_linears
from fitlm.models.layers import KVCache, SelfAttention

if TYPE_CHECKING:
    from fitlm.models.causal_lm import CausalLM


@contextmanager
def attention_mask(model: nn.Module, mask: torch.Tensor | None) -> Iterator[None]:
    """Give every SelfAttention of `model` attn_mask=`mask` (bool [B,1,T,S], True = may attend) while inside."""
    if mask is None:
        yield
        return

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
        if bound.arguments.get("attn_mask") is None:
            bound.arguments["attn_mask"] = mask
        return bound.args, bound.kwargs

    handles = [
        m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules() if isinstance(m, SelfAttention)
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class SlotBatch:
    """The running sequences of a batched decoder, keyed by any hashable handle, in `keys` order.

    `add` runs a prompt and returns its next-token logits [V]; `step` feeds one token per slot (in
    `keys` order) and returns logits [B,V]; `remove` drops a slot. Each slot declares the length it
    may reach (`max_len`, at most the model's context): the caller removes it before it goes further.
    """

    def __init__(self, model: nn.Module, packed: bool = True, inference: bool = True, native: bool = True):
        """`packed`: decode through oneDNN-packed weights (fitlm.infer.packed_linear: faster on a CPU, a second
        copy of the weights' bytes for as long as the model lives) and steps of up to 16 slots in C
        (`native`, fitlm.infer.native_decode); False where the model trains in between. `native` False: torch
        steps only.
        `inference`: under torch.inference_mode; False (no_grad) where decoding gathers sharded weights (ZeRO-2/3)
        whose buffers the training forward reuses, which tensors made in inference mode could not be."""
        self.model = cast("CausalLM", model)  # (a family's model)
        self.packed, self.native = packed, native
        self.grad_free = torch.inference_mode if inference else torch.no_grad
        self.keys: list[Hashable] = []
        self.lengths: list[int] = []  # tokens of each slot in the cache
        self.max_lens: list[int] = []
        self.cache: KVCache | None = None
        self.device = next(model.parameters()).device
        self._native: tuple[KVCache, NativeDecoder | None] | None = None  # (the cache it writes, the C decoder)

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, key: Hashable, prompt_ids: list[int], max_len: int) -> torch.Tensor:
        """Start slot `key` from `prompt_ids` (prefilled alone), room for max_len tokens; its next-token logits [V]."""
        return self.add_many([(key, prompt_ids, max_len)])[0]

    def add_many(self, slots: list[tuple[Hashable, list[int], int]]) -> torch.Tensor:
        """`add` for several (key, prompt_ids, max_len) slots at once: each distinct prompt prefilled once (a group of
        samples of one prompt shares its prefill) and one cache rebuild for them all, so the batch holds the new
        cache and the prompts' own, not the previous cache besides (a rebuild per slot would). Logits [n, V]."""
        limit = int(self.model.config.max_seq_len)
        keys = [key for key, _, _ in slots]
        for key, prompt_ids, max_len in slots:
            if key in self.keys:
                raise ValueError(f"slot {key!r} is already decoding")
            if not 1 <= len(prompt_ids) < max_len <= limit:
                raise ValueError(
                    f"a slot needs 1 <= prompt ({len(prompt_ids)} tokens) < max_len ({max_len}) <= "
                    f"the model's context ({limit})"
                )
        if len(set(keys)) < len(keys):
            raise ValueError(f"slots {sorted({k for k in keys if keys.count(k) > 1}, key=repr)} are already decoding")
        prefilled: dict[tuple[int, ...], tuple[KVCache, torch.Tensor]] = {}
        with self.grad_free(), packed_linears(self.model, self.packed):
            for _, prompt_ids, _ in slots:
                if tuple(prompt_ids) not in prefilled:
                    solo = self.model.new_kv_cache(1, len(prompt_ids))
                    ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)  # [1,P]
                    prefilled[tuple(prompt_ids)] = (solo, last_logits(self.model, ids, solo)[0])  # [V]
        rows = [(self.cache, i, n) for i, n in enumerate(self.lengths)]
        rows += [(prefilled[tuple(ids)][0], 0, len(ids)) for _, ids, _ in slots]
        self.keys += keys
        self.lengths += [len(ids) for _, ids, _ in slots]
        self.max_lens += [max_len for _, _, max_len in slots]
        self._rebuild(rows)
        return torch.stack([prefilled[tuple(ids)][1] for _, ids, _ in slots])

    def remove(self, key: Hashable) -> None:
        j = self.keys.index(key)
        rows = [(self.cache, i, n) for i, n in enumerate(self.lengths) if i != j]
        del self.keys[j], self.lengths[j], self.max_lens[j]
        self._rebuild(rows)

    def step(self, tokens: list[int]) -> torch.Tensor:
        """Feed tokens[j] to slot keys[j]; return the next-token logits [B,V]."""
        if len(tokens) != len(self.keys) or self.cache is None:
            raise ValueError(f"step needs one token per slot ({len(self.keys)}), got {len(tokens)}")
        if any(n >= m for n, m in zip(self.lengths, self.max_lens)):
            raise ValueError("a slot reached its max_len; remove it before the next step")
        f = self.cache.length
        native = self._native_decoder(self.cache)
        if native is not None:  # one C call (fitlm.infer.native_decode): the same masks and positions as below
            with self.grad_free():
                logits = native.step(tokens, self.lengths, [f - n for n in self.lengths])  # [B,V]
            self.lengths = [n + 1 for n in self.lengths]
            return logits
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]  # [B,1]
        lengths = torch.tensor(self.lengths, device=self.device)  # [B]
        same = all(n == f for n in self.lengths)
        # Cells f - len .. f of each row are its own tokens (cell f: the one fed now).
        mask = None if same else (torch.arange(f + 1, device=self.device)[None, :] >= (f - lengths)[:, None])
        positions = None if same else lengths[:, None]  # [B,1]: each slot's own next position
        with (
            self.grad_free(),
            packed_linears(self.model, self.packed),
            attention_mask(self.model, None if mask is None else mask[:, None, None, :]),
        ):
            logits = last_logits(self.model, ids, self.cache, positions)  # [B,V]
        self.lengths = [n + 1 for n in self.lengths]
        return logits

    def _native_decoder(self, cache: KVCache) -> NativeDecoder | None:
        """The C decoder of this cache (made again after each rebuild), None where it does not apply or where the
        weights change between steps (`packed` False: a training process)."""
        if self._native is None or self._native[0] is not cache:
            usable = self.packed and self.native
            self._native = (cache, NativeDecoder.for_model(self.model, cache) if usable else None)
        return self._native[1]

    def _rebuild(self, rows: list[tuple[KVCache | None, int, int]]) -> None:
        """A new cache holding each (source cache, row, length) right-aligned at the longest length, sized
        for the steps until the first slot must leave (each leave rebuilds again)."""
        if not rows:
            self.cache = None
            return
        f = max(self.lengths)
        room = min(m - n for n, m in zip(self.lengths, self.max_lens))
        new = self.model.new_kv_cache(len(rows), f + max(room, 1))
        for j, (src, row, n) in enumerate(rows):
            assert src is not None  # (rows come from the live cache, or the solo one)
            start = src.length - n  # right-aligned in its source too (a solo cache: 0)
            for layer in range(len(new.k)):
                new.k[layer][j, :, f - n : f] = src.k[layer][row, :, start : start + n]
                new.v[layer][j, :, f - n : f] = src.v[layer][row, :, start : start + n]
        new.length = f
        self.cache = new


__all__ = ["SlotBatch", "attention_mask"]
