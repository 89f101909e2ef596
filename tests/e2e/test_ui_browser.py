"""`fitlm ui` in a real headless browser (Debian's chromium + chromium-driver, driven by selenium): the page's
numbers are the CLI's, a run started from the page trains, gains points live and stops on SIGTERM, a chat reply
is `fitlm generate`'s greedy text, an export writes its file, bad input is a message, and the views hold at
phone width with labelled controls. The screenshots in docs/img/ are taken here, so they stay current."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fitlm.train.run_lock import lock_status
from tests.e2e.helpers import fitlm, tiny_config, write_config
from tests.e2e.test_grpo_cli import MODEL, prompt_data
from tests.e2e.test_grpo_cli import config as grpo_config
from tests.unit.serve_models import models_beside_runs

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "docs" / "img"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
try:
    import httpx
    from selenium import webdriver
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select, WebDriverWait
except ImportError:  # the test extra installs selenium
    webdriver = None

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        webdriver is None or not (CHROMIUM and DRIVER),
        reason="needs selenium (the test extra) and a browser: apt-get install chromium chromium-driver "
        "(.ci/run installs both)",
    ),
]
WAIT_S = 120  # generous: nothing here measures speed, a busy machine only takes longer


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_corpus):
    tmp = tmp_path_factory.mktemp("ui")
    root = tmp / "runs"
    # Guards that warn on small gradient-norm spikes: a finished run with interventions to mark (warn only).
    guards = {"grad_spike_sigma": 0.5, "loss_spike_sigma": 0.5, "warmup_steps": 3, "window": 5}
    done = write_config(
        tmp / "done.yaml",
        tiny_config(tiny_corpus, root / "done", train={"max_steps": 30, "observe": {"guards": guards}}),
    )
    assert fitlm("train", done).returncode == 0
    (grpo := tmp / "grpo-data").mkdir()  # a GRPO run: its reward, KL and length charts, its last completions
    prompt_data(grpo, tiny_corpus["tokenizer"])
    trained = fitlm("train", write_config(tmp / "grpo.yaml", grpo_config(grpo, MODEL, root / "grpo")))
    assert trained.returncode == 0, trained.stderr[-2000:]
    profiled = fitlm("profile", done, "--steps", "3", "--out", root / "prof")
    assert profiled.returncode == 0, profiled.stderr
    models = models_beside_runs(root, root / "done", lambda *a: fitlm(*a).returncode)
    tasks = Path(__file__).resolve().parents[2] / "examples" / "eval" / "shakespeare_mc.jsonl"
    evaluated = fitlm("eval", root / "done", "--tasks", tasks, "--limit", "3")  # eval.json beside the run
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    # A run that goes on until stopped: a step logged each step, no periodic checkpoint (interval 0, the demo's):
    # the Stop button's SIGTERM saves the only one.
    long = write_config(
        tmp / "long.yaml",
        tiny_config(
            tiny_corpus,
            root / "unused",
            train={"max_steps": 100_000, "eval_interval": 0, "log_interval": 1},
            checkpoint={"interval": 0},
        ),
    )
    server = subprocess.Popen(
        [sys.executable, "-m", "fitlm.cli", "ui", str(root), "--port", "0"], stderr=subprocess.PIPE, text=True
    )
    banner = server.stderr.readline()
    assert " at http://" in banner, banner
    url = banner.split(" at ")[-1].strip().rstrip("/")
    opts = webdriver.ChromeOptions()
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,1000",
    ):
        opts.add_argument(arg)
    opts.binary_location = CHROMIUM
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    driver.set_page_load_timeout(WAIT_S)
    SHOTS.mkdir(parents=True, exist_ok=True)
    try:
        yield {"url": url, "root": root, "done": done, "long": long, "driver": driver, "tmp": tmp, "models": models}
    finally:
        driver.quit()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        for d in root.iterdir():  # a run left going by a failed test: stop it (SIGTERM saves, then exits)
            status, info = lock_status(d)
            if status == "running":
                subprocess.run(["kill", "-TERM", str(info["pid"])], check=False)


def wait(driver, what, timeout=WAIT_S):
    """`what(driver)` once truthy. A live view redraws its charts and head as points arrive, so an element found
    a moment ago can be replaced before it is read (stale): that try counts as not yet, like a missing one."""
    ignored = (NoSuchElementException, StaleElementReferenceException)
    return WebDriverWait(driver, timeout, poll_frequency=0.2, ignored_exceptions=ignored).until(lambda d: what(d))


def find(driver, xpath):
    """The element at `xpath` once the view has drawn it (views draw after their first JSON call)."""
    return wait(driver, lambda d: (found := d.find_elements(By.XPATH, xpath)) and found[0])


def by_testid(driver, name):
    found = driver.find_elements(By.CSS_SELECTOR, f'[data-testid="{name}"]')
    return found[0] if found and found[0].is_displayed() else None


def cli_plan(*args) -> dict:
    r = fitlm("plan", *args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def set_knob(driver, key, value):
    c = driver.find_element(By.CSS_SELECTOR, f'[data-key="{key}"]')
    if c.tag_name == "select":
        Select(c).select_by_value(json.dumps(value))
    else:
        type_into(c, value, Keys.TAB)  # leaving the field fires its change event


def type_into(c, value, *then):
    """Replace a field's text as a user does (select all, type); clear() leaves number fields as they were."""
    c.send_keys(Keys.CONTROL, "a")
    c.send_keys(Keys.DELETE)
    c.send_keys(str(value), *then)


