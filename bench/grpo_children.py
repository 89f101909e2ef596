"""The two contenders' child processes of bench/grpo.py (`--fitlm-child CONFIG`, `--trl-child DIR`), each
printing one JSON object of its per-step times on stdout's last line.

Not a script of its own: bench/grpo.py runs itself with those flags and dispatches here.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from grpo_task import REWARDS, make_prompts


def fitlm_child(config: str) -> None:
    """--fitlm-child: `fitlm train CONFIG` in this process (the CLI's own entry point), each step's and its
    sampling phase's CPU seconds taken around `Trainer.train_step` and `GrpoRun.micro_batches`; one JSON
    object on stdout's last line."""
    from fitlm.cli import main as fitlm_main
    from fitlm.train.grpo import GrpoRun
    from fitlm.train.trainer import Trainer

    record: dict[str, list[float]] = {"step_cpu_s": [], "sampling_cpu_s": []}
    for cls, name, key in ((Trainer, "train_step", "step_cpu_s"), (GrpoRun, "micro_batches", "sampling_cpu_s")):
        setattr(cls, name, cpu_timed(getattr(cls, name), record[key]))
    if fitlm_main(["train", config]) != 0:
        raise SystemExit(f"fitlm train {config} failed")
    print(json.dumps(record))


def cpu_timed(fn, into: list[float]):
    """fn, appending the process's CPU seconds of each call to `into` (descheduling does not count)."""

    def timed(*a, **kw):
        t0 = time.process_time()
        try:
            return fn(*a, **kw)
        finally:
            into.append(time.process_time() - t0)

    return timed


def trl_child(args) -> None:
    """--trl-child: TRL's GRPOTrainer for --steps steps on --model; one JSON object on stdout."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    train, _ = make_prompts(args.seed, args.max_operand, args.held_out)
    out = Path(args.trl_child)
    config = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=args.completions,
        gradient_accumulation_steps=1,
        num_generations=args.generations,
        max_completion_length=args.completion_length,
        temperature=1.0,
        beta=0.0,
        loss_type=args.loss_type,
        scale_rewards="group",
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=1.0,
        max_steps=args.steps,
        use_cpu=True,
        bf16=False,
        disable_dropout=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.model)
    trainer = GRPOTrainer(model=model, reward_funcs=list(REWARDS), args=config, train_dataset=Dataset.from_list(train))
    trainer.processing_class = trainer.processing_class or tok
    record: dict[str, list[float]] = {"step_s": [], "sampling_s": [], "completion_length": [], "reward": []}
    record.update(step_cpu_s=[], sampling_cpu_s=[])
    # transformers' generate of the step's completions (wall clock, and CPU seconds)
    sampling = cpu_timed(trainer._generate_single_turn, record["sampling_cpu_s"])

    def timed_sampling(*a, **kw):
        t0 = time.perf_counter()
        result = sampling(*a, **kw)
        record["sampling_s"].append(time.perf_counter() - t0)
        return result

    trainer._generate_single_turn = timed_sampling

    class Steps(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **kw):
            record["step_s"].append(time.perf_counter() - self.t0)
            record["step_cpu_s"].append(time.process_time() - self.c0)

        def on_log(self, _args, _state, _control, logs=None, **kw):
            if logs and "reward" in logs:
                record["reward"].append(logs["reward"])
                record["completion_length"].append(logs.get("completions/mean_length", float("nan")))

    trainer.add_callback(Steps())
    trainer.train()
    trainer.save_model(str(out / "model"))
    tok.save_pretrained(str(out / "model"))
    print(json.dumps({**record, "model_dir": str(out / "model")}))
