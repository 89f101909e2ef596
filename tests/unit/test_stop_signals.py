"""The pieces of a stop by SIGTERM / Ctrl-C, without a process (tests/e2e/test_stop_signals.py runs the real
CLI): the handler's first and second signal, the launcher's forwarding, the words of what a rerun starts from,
and checkpoint.save_on_signal as a key a resumed run may change."""

from __future__ import annotations

import signal

import pytest

from fitlm.checkpoint import store
from fitlm.checkpoint.compat import resume_conflicts
from fitlm.checkpoint.errors import TrainingInterrupted
from fitlm.checkpoint.signals import StopSignals, rerun_from
from fitlm.config import Config
from fitlm.parallel.launch import Forwarder


def test_save_on_signal_may_change_on_resume():
    saved = Config().to_dict()
    now = Config().to_dict()
    now["checkpoint"]["save_on_signal"] = False
    assert resume_conflicts(saved, now) == []
    del saved["checkpoint"]["save_on_signal"]  # a checkpoint of a fitlm before the key
    assert resume_conflicts(saved, Config().to_dict()) == []


def test_rerun_from_names_the_latest_checkpoint_or_step_1(tmp_path):
    assert "starts over from step 1" in rerun_from(tmp_path)
    (store.checkpoints_root(tmp_path) / "step_00000004").mkdir(parents=True)
    (store.checkpoints_root(tmp_path) / ".tmp-step_00000006").mkdir()  # an unfinished save is not a checkpoint
    said = rerun_from(tmp_path)
    assert "step_00000004 (step 4)" in said and "resumes from it" in said
    assert "set it to auto to resume from" in rerun_from(tmp_path, "never")


def test_first_signal_asks_for_a_stop_a_second_exits_at_once(tmp_path, monkeypatch, capfd):
    exits = []
    monkeypatch.setattr("os._exit", lambda code: exits.append(code))
    stop = StopSignals(tmp_path, save=True)
    stop._on_signal(signal.SIGINT, None)
    assert stop.signum == signal.SIGINT and exits == []
    assert "SIGINT received: saving a checkpoint at the end of this step" in capfd.readouterr().err
    stop._on_signal(signal.SIGINT, None)
    err = capfd.readouterr().err
    assert exits == [130] and "second signal (SIGINT): stopped at once" in err and "starts over from step 1" in err


def test_handlers_are_installed_and_restored():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stop = StopSignals(".", save=True)
    stop.install()
    try:
        assert signal.getsignal(signal.SIGTERM) == stop._on_signal == signal.getsignal(signal.SIGINT)
    finally:
        stop.restore()
    assert {s: signal.getsignal(s) for s in before} == before


def test_interrupted_says_saved_or_not():
    saved = str(TrainingInterrupted(6, "/r/checkpoints/step_00000006", signal.SIGINT))
    assert saved.startswith("stopped by SIGINT after step 6; checkpoint /r/checkpoints/step_00000006 is complete")
    assert "Run the same command again to resume from step 6" in saved
    never = str(TrainingInterrupted(6, "/r/c/step_00000006", signal.SIGTERM, "checkpoint.resume is never, ..."))
    assert never.endswith("is complete. checkpoint.resume is never, ...")
    none = str(TrainingInterrupted(6, None, signal.SIGTERM, "no checkpoint is on disk, ..."))
    assert "nothing was saved (checkpoint.save_on_signal is false" in none and none.endswith("on disk, ...")


class FakeAgent:
    def __init__(self):
        self.sent: list[int] = []
        self.killed = False

    def poll(self):
        return None

    def send_signal(self, sig):
        self.sent.append(sig)

    def kill(self):
        self.killed = True


@pytest.mark.parametrize(("got", "sent"), [(signal.SIGINT, signal.SIGINT), (signal.SIGHUP, signal.SIGTERM)])
def test_the_launcher_forwards_one_signal_then_kills_on_the_second(got, sent, capfd):
    agent = FakeAgent()
    forward = Forwarder(agent, lambda: "no checkpoint is on disk")  # type: ignore[arg-type]
    forward(got, None)
    assert agent.sent == [sent] and not agent.killed and forward.abandoned == 0
    forward(signal.SIGINT, None)
    assert agent.sent == [sent] and agent.killed and forward.abandoned == signal.SIGINT
    err = capfd.readouterr().err
    assert (
        "second signal (SIGINT): every rank was stopped at once, the save was abandoned; no checkpoint is on disk"
        in err
    )


@pytest.mark.process
def test_interval_0_saves_on_sigterm_and_resume_never_says_what_to_set(tiny_corpus, tmp_path):
    from fitlm.checkpoint.store import list_checkpoints
    from tests.unit.test_checkpoint import ckpt_config, train_in_process

    out = tmp_path / "run"
    cfg = ckpt_config(tiny_corpus, out, train={"max_steps": 4}, checkpoint={"interval": 0, "resume": "never"})
    with pytest.raises(TrainingInterrupted) as stopped:
        train_in_process(cfg, stop_at=2)
    assert stopped.value.step == 2 and [s for s, _ in list_checkpoints(out / "checkpoints")] == [2]
    said = str(stopped.value)
    assert "is complete. checkpoint.resume is never, so a rerun into this output_dir is refused" in said
    assert "set it to auto to resume from" in said and "step_00000002 (step 2)" in said
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
