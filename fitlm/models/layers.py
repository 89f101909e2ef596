"""Pieces shared by the model families: RMSNorm, causal attention, document masks, KV cache (RoPE: rope.py).

Shape letters: B batch, T new tokens in this call, S keys visible (cached + new), H query heads,
K key/value heads, D head dim, C model width.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fitlm.models.rope import apply_rotary


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale; statistics in fp32 whatever the input dtype.

    `unit_offset` (Gemma): the scale is (1 + weight), weights start at 0, and the product is taken in
    fp32 before the cast back -- exactly where Gemma's reference rounds, which differs from Llama's.
    """

    def __init__(self, dim: int, eps: float = 1e-5, unit_offset: bool = False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def reset_parameters(self) -> None:
        (nn.init.zeros_ if self.unit_offset else nn.init.ones_)(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        # fp32 statistics: half-precision squares overflow (fp16) or lose the small terms (bf16).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (xf * (1.0 + self.weight.float())).to(dtype)
        # Cast back before scaling so half-precision runs round exactly where Hugging Face does.
        return self.weight * xf.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (", unit_offset" if self.unit_offset else "")


class KVCache:
    """Per-layer keys and values, preallocated for `max_len` positions.

    Every layer writes its new keys at the same offset `length`; the model calls `advance(T)` once all
    layers have run, so the offset means "tokens already processed" throughout one forward.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.max_len = max_len
        self.length = 0
        # One tensor per layer (not one stacked tensor) so layers may live on different devices.
        shape = (batch_size, kv_heads, max_len, head_dim)  # [B,K,max_len,D]
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [B,K,T,D] after the cached ones; return all keys/values so far, [B,K,S,D]."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(
                f"KV cache is full: {self.length} cached + {k.shape[2]} new tokens exceed its "
                f"{self.max_len} positions; allocate a longer cache"
            )
        self.k[layer_idx][:, :, self.length : end] = k
        self.v[layer_idx][:, :, self.length : end] = v
        return self.k[layer_idx][:, :, :end], self.v[layer_idx][:, :, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def reset(self) -> None:
        """Forget the cached tokens (the buffers are reused, not cleared: they are overwritten)."""
        self.length = 0


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: int = 0,
    attn_mask: torch.Tensor | None = None,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention where query i (absolute position q_start+i) sees keys 0..q_start+i.

    q [B,H,T,D]; k, v [B,K,S,D] with S = q_start + T and K dividing H (grouped-query attention:
    query head h reads key/value head h // (H/K)). Returns [B,H,T,D].
    `attn_mask` (bool [B,1,T,S], True = may attend, from `document_causal_mask`, or its `additive_mask`
    form, 0 / -inf in the attention's dtype) replaces the causal rule when given; it broadcasts over heads,
    so tensor-parallel head shards use it unchanged.
    `window` (sliding-window layers): query i sees only keys i-window+1..i. `scale` replaces 1/sqrt(D);
    `softcap` bounds the scores as cap·tanh(score/cap) (Gemma 2), which SDPA cannot do: eager path.
    """
    t, s = q.shape[2], k.shape[2]
    if t == 1 and softcap is None and q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        # A decode step on a CPU: SDPA's half-precision kernel is ~3-5x slower than its fp32 one at one query
        # (bf16, 1 thread, a 135M model's shapes: ~46 against ~16 µs at batch 1 with the casts, ~350 against ~75
        # at 8 batched streams), so attend in fp32 and round the output once. The half kernel accumulates in
        # fp32 as well; it also rounds the probabilities to half before the product with v.
        up = attn_mask.float() if attn_mask is not None and attn_mask.is_floating_point() else attn_mask
        return causal_attention(q.float(), k.float(), v.float(), q_start, up, window, scale).to(q.dtype)
    gqa = q.shape[1] != k.shape[1]
    if window is not None or softcap is not None:
        mask = restrict_mask(attn_mask, band_mask(t, s, q_start, window, q.device))  # [T,S] or [B,1,T,S]
        if softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return softcapped_attention(q, k, v, mask, scale, softcap)
    if attn_mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=gqa)
    if t == s:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if t == 1:
        # A single new token may see every cached key: no mask, which keeps the fast kernels.
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    # Several new tokens after a cached prefix: is_causal would align the mask top-left, so build it.
    mask = band_mask(t, s, q_start, None, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = may attend) in SDPA's additive form: 0 where allowed, -inf elsewhere, in `dtype`.

    Why the bodies convert once per forward: SDPA converts a boolean mask to this form on every call and
    keeps the converted copy for backward, so every layer held its own float [B,1,T,T] (B·T² elements per
    layer, which at long rows outgrow the layer's other activations). One shared tensor in the attention's
    dtype (see `attention_dtype`) is kept once, and SDPA computes exactly what it computed before.
    """
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def attention_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in for hidden states `h`: autocast's when it is on for h's device, else h's."""
    kind = h.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else h.dtype


def shared_mask(mask: torch.Tensor | None, h: torch.Tensor) -> torch.Tensor | None:
    """The mask every layer of one forward over hidden states `h` shares: `mask` (from `attention_inputs`) in
    additive form, converted once; None stays None (plain causal attention, no mask)."""
    return None if mask is None else additive_mask(mask, attention_dtype(h))


def restrict_mask(attn_mask: torch.Tensor | None, allowed: torch.Tensor) -> torch.Tensor:
    """An incoming mask (boolean or additive) further limited to `allowed` (bool), in the incoming form."""
    if attn_mask is None:
        return allowed
    if attn_mask.dtype == torch.bool:
        return attn_mask & allowed
    return attn_mask.masked_fill(~allowed, float("-inf"))


def band_mask(t: int, s: int, q_start: int, window: int | None, device: torch.device) -> torch.Tensor:
    """bool [T,S]: query q_start+i may see key j when j <= q_start+i (and j > q_start+i-window)."""
    rows = torch.arange(q_start, q_start + t, device=device)[:, None]  # [T,1]
    cols = torch.arange(s, device=device)[None, :]  # [1,S]
    allowed = cols <= rows
    if window is not None:
        allowed = allowed & (cols > rows - window)
    return allowed


def softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None, cap: float
) -> torch.Tensor:
    """Eager attention with tanh-capped scores; softmax in fp32 like the reference. Returns [B,H,T,D]."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B,H,S,D]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale  # [B,H,T,S]
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return probs @ v


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Block-causal mask of packed rows: document_ids [B,T] -> bool [B,1,T,T], True where query i may
    attend key j (j <= i and both in the same document).

    Why an SDPA boolean mask and not FlexAttention: on CPU without torch.compile (torch 2.13), flex
    runs an unfused reference path that materialises the scores anyway, and `create_block_mask` costs
    far more than the attention it feeds at these sizes (see bench/RESULTS.md, "Figures behind the code's
    design choices"). The mask is built once per forward and shared by every layer; the diagonal is
    always allowed, so no row is empty (no NaN).
    """
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids must be [batch, seq], got shape {tuple(document_ids.shape)}")
    t = document_ids.shape[1]
    same = document_ids[:, :, None] == document_ids[:, None, :]  # [B,T,T]
    causal = torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril_()
    return (same & causal).unsqueeze(1)  # [B,1,T,T]


def document_position_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 where the document id changes along each row: [B,T] -> [B,T]."""
    b, t = document_ids.shape
    idx = torch.arange(t, device=document_ids.device).expand(b, t)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    # Index of the latest document start at or before each position, by a running maximum.
    start_idx = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - start_idx


def attention_inputs(
    input_ids: torch.Tensor, position_ids: torch.Tensor | None, document_ids: torch.Tensor | None, start: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(position_ids [B,T], attention mask [B,1,T,T] or None) for a body's forward.

    With `document_ids`, positions default to restarting per document and attention is block-causal;
    without, positions are absolute and attention stays plain causal (is_causal SDPA, no mask built).
    """
    b, t = input_ids.shape[:2]
    if document_ids is None:
        if position_ids is None:
            position_ids = default_position_ids(b, t, start, input_ids.device)
        return position_ids, None
    if start:
        raise ValueError(
            "document_ids cannot be combined with a filled KV cache: generation runs one document; "
            "pass document_ids only for packed training/scoring rows"
        )
    if tuple(document_ids.shape) != (b, t):
        raise ValueError(f"document_ids has shape {tuple(document_ids.shape)}, expected {(b, t)} like input_ids")
    document_ids = document_ids.to(input_ids.device)
    if position_ids is None:
        position_ids = document_position_ids(document_ids)
    return position_ids, document_causal_mask(document_ids)


def default_position_ids(batch: int, t: int, start: int, device: torch.device) -> torch.Tensor:
    """[B,T] absolute positions start..start+T-1."""
    return torch.arange(start, start + t, device=device).unsqueeze(0).expand(batch, t)


def check_inputs(input_ids: torch.Tensor, kv_cache: KVCache | None, max_seq_len: int) -> int:
    """Validate [B,T] ids (or [B,T,C] hidden states entering a later pipeline stage) against the cache and
    the model's length; return the offset of the new tokens."""
    if input_ids.dim() not in (2, 3):
        raise ValueError(f"input_ids must be [batch, seq] token ids, got shape {tuple(input_ids.shape)}")
    start = kv_cache.length if kv_cache is not None else 0
    if start + input_ids.shape[1] > max_seq_len:
        raise ValueError(
            f"sequence of {start + input_ids.shape[1]} tokens exceeds model.max_seq_len={max_seq_len}; "
            f"shorten the input or use a model with a larger max_seq_len"
        )
    if kv_cache is not None and kv_cache.batch_size != input_ids.shape[0]:
        raise ValueError(f"KV cache holds batch {kv_cache.batch_size} but input_ids has batch {input_ids.shape[0]}")
    return start


def make_blocks(block_cls, cfg) -> nn.ModuleDict:
    """Blocks keyed "0".."L-1": a ModuleDict, so a pipeline stage can drop the blocks it does not own
    while the others keep their names (model.layers.7... stays model.layers.7...)."""
    return nn.ModuleDict({str(i): block_cls(cfg, i) for i in range(cfg.num_layers)})


class SelfAttention(nn.Module):
    """Multi-head / grouped-query self-attention with HF's projection names and a KV cache.

    Options the families compose (all read from the config or passed by the family):
      - `bias` on q/k/v, `out_bias` on o (Qwen2: q/k/v only; GPT-2: all four);
      - `qk_norm`: a norm factory applied per head to q and k before RoPE (Qwen3, Gemma 3);
      - `fused`: one `qkv_proj` [(H+2K)·D, C] as Phi-3 stores it (LoRA then targets HF's own name);
      - sliding window, score scale (query_pre_attn_scalar) and score soft-capping from the config.
    Rotary positions are applied when `cos`/`sin` are given; learned-position families pass none.
    """

    def __init__(
        self, cfg, layer_idx: int, bias: bool, out_bias: bool | None = None, qk_norm=None, fused: bool = False
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = d = cfg.head_size
        c, h, k = cfg.hidden_size, cfg.num_heads, cfg.kv_heads
        self.heads = (h, k, k)  # q, k, v heads of a fused qkv_proj (never sharded: TP splits it first)
        if fused:
            self.qkv_proj = nn.Linear(c, (h + 2 * k) * d, bias=bias)
        else:
            self.q_proj = nn.Linear(c, h * d, bias=bias)
            self.k_proj = nn.Linear(c, k * d, bias=bias)
            self.v_proj = nn.Linear(c, k * d, bias=bias)
        self.o_proj = nn.Linear(h * d, c, bias=bias if out_bias is None else out_bias)
        self.q_norm = qk_norm(d) if qk_norm is not None else None
        self.k_norm = qk_norm(d) if qk_norm is not None else None
        self.attention_type = cfg.layer_type(layer_idx)
        self.window = cfg.sliding_window if self.attention_type == "sliding" else None
        self.scale = cfg.query_pre_attn_scalar**-0.5 if cfg.query_pre_attn_scalar else None
        self.softcap = cfg.attn_logit_softcap
        # The attention core: causal_attention, or context parallel's (fitlm.parallel.context_parallel), which
        # gathers the other ranks' keys and values and masks by global position, under the same contract.
        self.attend = causal_attention

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B,T,C] -> q [B,T,H,D], k and v [B,T,K,D] (head counts from the possibly sharded weights)."""
        b, t, _ = x.shape
        if hasattr(self, "qkv_proj"):
            q, k, v = self.qkv_proj(x).view(b, t, -1, self.head_dim).split(self.heads, dim=2)  # [B,T,H+2K,D]
            return q, k, v
        return (
            self.q_proj(x).view(b, t, -1, self.head_dim),
            self.k_proj(x).view(b, t, -1, self.head_dim),
            self.v_proj(x).view(b, t, -1, self.head_dim),
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
        kv_cache: "KVCache | None" = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, t, _ = x.shape  # x [B,T,C]
        q, k, v = self.project(x)
        if self.q_norm is not None:  # per head, before RoPE, as Qwen3 and Gemma 3 do
            assert self.k_norm is not None  # (made with q_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B,H,T,D], [B,K,T,D]
        if cos is not None:
            assert sin is not None  # (cos and sin come together)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        start = 0
        if kv_cache is not None:
            start = kv_cache.length
            k, v = kv_cache.update(self.layer_idx, k, v)  # [B,K,S,D]
        out = self.attend(q, k, v, start, attn_mask, self.window, self.scale, self.softcap)  # [B,H,T,D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))  # [B,T,C]


class GatedMLP(nn.Module):
    """down(act(gate(x)) · up(x)): SwiGLU (`silu`, Llama/Qwen/Phi-3) or GeGLU (`gelu_tanh`, Gemma).

    `fused` keeps Phi-3's single `gate_up_proj` [2F, C] (gate rows first), so its LoRA targets keep HF's names.
    """

    ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}

    def __init__(self, cfg, act: str = "silu", fused: bool = False, width: int | None = None):
        super().__init__()
        c, f = cfg.hidden_size, width or cfg.ffn_size  # width: an MoE's shared expert
        self.act = self.ACTIVATIONS[act]
        if fused:
            self.gate_up_proj = nn.Linear(c, 2 * f, bias=False)
        else:
            self.gate_proj = nn.Linear(c, f, bias=False)
            self.up_proj = nn.Linear(c, f, bias=False)
        self.down_proj = nn.Linear(f, c, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [B,T,F] each (local halves under TP)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)