def test_plan_numbers_are_the_clis(world):
    d, config = world["driver"], str(world["done"])
    d.get(f"{world['url']}/plan?config={config}")
    total = wait(d, lambda d: by_testid(d, "plan-total"))
    cli = cli_plan(config)
    assert int(total.get_attribute("data-bytes")) == cli["per_device"]["total"]
    assert by_testid(d, "plan-device-source").text == cli["device_source"]["note"]  # which device, and why
    set_knob(d, "train.micro_batch_size", 2)
    set_knob(d, "memory.recompute", "full")
    want = cli_plan(config, "--set", "train.micro_batch_size=2", "--set", "memory.recompute=full")
    wait(d, lambda d: by_testid(d, "plan-total").get_attribute("data-bytes") == str(want["per_device"]["total"]))
    shown = by_testid(d, "cmd-plan").text
    assert "--set train.micro_batch_size=2" in shown and "--set memory.recompute=full" in shown
    d.get(f"{world['url']}/plan?config={config}&device=rtx4090&num_devices=1")
    wait(d, lambda d: by_testid(d, "plan-total"))
    find(d, "//button[text()='Fastest layout']").click()
    found = wait(d, lambda d: by_testid(d, "plan-search"))
    assert "Fastest fitting layouts on 1 devices" in found.text
    # A shipped scenario by name: the guide's 7B LoRA on one 24 GB card.
    d.get(f"{world['url']}/plan?config=guide-7b-lora-24gb&device=rtx4090")
    total = wait(d, lambda d: by_testid(d, "plan-total"))
    want = cli_plan(ROOT / "configs" / "guide-7b-lora-24gb.yaml", "--device", "rtx4090")
    assert int(total.get_attribute("data-bytes")) == want["per_device"]["total"]
    assert by_testid(d, "plan-fits").get_attribute("data-fits") == str(want["fits"]).lower()
    d.save_screenshot(str(SHOTS / "ui-plan.png"))


def test_a_refused_layout_shows_the_rules_message(world):
    d, config = world["driver"], str(world["done"])
    d.get(f"{world['url']}/plan?config={config}")
    wait(d, lambda d: by_testid(d, "plan-total"))
    set_knob(d, "parallel.tensor_parallel", 3)
    box = wait(d, lambda d: by_testid(d, "plan-error"))
    cli = fitlm("plan", config, "--set", "parallel.tensor_parallel=3")
    assert cli.returncode == 2
    assert box.text.splitlines()[-1].strip().lstrip("- ") in cli.stderr and "tensor_parallel" in box.text
    assert by_testid(d, "plan-total") is None  # no stale figures beside the refusal


@pytest.mark.parametrize("kind", ["missing", "bad-yaml", "not-a-model"])
def test_bad_input_is_a_message_on_the_page(world, kind):
    d, tmp = world["driver"], world["tmp"]
    (tmp / "bad.yaml").write_text("model:\n  arch: llama\n hidden_size: 3\n")
    (tmp / "empty-dir").mkdir(exist_ok=True)
    source, expect = {
        "missing": (str(tmp / "nowhere.yaml"), "does not exist"),
        "bad-yaml": (str(tmp / "bad.yaml"), "malformed YAML at line 3"),
        "not-a-model": (str(tmp / "empty-dir"), "is not a model"),
    }[kind]
    d.get(f"{world['url']}/plan?config={source}")
    box = wait(d, lambda d: by_testid(d, "plan-error"))
    assert expect in box.text and "Traceback" not in d.page_source
    d.get(f"{world['url']}/plan?config={world['done']}")  # the server keeps serving
    assert wait(d, lambda d: by_testid(d, "plan-total"))


