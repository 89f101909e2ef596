"""Rotary position embeddings, with the frequency scalings transformers defines (linear, dynamic NTK,
YaRN, Llama 3, LongRoPE), computed the way transformers computes them so logits match to fp32 rounding.

Static types (plain, linear, llama3, yarn) precompute cos/sin tables for [0, max_seq_len). The two
length-dependent types choose their frequencies from the longest position of the call, as
transformers does in `dynamic_rope_update`: `dynamic` grows the base once a sequence passes
max_seq_len, `longrope` switches from the short to the long factors past original_max_seq_len. Within
one generation positions only grow, so both agree with transformers call for call.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from fitlm.config import RopeScalingConfig


def _base_inv_freq(dim: int, theta: float, device) -> torch.Tensor:
    # int64 arange then float, as transformers does, so the exponents round identically.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (theta**exponents)  # [D/2]


def _llama3(inv: torch.Tensor, sc: RopeScalingConfig, max_seq_len: int) -> torch.Tensor:
    factor, low, high = sc.factor or 8.0, sc.low_freq_factor or 1.0, sc.high_freq_factor or 4.0
    old = sc.original_max_seq_len or max_seq_len
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def yarn_factor(sc: RopeScalingConfig, max_seq_len: int) -> float:
    """YaRN's and LongRoPE's scale: the configured factor, or (as transformers derives it) max_seq_len / original."""
    return sc.factor or max_seq_len / (sc.original_max_seq_len or max_seq_len)


def _yarn(dim: int, theta: float, sc: RopeScalingConfig, max_seq_len: int, device) -> tuple[torch.Tensor, float]:
    original = sc.original_max_seq_len or max_seq_len
    factor = yarn_factor(sc, max_seq_len)
    attn = sc.attention_factor
    if attn is None:
        attn = (
            _mscale(factor, sc.mscale) / _mscale(factor, sc.mscale_all_dim)
            if sc.mscale and sc.mscale_all_dim
            else _mscale(factor)
        )
    beta_fast, beta_slow = sc.beta_fast or 32, sc.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if sc.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 = extrapolate (high frequencies keep their period)
    return interpolation * (1 - keep) + extrapolation * keep, float(attn)


def longrope_attention_factor(sc: RopeScalingConfig, max_seq_len: int) -> float:
    original = sc.original_max_seq_len or max_seq_len
    factor = yarn_factor(sc, max_seq_len)
    if sc.attention_factor is not None:
        return sc.attention_factor
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    """cos/sin for positions, in the rotate-half layout, for one base and one scaling."""

    cos_cached: torch.Tensor
    sin_cached: torch.Tensor

    def __init__(
        self, head_dim: int, max_seq_len: int, theta: float = 10000.0, scaling: RopeScalingConfig | None = None
    ):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
        self.head_dim, self.max_seq_len, self.theta, self.scaling = head_dim, max_seq_len, theta, scaling
        self.dynamic = scaling is not None and scaling.type in ("dynamic", "longrope")
        # Not persistent: derived from the config, so checkpoints stay free of them and HF-compatible.
        self.register_buffer("cos_cached", torch.empty(0), persistent=False)
        self.register_buffer("sin_cached", torch.empty(0), persistent=False)
        self.reset(None)

    def inv_freq(self, seq_len: int | None, device) -> tuple[torch.Tensor, float]:
        """(inverse frequencies [D/2], cos/sin scale) for a call whose longest sequence is seq_len."""
        d, theta, sc = self.head_dim, self.theta, self.scaling
        if sc is None:
            return _base_inv_freq(d, theta, device), 1.0
        if sc.type == "linear":
            assert sc.factor is not None  # (validated: linear and dynamic scaling need a factor)
            return _base_inv_freq(d, theta, device) / sc.factor, 1.0
        if sc.type == "llama3":
            return _llama3(_base_inv_freq(d, theta, device), sc, self.max_seq_len), 1.0
        if sc.type == "yarn":
            return _yarn(d, theta, sc, self.max_seq_len, device)
        if sc.type == "dynamic":
            assert sc.factor is not None  # (validated: linear and dynamic scaling need a factor)
            original = sc.original_max_seq_len or self.max_seq_len  # transformers' max_position_embeddings
            n = max(seq_len or 0, original)
            base = theta * ((sc.factor * n / original) - (sc.factor - 1)) ** (d / (d - 2))
            return _base_inv_freq(d, base, device), 1.0
        # longrope: per-frequency divisors, the long set once the call passes the pretraining length
        original = sc.original_max_seq_len or self.max_seq_len
        ext = sc.long_factor if seq_len and seq_len > original else sc.short_factor
        exponents = torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d
        inv = 1.0 / (torch.tensor(ext, dtype=torch.float32, device=device) * theta**exponents)
        return inv, longrope_attention_factor(sc, self.max_seq_len)

    def _tables(self, positions: torch.Tensor, seq_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        inv, scale = self.inv_freq(seq_len, positions.device)
        # Element-wise position*frequency in fp32 reproduces transformers' fp32 matmul exactly.
        freqs = positions.float()[..., None] * inv  # [..., D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [..., D]
        return emb.cos() * scale, emb.sin() * scale

    def reset(self, device: torch.device | str | None) -> None:
        """(Re)compute the tables, e.g. after building on the meta device."""
        if device is None:
            device = self.cos_cached.device
        if self.dynamic:
            return  # computed per call
        self.cos_cached, self.sin_cached = self._tables(torch.arange(self.max_seq_len, device=device), None)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B,T] -> (cos, sin), each [B,T,D] fp32."""
        if self.dynamic:
            return self._tables(position_ids, int(position_ids.max()) + 1)
        return self.cos_cached[position_ids], self.sin_cached[position_ids]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B,heads,T,D]; cos/sin [B,T,D] (broadcast over heads)."""
    cos = cos.unsqueeze(1).to(x.dtype)  # [B,1,T,D]
    sin = sin.unsqueeze(1).to(x.dtype)
    return x * cos + rotate_half(x) * sin


# --------------------------------------------------------------------------- llama.cpp's per-frequency factors
# llama.cpp divides each frequency by a stored factor (the `rope_freqs` tensor for Llama 3.x, the
# `rope_factors_short/long` tensors for Phi-3 LongRoPE): inv_freq = base_inv_freq / factor.


def frequency_factors(sc: RopeScalingConfig, head_dim: int, theta: float, max_seq_len: int) -> list[float]:
    """llama.cpp's rope_freqs for a llama3 scaling (what its converter writes)."""
    base = _base_inv_freq(head_dim, theta, "cpu").double()
    scaled = _llama3(base, sc, max_seq_len)
    return (base / scaled).tolist()


