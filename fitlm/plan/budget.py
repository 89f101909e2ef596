"""Compute budgets: the compute-optimal model size and token count for a FLOP budget (Chinchilla).

Why three rules: Hoffmann et al. 2022 give two answers that disagree at large budgets. Approach 1
(default) finds N_opt and D_opt both growing as C^0.5, i.e. about 20 tokens per parameter; the
parametric fit L(N, D) = E + A/N^α + B/D^β (their Eq. 10) has a closed-form optimum under C = 6·N·D;
Besiroglu et al. 2024 refit the same data ("replication"), which moves the optimum back near Approach 1.
"""

from __future__ import annotations

from dataclasses import dataclass

TOKENS_PER_PARAM = 20.0  # Chinchilla Approach 1
FITS = {  # (E, A, B, alpha, beta)
    "parametric": (1.69, 406.4, 410.7, 0.34, 0.28),  # Hoffmann et al. 2022, Eq. 10
    "replication": (1.8172, 482.01, 2085.43, 0.3478, 0.3658),  # Besiroglu et al. 2024
}
RULES = ("approach1", *FITS)


@dataclass(frozen=True)
class Budget:
    flops: float
    params: float
    tokens: float
    rule: str
    loss: float | None = None  # predicted by the parametric fits only


def compute_optimal(flops: float, rule: str = "approach1") -> Budget:
    """N_opt, D_opt with 6·N·D = flops under the chosen rule."""
    if flops <= 0:
        raise ValueError(f"--flops must be positive, got {flops}")
    if rule == "approach1":
        n = (flops / (6.0 * TOKENS_PER_PARAM)) ** 0.5
        return Budget(flops, n, TOKENS_PER_PARAM * n, rule)
    if rule not in FITS:
        raise ValueError(f"--rule {rule!r}: use one of {', '.join(RULES)}")
    e, a, b, alpha, beta = FITS[rule]
    g = (alpha * a / (beta * b)) ** (1.0 / (alpha + beta))
    n = g * (flops / 6.0) ** (beta / (alpha + beta))
    d = (flops / 6.0) ** (alpha / (alpha + beta)) / g
    return Budget(flops, n, d, rule, e + a / n**alpha + b / d**beta)


def hardware_flops(peak_tflops: float, num_devices: int, hours: float, mfu: float) -> float:
    """FLOPs a cluster delivers: peak × devices × seconds × achieved MFU."""
    return peak_tflops * 1e12 * num_devices * hours * 3600.0 * mfu


def training_hours(params: float, tokens: float, peak_tflops: float, num_devices: int, mfu: float) -> float:
    """Wall-clock hours to train `params` on `tokens` (6·N·D FLOPs) at the given MFU."""
    return 6.0 * params * tokens / (peak_tflops * 1e12 * num_devices * mfu) / 3600.0