def test_start_watch_and_stop_a_run_from_the_page(world):
    d, url, root = world["driver"], world["url"], world["root"]
    d.get(f"{url}/plan?config={world['long']}")
    wait(d, lambda d: by_testid(d, "plan-total"))
    name = find(d, "//label[text()='Run name']/following-sibling::input")
    type_into(name, "live")
    find(d, "//button[text()='Start run']").click()
    status = wait(d, lambda d: by_testid(d, "start-status") if "watch it" in (d.page_source or "") else None)
    assert "fitlm train" in status.text
    d.find_element(By.LINK_TEXT, "watch it").click()
    chart = wait(d, lambda d: by_testid(d, "loss-chart"))
    d.execute_script("window.__sameDocument = true")  # gone if the page reloads
    first = wait(d, lambda d: int(by_testid(d, "loss-chart").get_attribute("data-points") or 0) or None)
    wait(d, lambda d: int(by_testid(d, "loss-chart").get_attribute("data-points")) > first)
    assert d.execute_script("return window.__sameDocument") is True  # points came without a reload
    # the chart's points are metrics.jsonl's loss records (warnings may sit between them)
    records = [json.loads(x) for x in (root / "live" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in records if "loss" in r]) >= first
    # A second run into the live run's directory: refused with the run lock's message.
    r = httpx.post(f"{url}/api/run/start", json={"source": str(world["long"]), "name": "live"}, timeout=WAIT_S)
    holder = lock_status(root / "live")[1]
    assert r.status_code == 400 and f"pid {holder['pid']}" in r.json()["error"]
    d.save_screenshot(str(SHOTS / "ui-run.png"))
    find(d, "//button[starts-with(text(), 'Stop')]").click()
    wait(d, lambda d: d.find_element(By.CSS_SELECTOR, '[data-testid="run-state"]').text == "stopped")
    assert lock_status(root / "live")[0] == "stopped"
    assert list((root / "live" / "checkpoints").glob("step_*")), "SIGTERM saves a checkpoint"
    assert chart is not None
    d.get(f"{url}/runs")
    # (read inside the wait: the list redraws when a run changes)
    wait(d, lambda d: (t := by_testid(d, "runs-table")) and all(w in t.text for w in ("live", "stopped", "finished")))
    d.save_screenshot(str(SHOTS / "ui-runs.png"))


def _chat(d, url, model, text, template, max_tokens):
    d.get(f"{url}/chat?model={model}")
    Select(find(d, "//label[text()='Template']/following-sibling::select")).select_by_value(template)
    n = find(d, "//label[text()='Max tokens']/following-sibling::input")
    type_into(n, max_tokens)
    find(d, "//label[text()='Message']/following-sibling::textarea").send_keys(text)
    find(d, "//button[text()='Send']").click()
    # (found, not "displayed": a greedy reply of a tiny model can be all newlines)
    reply = wait(d, lambda d: [r for r in d.find_elements(By.CSS_SELECTOR, '[data-testid="chat-reply"][data-done]')])[0]
    return d.execute_script("return arguments[0].textContent", reply)


def test_chat_reply_is_fitlm_generates_greedy_text(world):
    d, url, model = world["driver"], world["url"], world["root"] / "done"
    got = _chat(d, url, model, "KING.", "none", 24)
    r = fitlm("generate", model, "--prompt", "KING.", "--max-new-tokens", "24", "--json")
    assert r.returncode == 0, r.stderr
    assert got == json.loads(r.stdout)["text"]
    got = _chat(d, url, model, "Who is the king?", "model", 16)  # the model's chat template, as `fitlm serve`
    from fitlm.infer import generate
    from fitlm.serve.model import load_served

    served = load_served(model)
    ids = served.chat_ids([{"role": "user", "content": "Who is the king?"}])
    assert got == served.tokenizer.decode(generate(served.model, ids, 16, eos_id=served.tokenizer.stop_ids))
    d.save_screenshot(str(SHOTS / "ui-chat.png"))
    d.get(f"{url}/chat?model={world['tmp'] / 'no-model'}")
    find(d, "//label[text()='Message']/following-sibling::textarea").send_keys("hi")
    find(d, "//button[text()='Send']").click()
    assert "does not exist" in wait(d, lambda d: by_testid(d, "chat-error")).text