def scaling_from_factors(factors: list[float], head_dim: int, theta: float, max_seq_len: int) -> RopeScalingConfig:
    """A RoPE scaling whose frequencies are base / factors: Llama 3's parameters when the factors are a llama3
    ramp (only the ratios original/low and original/high matter, so low_freq_factor is taken as 1 -- Meta's
    value), else the same factors as a LongRoPE pair that never switches."""
    f = torch.tensor(factors, dtype=torch.float64)
    base = _base_inv_freq(head_dim, theta, "cpu").double()
    x = base / (2 * math.pi)  # 1 / wavelength
    factor = float(f.max())
    medium = (f > 1 + 1e-6) & (f < factor - 1e-6)
    if factor > 1 and int(medium.sum()) >= 2:
        smooth = (1 / f[medium] - 1 / factor) / (1 - 1 / factor)  # linear in 1/wavelength: a·x + b
        a, b = torch.linalg.lstsq(torch.stack([x[medium], torch.ones_like(x[medium])], 1), smooth[:, None]).solution[
            :, 0
        ]
        if b < 0 and a > 0:
            high = 1 - 1 / float(b)
            candidate = RopeScalingConfig(
                type="llama3",
                factor=factor,
                low_freq_factor=1.0,
                high_freq_factor=round(high, 6),
                original_max_seq_len=round(-float(a / b)),
            )
            if torch.allclose(
                torch.tensor(frequency_factors(candidate, head_dim, theta, max_seq_len), dtype=torch.float64),
                f,
                rtol=1e-5,
            ):
                return candidate
    values = [float(v) for v in factors]
    return RopeScalingConfig(
        type="longrope", short_factor=values, long_factor=values, attention_factor=1.0, original_max_seq_len=max_seq_len
    )
