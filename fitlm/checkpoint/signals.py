"""SIGTERM and Ctrl-C (SIGINT) during training: stop at the end of the step, never silently.

The first signal only sets a flag (a handler must not save: it runs between two bytecodes of whatever the
main thread is doing); the checkpointer reads it after every step, the ranks agree on it, and the run saves
a final checkpoint there (checkpoint.save_on_signal) and stops with 128 + the signal's number. A second
signal means "now": the process leaves at once, saying that the save was abandoned and what a rerun of the
same command will start from. A save cut short leaves only a `.tmp-` directory, removed at the next start.

Messages go out with os.write: a handler that printed through sys.stderr while the main thread was in the
middle of a write to it (the progress bar) would raise "reentrant call".
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

from fitlm.checkpoint import store
from fitlm.cli_common import say, signal_name

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def again_hint(signum: int) -> str:
    """How the user sends the same signal again."""
    return "press Ctrl-C again" if signum == signal.SIGINT else f"send {signal_name(signum)} again"


def rerun_from(output_dir: str | Path, resume: str = "auto") -> str:
    """What running the same command again starts from, judged by what is on disk now."""
    found = store.list_checkpoints(store.checkpoints_root(output_dir))
    if resume == "never":
        fix = f"to resume from {found[-1][1]} (step {found[-1][0]})" if found else "and pass --overwrite to start over"
        return f"checkpoint.resume is never, so a rerun into this output_dir is refused; set it to auto {fix}"
    if not found:
        return "no checkpoint is on disk, so running the same command again starts over from step 1"
    step, path = found[-1]
    return f"the latest checkpoint on disk is {path} (step {step}); running the same command again resumes from it"


class StopSignals:
    """From `install` to `restore`: the first SIGTERM / SIGINT asks for a stop at the end of the step (`signum`
    says which); a second one exits at once with 128 + its number. `speaks`: this rank prints (rank 0)."""

    def __init__(self, output_dir: str | Path, save: bool, resume: str = "auto", speaks: bool = True):
        self.output_dir, self.save, self.resume, self.speaks = Path(output_dir), save, resume, speaks
        self.signum: int | None = None
        self.final_save = False  # past the loop: the model save finishes before the process exits
        self._previous: dict[int, Any] = {}

    @property
    def stop_signal(self) -> int:
        """The signal this process got; SIGTERM when the stop came from another rank's."""
        return self.signum if self.signum is not None else int(signal.SIGTERM)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return  # signal.signal works in the main thread only (tests drive the trainer from others)
        self._previous = {s: signal.signal(s, self._on_signal) for s in SIGNALS}

    def restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _on_signal(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum = signum
            if self.speaks:
                say(f"fitlm: {signal_name(signum)} received: {self._plan()}; {again_hint(signum)} to stop at once")
            return
        if self.speaks:
            say(
                f"fitlm: second signal ({signal_name(signum)}): stopped at once, the "
                f"{'final model save' if self.final_save else 'save at the end of the step'} was abandoned; "
                f"{rerun_from(self.output_dir, self.resume)} (an unfinished save is removed at the next start)"
            )
        os._exit(128 + signum)  # now, as asked: no further step, no interpreter teardown that could hang

    def _plan(self) -> str:
        if self.final_save:
            return "training is over; the final model save finishes first, then the run ends"
        if self.save:
            return "saving a checkpoint at the end of this step, then stopping"
        return "stopping at the end of this step without a checkpoint (checkpoint.save_on_signal: false)"