def test_export_writes_the_file_and_lists_it(world):
    d, url = world["driver"], world["url"]
    out = world["tmp"] / "exported.gguf"
    d.get(f"{url}/export?model={world['root'] / 'done'}")
    Select(find(d, "//label[text()='Format']/following-sibling::select")).select_by_value("gguf")
    o = find(d, "//label[text()='Output path']/following-sibling::input")
    type_into(o, out)
    find(d, "//button[text()='Export']").click()
    state = wait(d, lambda d: by_testid(d, "export-state"))
    assert state.get_attribute("data-state") == "done", d.find_element(By.CSS_SELECTOR, "pre.log").text
    assert str(out) in by_testid(d, "export-files").text and out.read_bytes()[:4] == b"GGUF"
    # the progress the page draws while it runs: the CLI's block count, to the last block
    done = re.findall(r"^weights \(blocks\): (\d+)/(\d+), ", d.find_element(By.CSS_SELECTOR, "pre.log").text, re.M)
    assert done and done[-1][0] == done[-1][1] and len(done) == int(done[-1][1])
    d.save_screenshot(str(SHOTS / "ui-export.png"))


def test_runs_view_lists_runs_and_models_are_offered_where_one_is_chosen(world):
    """An imported and an exported model under RUNS_DIR: not rows of the Runs view (they were shown as crashed
    runs), but choices in the Chat and Export views' model lists, beside the finished run's model."""
    d, url, root = world["driver"], world["url"], world["root"]
    d.get(f"{url}/runs")
    table = wait(d, lambda d: by_testid(d, "runs-table"))
    names = {a.text for a in table.find_elements(By.CSS_SELECTOR, "tbody tr td:first-child a")}
    assert {"done", "prof"} <= names and not names & {"imported", "exported"}, names
    models = {str(p) for p in world["models"].values()} | {str(root / "done" / "model")}
    for view, datalist in (("chat", "models"), ("export", "ex-models")):
        d.get(f"{url}/{view}")
        find(d, "//main//form")
        offered = {o.get_attribute("value") for o in d.find_elements(By.CSS_SELECTOR, f"datalist#{datalist} option")}
        assert models <= offered and str(root / "prof") not in offered, (view, offered)


def test_guard_interventions_are_marked_on_the_charts(world):
    d = world["driver"]
    records = [json.loads(x) for x in (world["root"] / "done" / "metrics.jsonl").read_text().splitlines()]
    events = [r for r in records if "guard" in r or "warning" in r]
    assert events, "the fixture's guards should have warned"
    d.get(f"{world['url']}/runs/done")
    listed = wait(d, lambda d: by_testid(d, "run-events"))
    items = listed.find_elements(By.TAG_NAME, "li")
    assert [i.text.split(":")[0] for i in items] == [f"step {r['step']}" for r in events]
    chart = by_testid(d, "loss-chart")
    assert int(chart.get_attribute("data-points")) == len([r for r in records if "loss" in r])
    assert len(chart.find_elements(By.CSS_SELECTOR, "line.marker")) == len(events)


def test_a_grpo_run_charts_its_rewards_and_shows_its_last_completions(world):
    d = world["driver"]
    out = world["root"] / "grpo"
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]
    d.get(f"{world['url']}/runs/grpo")
    table = wait(d, lambda d: by_testid(d, "run-rollouts"))
    last = [r for r in rollouts if r["step"] == rollouts[-1]["step"]]
    rows = [
        [c.text for c in r.find_elements(By.TAG_NAME, "td")] for r in table.find_elements(By.CSS_SELECTOR, "tbody tr")
    ]
    assert [r[:2] for r in rows] == [[r["prompt"], r["completion"].strip()] for r in last]
    assert [float(r[2]) for r in rows] == pytest.approx([r["reward"] for r in last], abs=1e-4)
    charts = {  # a chart's points: every series' (metrics.jsonl's step records holding the key)
        "reward-chart": ("reward", "reward_std"),
        "reward-funcs-chart": ("rewards/e_share/mean",),
        "length-chart": ("completions/mean_length", "completions/max_length"),
        "sampling-chart": ("sampling_tokens_per_s",),
    }
    for testid, keys in charts.items():
        chart = wait(d, lambda d, t=testid: by_testid(d, t))
        points = sum(isinstance(r.get(k), (int, float)) for r in records for k in keys)
        assert points and int(chart.get_attribute("data-points") or -1) == points, testid
    d.save_screenshot(str(SHOTS / "ui-grpo.png"))
    d.get(f"{world['url']}/runs/done")  # a run without GRPO keys has none of these charts
    wait(d, lambda d: by_testid(d, "loss-chart"))
    assert not d.find_elements(By.CSS_SELECTOR, '[data-testid="reward-chart"], [data-testid="run-rollouts"]')


