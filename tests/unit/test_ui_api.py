"""`fitlm ui`'s JSON endpoints, through FastAPI's test client: the Plan view's numbers are `fitlm plan --json`'s
(and the command it shows reproduces them), refusals and bad inputs are messages (the server keeps serving),
and the Runs view reads run states from the run lock."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from fitlm.checkpoint.store import list_checkpoints  # noqa: E402
from fitlm.cli import main  # noqa: E402
from fitlm.train.run_lock import lock_status  # noqa: E402
from fitlm.ui.app import create_app  # noqa: E402
from fitlm.ui.planning import knob_specs, scenarios  # noqa: E402
from tests.e2e.helpers import tiny_config, write_config  # noqa: E402
from tests.unit.serve_models import models_beside_runs  # noqa: E402
from tests.unit.test_plan import CONFIGS  # noqa: E402


@pytest.fixture()
def client(tmp_path):
    with TestClient(create_app(tmp_path / "runs"), base_url="http://127.0.0.1:8765") as c:
        yield c


def cli_plan(argv: list[str], capsys) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_of_a_config_is_the_cli_json(client, capsys):
    path = str(CONFIGS / "guide-7b-lora-24gb.yaml")
    r = client.post("/api/plan", json={"source": path})
    assert r.status_code == 200, r.text
    assert r.json()["plan"] == cli_plan(["plan", path, "--json"], capsys)
    assert r.json()["commands"]["plan"] == f"fitlm plan {path}"


def test_the_command_shown_reproduces_the_page_after_knobs(client, capsys):
    body = {
        "source": "guide-7b-4x24gb",  # a shipped scenario, by name
        "device": "rtx4090",
        "num_devices": 4,
        "overrides": {
            "parallel.pipeline_parallel": 1,
            "parallel.zero_stage": 3,
            "memory.recompute": "selective",
            "data.seq_length": 1024,
        },
    }
    r = client.post("/api/plan", json=body).json()
    assert r["knobs"]["parallel.zero_stage"] == 3 and r["knobs"]["data.seq_length"] == 1024
    argv = shlex.split(r["commands"]["plan"])[1:]
    assert "parallel.data_parallel=2" in argv  # the devices left over by tp2 × pp1 × cp1
    assert r["plan"] == cli_plan([*argv, "--json"], capsys)
    assert r["plan"]["device"]["num_devices"] == 4
    base = client.post("/api/plan", json={"source": "guide-7b-4x24gb", "device": "rtx4090"}).json()
    assert base["plan"]["per_device"]["total"] != r["plan"]["per_device"]["total"]  # the knobs mattered


def test_search_lists_the_clis_candidates(client, capsys):
    path = str(CONFIGS / "llama2-7b.yaml")
    r = client.post("/api/plan", json={"source": path, "num_devices": 8, "search": True, "top": 3}).json()
    cli = cli_plan(["plan", path, "--num-devices", "8", "--search", "--top", "3", "--json"], capsys)
    assert r["plan"]["search"] == cli["search"] and len(r["plan"]["search"]["top"]) == 3


def test_a_plan_that_does_not_fit_carries_the_diagnosis(client):
    r = client.post("/api/plan", json={"source": str(CONFIGS / "llama2-7b.yaml"), "device": "rtx3090"}).json()
    assert r["plan"]["fits_device"] is False
    assert r["plan"]["diagnosis"]["remedies"] and r["plan"]["diagnosis"]["over_by_bytes"] > 0


def test_a_model_directory_is_planned_as_model_init_from(client, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, max_position_embeddings=128,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "hf")
    r = client.post("/api/plan", json={"source": str(tmp_path / "hf"), "overrides": ["finetune.method=lora"]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["plan"]["model"]["layers"] == 2 and out["plan"]["finetune"]["method"] == "lora"
    assert "init_from" in out["yaml"] and out["commands"]["plan"].startswith("fitlm plan plan.yaml")
    (tmp_path / "plan.yaml").write_text(out["yaml"])  # the downloaded YAML, as the command names it
    argv = shlex.split(out["commands"]["plan"].replace("plan.yaml", str(tmp_path / "plan.yaml")))[1:]
    assert out["plan"] == cli_plan([*argv, "--json"], capsys)


def test_a_refused_layout_is_the_rules_message(client, capsys):
    path = str(CONFIGS / "tiny.yaml")
    r = client.post("/api/plan", json={"source": path, "overrides": ["parallel.tensor_parallel=3"]})
    assert r.status_code == 400
    assert main(["plan", path, "--set", "parallel.tensor_parallel=3"]) == 2
    cli = capsys.readouterr().err
    message = r.json()["error"]
    assert "tensor_parallel" in message and message.splitlines()[-1].strip() in cli


@pytest.mark.parametrize(
    "source,expect",
    [("nowhere/at/all.yaml", "does not exist"), ("BADYAML", "malformed YAML at line"), ("EMPTYDIR", "model.init_from")],
)
def test_bad_sources_are_messages_and_the_server_keeps_serving(client, tmp_path, source, expect):
    (tmp_path / "bad.yaml").write_text("model:\n  arch: llama\n hidden_size: 3\n")
    (tmp_path / "empty").mkdir()
    source = {"BADYAML": str(tmp_path / "bad.yaml"), "EMPTYDIR": str(tmp_path / "empty")}.get(source, source)
    r = client.post("/api/plan", json={"source": source})
    assert r.status_code == 400 and expect in r.json()["error"], r.text
    assert "Traceback" not in r.text
    assert client.post("/api/plan", json={"source": "tiny"}).status_code == 200  # still serving


@pytest.mark.parametrize(
    "body,expect",
    [
        ({}, "source: give"),
        ({"source": "tiny", "num_devices": "eight"}, "whole numbers"),
        ({"source": "tiny", "overrides": ["train.lr"]}, "key.path=value"),
        ({"source": "tiny", "overrides": {"train.micro_batch_size": "many"}}, "micro_batch_size"),
        ({"source": "tiny", "device": "tpu-v9"}, "not in the catalog"),
    ],
)
def test_bad_knobs_are_messages(client, body, expect):
    r = client.post("/api/plan", json=body)
    assert r.status_code == 400 and expect in r.json()["error"], r.text


def test_knobs_come_from_the_schema():
    specs = {k["key"]: k for k in knob_specs()}
    assert specs["finetune.method"]["choices"] == ["full", "lora", "qlora", "freeze"]
    assert specs["memory.recompute"]["kind"] == "select" and specs["memory.cpu_offload"]["kind"] == "bool"
    assert specs["parallel.expert_parallel"]["kind"] == "number" and specs["data.seq_length"]["help"]
    assert "tiny" in scenarios()


def _holder(out):
    code = textwrap.dedent(f"""
        import time
        from fitlm.train.run_lock import acquire_run_lock
        lock = acquire_run_lock({str(out)!r}, "fitlm train held.yaml")
        print("locked", flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


@pytest.mark.process
def test_runs_list_states_and_metrics(client, tiny_corpus, tmp_path):
    root = tmp_path / "runs"
    cfg = write_config(tmp_path / "a.yaml", tiny_config(tiny_corpus, root / "done", train={"max_steps": 3}))
    assert main(["train", str(cfg)]) == 0
    held = _holder(root / "live")
    try:
        (root / "live" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "lo')  # a torn last line
        runs = {r["name"]: r for r in client.get("/api/runs").json()["runs"]}
        assert runs["done"]["state"] == "finished" and runs["done"]["step"] == 3 and runs["done"]["model"]
        assert runs["live"]["state"] == "running"
        m = client.get("/api/run/metrics", params={"name": "live"}).json()
        first_line = len('{"step": 1, "loss": 2.5}\n')
        assert [r["step"] for r in m["records"]] == [1] and m["next"] == first_line  # the half-written line waits
        with open(root / "live" / "metrics.jsonl", "a") as f:
            f.write('ss": 2.0}\n')
        m = client.get("/api/run/metrics", params={"name": "live", "since": m["next"]}).json()
        assert (
            m["records"] == [{"step": 2, "loss": 2.0}] and m["next"] == (root / "live" / "metrics.jsonl").stat().st_size
        )
        r = client.post("/api/run/start", json={"source": str(cfg), "name": "live"})  # into the live run's directory
        assert r.status_code == 400 and f"pid {held.pid}" in r.json()["error"] and "in use by a live run" in r.text
    finally:
        held.kill()
        held.wait()
    assert {r["name"]: r["state"] for r in client.get("/api/runs").json()["runs"]}["live"] == "crashed"
    done = client.get("/api/run", params={"name": "done"}).json()
    assert done["lock"]["status"] == "finished" and "max_steps: 3" in done["config_yaml"]


def test_runs_are_training_outputs_and_models_are_offered_to_chat(client, tiny_corpus, tmp_path):
    """Model directories (imported, exported, merged) hold a config.yaml but never trained: they are offered where a
    model is chosen, never listed as runs (they showed as `crashed` at step 0 of 1000)."""
    root = tmp_path / "runs"
    cfg = write_config(tmp_path / "a.yaml", tiny_config(tiny_corpus, root / "done", train={"max_steps": 2}))
    assert main(["train", str(cfg)]) == 0
    models = models_beside_runs(root, root / "done", lambda *a: main(list(a)))
    listed = client.get("/api/runs").json()["runs"]
    assert [(r["name"], r["state"]) for r in listed] == [("done", "finished")]
    offered = client.get("/api/models").json()["models"]
    assert set(offered) == {str(root / "done" / "model"), *(str(p) for p in models.values())}
    r = client.get("/api/run", params={"name": "imported"})
    assert r.status_code == 400 and "Chat or Export view" in r.json()["error"]


@pytest.mark.parametrize("name", ["../outside", "nothing-here", "/etc"])
def test_unknown_or_escaping_run_names_are_refused(client, name):
    r = client.get("/api/run", params={"name": name})
    assert r.status_code == 400 and "no run of that name" in r.json()["error"]


def test_stopping_a_run_that_is_not_running_is_a_message(client, tiny_corpus, tmp_path):
    cfg = write_config(tmp_path / "a.yaml", tiny_config(tiny_corpus, tmp_path / "runs" / "r", train={"max_steps": 1}))
    assert main(["train", str(cfg)]) == 0
    r = client.post("/api/run/stop", json={"name": "r"})
    assert r.status_code == 400 and "not running (finished)" in r.json()["error"]


@pytest.mark.process
def test_stop_saves_a_checkpoint_under_interval_0_and_lists_the_run_stopped(client, tiny_corpus, tmp_path):
    root = tmp_path / "runs"
    train = {"max_steps": 100_000, "eval_interval": 0, "log_interval": 1}
    cfg = write_config(tmp_path / "long.yaml", tiny_config(tiny_corpus, root / "unused", train=train))
    started = client.post("/api/run/start", json={"source": str(cfg), "name": "live"})
    assert started.status_code == 200, started.text
    job = {"id": started.json()["id"]}

    def until(what, cond, timeout=300.0):
        deadline = time.monotonic() + timeout
        while not (found := cond()):
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {client.get('/api/job', params=job)}"
            time.sleep(0.2)
        return found

    def logged_step() -> int:
        records = client.get("/api/run/metrics", params={"name": "live"}).json().get("records", [])
        return max((r.get("step", 0) for r in records), default=0)

    def job_when_ended() -> dict | None:
        j = client.get("/api/job", params=job).json()
        return None if j["state"] == "running" else j

    try:
        until("step 2", lambda: logged_step() >= 2)
        assert client.post("/api/run/stop", json={"name": "live"}).status_code == 200
        ended = until("the run to end", job_when_ended)
    finally:
        status, info = lock_status(root / "live")
        if status == "running":
            os.kill(int(info["pid"]), signal.SIGKILL)
    assert ended["state"] == "stopped" and ended["returncode"] == 143, ended["log"]
    steps = [s for s, _ in list_checkpoints(root / "live" / "checkpoints")]
    assert len(steps) == 1 and f"stopped by SIGTERM after step {steps[0]}; checkpoint" in ended["log"]
    assert {r["name"]: r["state"] for r in client.get("/api/runs").json()["runs"]}["live"] == "stopped"


@pytest.mark.parametrize(
    "body,expect",
    [
        ({"model": "", "format": "gguf", "out": "x.gguf"}, "model must be given"),
        ({"model": "/no/such/model", "format": "gguf", "out": "x.gguf"}, "does not exist"),
    ],
)
def test_bad_exports_are_messages(client, body, expect):
    r = client.post("/api/export", json=body)
    assert r.status_code == 400 and expect in r.json()["error"]


@pytest.mark.parametrize(
    "body,expect",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "pick a model"),
        ({"model": "m", "messages": []}, "messages: a list"),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens 0"),
        ({"model": "/no/model", "messages": [{"role": "user", "content": "hi"}]}, "does not exist"),
    ],
)
def test_bad_chats_are_messages(client, body, expect):
    r = client.post("/api/chat", json=body)
    assert r.status_code == 400 and expect in r.json()["error"], r.text


