"""`fitlm train --dry-run`: every check a real run makes, and the run's shape, without training or writing."""

from __future__ import annotations

from pathlib import Path

import torch

from fitlm.config import Config, ConfigError
from fitlm.data.dataset import SequenceLoader
from fitlm.registry import build_model
from fitlm.train import preflight
from fitlm.train.metrics import flops_per_token
from fitlm.train.trainer import open_data, resolve_init_from


def dry_run(cfg: Config) -> dict:
    problems = preflight.unsupported_options(cfg)
    problem = preflight.output_dir_problem(cfg)
    if problem:
        problems.append(problem)
    if problems:
        raise ConfigError(problems)
    cfg = resolve_init_from(cfg)
    train, valid, tok = open_data(cfg)
    t = cfg.train
    loader = SequenceLoader(train, cfg.data.seq_length, t.micro_batch_size, seed=t.seed)
    with torch.device("meta"):  # count parameters without allocating them
        model = build_model(cfg.model)
    params = sum(p.numel() for p in model.parameters())
    tokens_per_step = t.micro_batch_size * t.gradient_accumulation_steps * cfg.data.seq_length * cfg.parallel.data_parallel
    out = Path(t.output_dir)
    return {
        "model": cfg.model.arch, "params": params, "train_tokens": train.num_tokens,
        "valid_tokens": valid.num_tokens if valid else 0, "tokenizer": str(tok.path), "vocab_size": tok.vocab_size,
        "global_batch_sequences": t.micro_batch_size * t.gradient_accumulation_steps * cfg.parallel.data_parallel,
        "tokens_per_step": tokens_per_step, "total_tokens": tokens_per_step * t.max_steps,
        "epochs": round(tokens_per_step * t.max_steps / max(1, loader.windows_per_epoch * cfg.data.seq_length), 3),
        "train_flops": flops_per_token(model, cfg.model, cfg.data.seq_length) * tokens_per_step * t.max_steps,
        "output_dir": str(out),
    }