def test_a_profile_report_is_shown_beside_the_plan(world):
    d = world["driver"]
    d.get(f"{world['url']}/runs/prof")
    table = wait(d, lambda d: by_testid(d, "profile-timing"))
    report = json.loads((world["root"] / "prof" / "profile.json").read_text())
    rows = {r.find_elements(By.TAG_NAME, "td")[0].text: r for r in table.find_elements(By.CSS_SELECTOR, "tbody tr")}
    cells = [c.text for c in rows["tokens/s"].find_elements(By.TAG_NAME, "td")]
    assert cells[1:] == [f"{report['tokens_per_s']:,.0f}", f"{report['plan']['timing']['tokens_per_s']:,.0f}"]
    plots = wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, ".plots img"))
    assert {p.get_attribute("alt") for p in plots} == {
        f"profile plot {f.name}" for f in (world["root"] / "prof").glob("*.png")
    }
    d.execute_script("arguments[0].scrollIntoView()", plots[0])
    wait(d, lambda d: all(d.execute_script("return arguments[0].naturalWidth", p) > 0 for p in plots))


def test_an_evaluated_run_shows_its_scores(world):
    d = world["driver"]
    d.get(f"{world['url']}/runs/done")
    table = wait(d, lambda d: by_testid(d, "run-evaluation"))
    results = json.loads((world["root"] / "done" / "eval.json").read_text())["results"]["shakespeare_mc"]
    rows = [
        [c.text for c in r.find_elements(By.TAG_NAME, "td")] for r in table.find_elements(By.CSS_SELECTOR, "tbody tr")
    ]
    assert [r[:2] for r in rows] == [["shakespeare_mc", "acc"], ["shakespeare_mc", "acc_norm"]]
    assert [float(r[2]) for r in rows] == pytest.approx([results["acc,none"], results["acc_norm,none"]], abs=1e-4)


def test_views_hold_at_phone_width_with_labelled_controls(world):
    d, url = world["driver"], world["url"]
    d.set_window_size(390, 844)
    try:
        for path, ready in [
            (f"/plan?config={world['done']}", "plan-total"),
            ("/runs", "runs-table"),
            ("/runs/done", "loss-chart"),
            ("/chat", None),
            ("/export", None),
        ]:
            d.get(url + path)
            if ready:
                wait(d, lambda d, ready=ready: by_testid(d, ready))
            else:
                wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, "main form"))
            overflow = d.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
            assert overflow <= 0, f"{path}: {overflow} px wider than the phone's screen"
            unlabelled = d.execute_script(
                "return [...document.querySelectorAll('input, select, textarea')]"
                ".filter(e => e.type !== 'hidden' && !e.labels.length && !e.getAttribute('aria-label'))"
                ".map(e => e.outerHTML.slice(0, 80))"
            )
            assert not unlabelled, f"{path}: controls without a label: {unlabelled}"
            assert not d.execute_script(
                "return [...document.querySelectorAll('[tabindex]')].filter(e => e.tabIndex > 0)"
            )
            if path.startswith("/plan"):
                d.save_screenshot(str(SHOTS / "ui-plan-phone.png"))
        # Focus order follows the page: the skip link first, then the views' links in order.
        d.get(url + "/chat")
        wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, "main form"))
        order = []
        for _ in range(6):
            d.switch_to.active_element.send_keys(Keys.TAB)
            order.append(d.switch_to.active_element.text)
        assert order[:6] == ["Skip to content", "fitlm", "Plan", "Runs", "Chat", "Export"], order
    finally:
        d.set_window_size(1280, 1000)


def test_a_non_local_host_is_warned_about(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "fitlm.cli", "ui", str(tmp_path), "--host", "0.0.0.0", "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = proc.stderr.readline()
        assert "warning: listening on 0.0.0.0" in first and "--host 127.0.0.1" in first
        assert " at http://0.0.0.0:" in proc.stderr.readline()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