def test_pages_and_assets_are_served_from_the_package(client):
    for path in ("/plan", "/runs", "/runs/some/run", "/chat", "/export"):
        r = client.get(path)
        assert r.status_code == 200 and '<main id="view"' in r.text
    page = client.get("/plan").text
    links = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert links and all(u.startswith(("/", "#", "data:")) and not u.startswith("//") for u in links), links
    for asset in [u for u in links if u.startswith("/static/")]:
        r = client.get(asset)
        assert r.status_code == 200
        # offline: no URL of another host (the SVG namespace is a name, never fetched)
        assert not re.findall(r"https?://(?!www\.w3\.org/2000/svg)", r.text), asset


def test_a_checkpoint_is_planned_with_the_config_of_its_run(client, tiny_corpus, tmp_path, capsys):
    out = tmp_path / "runs" / "r"
    cfg = tiny_config(tiny_corpus, out, train={"max_steps": 2, "micro_batch_size": 2}, checkpoint={"interval": 1})
    assert main(["train", str(write_config(tmp_path / "a.yaml", cfg))]) == 0
    capsys.readouterr()
    r = client.post("/api/plan", json={"source": str(out / "checkpoints" / "step_00000002")})
    assert r.status_code == 200, r.text
    assert r.json()["plan"] == cli_plan(["plan", str(out / "config.yaml"), "--json"], capsys)
    assert "mbs=2" in r.json()["plan"]["memory_options"]


