"""`fitlm train --dry-run`: every check a real run makes, and the run's shape, without training or writing."""

from __future__ import annotations

from pathlib import Path

import torch

from fitlm.config import Config, ConfigError
from fitlm.data.loader import SequenceLoader
from fitlm.data.prompts import PromptDataset
from fitlm.finetune.init_from import resolve_init_from
from fitlm.models.flops import flops_per_token
from fitlm.parallel_dims import layout_name
from fitlm.registry import build_model
from fitlm.train import preflight
from fitlm.train.grpo import grpo_dry_run
from fitlm.train.trainer import open_data


def dry_run(cfg: Config, world_size: int | None = None, overwrite: bool = False) -> dict:
    """Raises ConfigError/DataError with every problem a run would hit; returns the run's shape."""
    world_size = world_size or cfg.parallel.world_size
    cfg = resolve_init_from(cfg)  # a no-op for a config fitlm.run_config loaded (resolution is idempotent)
    problems = preflight.launch_problems(cfg, world_size)
    problem = preflight.output_dir_problem(cfg, overwrite)
    if problem:
        problems.append(problem)
    if problems:
        raise ConfigError(problems)
    train, valid, tok = open_data(cfg)
    t = cfg.train
    if isinstance(train, PromptDataset):
        return grpo_dry_run(cfg, train, world_size)
    loader = SequenceLoader(
        train, cfg.data.seq_length, t.micro_batch_size, seed=t.seed, world_size=cfg.parallel.data_parallel
    )
    with torch.device("meta"):  # count parameters without allocating them
        model = build_model(cfg.model)
    params = sum(p.numel() for p in model.parameters())
    p = cfg.parallel
    tokens_per_step = (
        t.micro_batch_size * t.gradient_accumulation_steps * cfg.data.seq_length * cfg.parallel.data_parallel
    )
    out = Path(t.output_dir)
    return {
        "model": cfg.model.arch,
        "hidden_size": cfg.model.hidden_size,
        "layers": cfg.model.num_layers,
        "params": params,
        "processes": world_size,
        "layout": f"{layout_name(p.data_parallel, p.tensor_parallel, p.pipeline_parallel, p.context_parallel)}"
        f" zero{p.zero_stage}",
        "train_tokens": train.num_tokens,
        "valid_tokens": valid.num_tokens if valid else 0,
        "tokenizer": str(tok.path),
        "vocab_size": tok.vocab_size,
        "global_batch_sequences": t.micro_batch_size * t.gradient_accumulation_steps * cfg.parallel.data_parallel,
        "tokens_per_step": tokens_per_step,
        "total_tokens": tokens_per_step * t.max_steps,
        "epochs": round(tokens_per_step * t.max_steps / max(1, loader.windows_per_epoch * cfg.data.seq_length), 3),
        "train_flops": flops_per_token(model, cfg.model, cfg.data.seq_length) * tokens_per_step * t.max_steps,
        "output_dir": str(out),
    }
