"""A torchrun entry point for the layout tests: several `fitlm train` configs trained one after another in one
world of processes, each as a rank of a job that `fitlm train` joins under torchrun (nothing spawned).

    python -m fitlm.parallel.lifetime --standalone --nproc-per-node=W -m tests.distributed.train_world CASES.json

CASES.json lists config paths; rank 0 writes each run's summary beside its config (NAME.summary.json). Why:
a `fitlm train` of the tiny model is almost all start-up (the launcher, torchrun's agent and every rank import
torch and fitlm, ~7 CPU-seconds each, against well under one for the steps), so a world shared by the cases
of one size costs one start-up. Each case still builds its own Trainer, mesh, model, data and output dir; the
process group (made here, left up by each Trainer) is the only thing they share. A failing case ends the world (the
others are not run); with --keep-going a refusal (a ValueError every rank raises) is written to NAME.error.txt and
the next case runs (tests/distributed/layout_matrix.py).
"""

from __future__ import annotations

import json
import signal
import sys
import traceback
from pathlib import Path


def main(cases_file: str, keep_going: bool = False) -> None:
    import torch.distributed

    from fitlm.config import load_config
    from fitlm.parallel.lifetime import die_with_parent
    from fitlm.parallel.mesh import exit_process
    from fitlm.train.trainer import Trainer

    die_with_parent(signal.SIGKILL)
    # The world's process group, made here, so each run's Trainer joins it and leaves it up (ParallelContext.owns_group)
    torch.distributed.init_process_group("gloo")
    code = 0
    try:
        for path in json.loads(Path(cases_file).read_text()):
            try:
                result = Trainer(load_config(path)).fit()
            except ValueError as exc:  # fitlm's refusals (ConfigError, rule messages): every rank raises alike
                if not keep_going:
                    raise
                Path(path).with_suffix(".error.txt").write_text(f"{type(exc).__name__}: {exc}")
                continue
            if result.is_main:
                Path(path).with_suffix(".summary.json").write_text(json.dumps({"eval_loss": result.eval_loss}))
    except BaseException:  # noqa: BLE001 - printed for the test's failure message; the world ends
        traceback.print_exc()
        code = 1
    exit_process(code)


if __name__ == "__main__":
    main(sys.argv[1], keep_going="--keep-going" in sys.argv[2:])