def test_other_pages_cannot_drive_it(client):
    ok = {"source": "tiny"}
    assert client.post("/api/plan", json=ok).status_code == 200
    # A form or text/plain post (no CORS preflight) from another page: refused before any work.
    r = client.post("/api/run/start", content=json.dumps(ok), headers={"content-type": "text/plain"})
    assert r.status_code == 415
    r = client.post("/api/plan", json=ok, headers={"origin": "http://evil.example"})
    assert r.status_code == 403 and "evil.example" in r.json()["error"]
    assert client.post("/api/plan", json=ok, headers={"origin": "http://127.0.0.1:8765"}).status_code == 200
    r = client.get("/api/runs", headers={"host": "rebound.example:8765"})  # a DNS name rebound to 127.0.0.1
    assert r.status_code == 421


def test_odd_metrics_lines_still_list_and_chart(client, tmp_path):
    run = tmp_path / "runs" / "odd"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(
        '5\nnull\n{"step": 1, "loss": NaN, "grad_norm": Infinity}\n{"step": 2, "loss": 1.5}\n'
    )
    (run / "config.yaml").write_text("train: 3\nmodel: [a]\n")  # sections that are not mappings
    assert client.get("/api/runs").json()["runs"][0]["loss"] == 1.5
    m = client.get("/api/run/metrics", params={"name": "odd"}).json()
    assert m["records"] == [{"step": 1, "loss": None, "grad_norm": None}, {"step": 2, "loss": 1.5}]
    assert client.get("/api/run/metrics", params={"name": "odd", "since": -1}).status_code == 422


