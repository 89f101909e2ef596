"""fitlm's model as an lm-evaluation-harness `LM`: what `fitlm eval` runs in process.

lm-eval asks three things of a model, and each is answered the way its own `hf` model answers it, so the two
give the same per-sample numbers on the same weights:
- loglikelihood (multiple choice): lm-eval's `TemplateLM` splits (context, continuation) into tokens (trailing
  spaces of the context move to the continuation); the pair is scored by the training forward
  (fitlm.infer.scoring, batched), truncated on the left to `max_length` + 1 tokens; greedy = every
  continuation token is the argmax;
- loglikelihood_rolling (perplexity): lm-eval's disjoint rolling windows of `max_length` tokens, the first
  conditioned on the prefix token (BOS, else EOS), summed;
- generate_until: greedy (or sampled, with gen_kwargs' temperature) decoding with the KV cache, stopping at the
  model's stop ids, `max_gen_toks` or the first `until` string, which is cut off.
Texts are encoded without special tokens unless `add_bos_token` is set, as lm-eval's `hf` model does.
"""

from __future__ import annotations

from typing import Any, cast

import torch.nn as nn
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from fitlm.config import ModelConfig
from fitlm.data.tokenizer import Tokenizer
from fitlm.infer.generate import generate
from fitlm.infer.scoring import score_prompts
from fitlm.serve.model import load_served


class FitlmLM(TemplateLM):
    """MODEL (any kind fitlm takes, with `adapter` merged) for lm-eval; `batch_size` prompts share a forward."""

    def __init__(
        self,
        model: str | None = None,
        adapter: str | None = None,
        batch_size: int | str = 8,
        max_length: int | None = None,
        add_bos_token: bool = False,
        module: nn.Module | None = None,
        tokenizer: Tokenizer | None = None,
        **_: Any,
    ):
        """MODEL (a path, loaded as `fitlm serve` loads it), or a `module` with its `tokenizer` already in memory
        (training's evaluation: the weights being trained, evaluated as they are)."""
        super().__init__()
        self.loaded = module is None or tokenizer is None  # loaded here, not the training process's own model
        if module is None or tokenizer is None:
            if model is None:
                raise ValueError("FitlmLM needs model=MODEL (a fitlm, run, HF directory or GGUF file)")
            served = load_served(model, adapter)
            module, tokenizer = served.model, served.tokenizer
        self.model, self.tokenizer = module, tokenizer
        self.batch = max(1, int(batch_size)) if str(batch_size).isdigit() else 8
        context = int(cast(ModelConfig, module.config).max_seq_len)  # (a fitlm model's config)
        self._max_length = int(max_length or context)
        self.add_bos_token = add_bos_token

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **_: Any) -> list[int]:
        bos = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return self.tokenizer.encode(string, add_bos=bool(bos and self.tokenizer.bos_id is not None))

    def tok_decode(self, tokens: list[int], **_: Any) -> str:
        return self.tokenizer.decode(tokens)

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **_: Any) -> list[tuple[float, bool]]:
        """Each request: (cache key, context ids, continuation ids) -> (summed log-probability, greedy)."""
        rows = [(ctx + cont)[-(self.max_length + 1) :] for _, ctx, cont in requests]
        out: list[tuple[float, bool]] = []
        for start in range(0, len(rows), self.batch):
            scored = score_prompts(self.model, rows[start : start + self.batch], top=1)
            for (_, _, cont), choices in zip(requests[start : start + self.batch], scored):
                tail = choices[-len(cont) :]  # the continuation's tokens (never the first, which has no score)
                logprob = sum(c.logprob for c in tail if c is not None)
                greedy = all(c is not None and c.top[0][0] == c.token for c in tail)
                out.append((logprob, greedy))
                self.cache_hook.add_partial("loglikelihood", None, (logprob, greedy))
        return out

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(req.args[0]),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows])
            out.append(sum(s for s, _ in scores))
        return out

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", 256))
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample", False) else 0.0
            ids = self.tok_encode(context)[-max(1, self.max_length - max_new) :]  # left-truncated, as hf's
            max_new = min(max_new, self.max_length - len(ids))
            if max_new < 1:
                out.append("")
                continue
            # packed weights (a second copy) only for a loaded model, not the one being trained
            new = generate(self.model, ids, max_new, temperature, eos_id=self.tokenizer.stop_ids, packed=self.loaded)
            text = self.tokenizer.decode([t for t in new if t not in self.tokenizer.stop_ids])
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            out.append(text)
        return out


__all__ = ["FitlmLM"]