def test_a_grpo_run_shows_the_completions_of_its_last_logged_step(client, tmp_path):
    run = tmp_path / "runs" / "grpo"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 0.1, "reward": 0.5}\n')
    rows = [
        {"step": s, "prompt": f"p{i}", "completion": f"c{s}.{i}", "reward": None if i == 1 else s + i / 10, "e": 1.0}
        for s in (1, 2)
        for i in range(3)
    ]
    lines = [json.dumps(r) for r in rows]
    (run / "rollouts.jsonl").write_text("\n".join(lines) + '\n{"step": 3, "prompt": "torn')  # a half-written line
    got = client.get("/api/run", params={"name": "grpo"}).json()["rollouts"]
    assert got == {
        "step": 2,
        "columns": ["prompt", "completion", "reward", "e"],
        "rows": [["p0", "c2.0", 2.0, 1.0], ["p1", "c2.1", None, 1.0], ["p2", "c2.2", 2.2, 1.0]],
    }
    (run / "rollouts.jsonl").unlink()
    assert client.get("/api/run", params={"name": "grpo"}).json()["rollouts"] is None


def test_a_job_reports_the_progress_lines_its_command_prints(monkeypatch, capsys):
    """fitlm.progress.counted prints "<what>: i/n, elapsed …, ETA …" lines where FITLM_PROGRESS_LINES is set (the UI's
    export jobs set it), and the job's JSON carries the last count, which the Export view draws as a progress bar."""
    from fitlm.progress import PROGRESS_INTERVAL, PROGRESS_LINES, counted
    from fitlm.ui.jobs import _progress

    monkeypatch.setenv(PROGRESS_LINES, "1")
    monkeypatch.setenv(PROGRESS_INTERVAL, "0")
    assert list(counted(iter("abc"), 3, "weights (blocks)")) == ["a", "b", "c"]
    log = "loading\n" + capsys.readouterr().err + "exported\n"
    assert log.count("weights (blocks): ") == 3 and "weights (blocks): 3/3, elapsed " in log
    assert _progress(log) == [3, 3] and _progress("loading\n") is None
