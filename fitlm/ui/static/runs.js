// The Runs view: every run under RUNS_DIR (GET /api/runs), and a run's page with live charts from
// metrics.jsonl (GET /api/run/metrics, polled: new lines appear within the poll interval).
"use strict";

const POLL_MS = 2000;
const DETAIL_MS = 5000;  // the run's head (step, checkpoints) is re-read at most this often
const CHARTS = [
  ["loss-chart", "loss", [["loss", "loss"], ["eval loss", "eval_loss"]]],
  ["lr-chart", "learning rate", [["lr", "lr"]]],
  ["grad-chart", "gradient norm", [["grad norm", "grad_norm"]]],
  ["tps-chart", "tokens/s", [["tokens/s", "tokens_per_s"]]],
  ["mfu-chart", "MFU", [["MFU", "mfu"]]],
  ["peak-chart", "peak memory (GiB)", [["peak", "peak_bytes", 1 / GiB]]],
  // GRPO (finetune.objective: grpo): charts of the keys only its runs log, so other runs never show them
  ["reward-chart", "reward", [["reward", "reward"], ["reward std", "reward_std"]]],
  ["kl-chart", "KL and clipped share", [["KL", "kl"], ["clipped (region)", "clip_ratio/region_mean"],
    ["clipped low", "clip_ratio/low_mean"], ["clipped high", "clip_ratio/high_mean"]]],
  ["groups-chart", "groups and completions", [["groups with equal rewards", "frac_reward_zero_std"],
    ["truncated completions", "completions/clipped_ratio"]]],
  ["length-chart", "completion length (tokens)", [["mean", "completions/mean_length"], ["max", "completions/max_length"]]],
  ["entropy-chart", "entropy (nats per token)", [["entropy", "entropy"]]],
  ["sampling-chart", "sampling tokens/s", [["sampling tokens/s", "sampling_tokens_per_s"]]],
];

function badge(s) { return el("span", {class: "state " + s, "data-testid": "run-state"}, s); }

VIEWS.runs = async function (main, info, name) {
  if (name) {
    let decoded = name;
    try { decoded = name.split("/").map(decodeURIComponent).join("/"); } catch (e) { /* shown as typed */ }
    return runPage(main, decoded);
  }
  const error = alertBox("runs-error");
  const body = el("div", {});
  main.append(el("h1", {}, "Runs"), el("p", {class: "muted"}, `under ${info.runs_dir}`), error, body);
  let last = "";
  async function refresh() {
    try {
      const r = await api("/api/runs");
      showError(error, "");
      const now = JSON.stringify(r.runs);
      if (now === last) return;  // unchanged: keep the table (and the keyboard focus in it)
      last = now;
      body.replaceChildren(r.runs.length ? table(
        ["run", "state", "step", "loss", "eval loss", "tokens/s", "checkpoints", "model"],
        r.runs.map((x) => [el("a", {href: runHref(x.name)}, x.name), badge(x.state),
          x.max_steps ? `${x.step} / ${x.max_steps}` : String(x.step), num(x.loss, 4), num(x.eval_loss, 4),
          num(x.tokens_per_s), String(x.checkpoints.length), x.model ? "yes" : "–"]),
        {"data-testid": "runs-table"}) : el("p", {}, "No runs yet: start one from the Plan view, or `fitlm train`."));
    } catch (e) { showError(error, e.message); }
  }
  await refresh();
  return setInterval(refresh, 3000);
};

async function runPage(main, name) {
  const error = alertBox("run-error");
  const head = el("div", {class: "run-head"});
  const charts = el("div", {class: "charts"});
  const events = el("section", {"aria-label": "events"});
  const extra = el("div", {});
  main.append(el("h1", {}, name), head, error, charts, events, extra);
  const records = [];
  let next = 0, detail = null, shown = Date.now();
  try {
    detail = await api("/api/run?name=" + encodeURIComponent(name));
  } catch (e) {
    showError(error, e.message);
    return null;
  }
  drawHead(head, detail, name, error);
  drawExtra(extra, detail, name);
  async function poll() {
    try {
      const r = await api(`/api/run/metrics?name=${encodeURIComponent(name)}&since=${next}`);
      if (r.state !== detail.state || (r.records.length && Date.now() - shown > DETAIL_MS)) {
        detail = await api("/api/run?name=" + encodeURIComponent(name));  // state, step, checkpoints
        shown = Date.now();
        drawHead(head, detail, name, error);
      }
      if (r.records.length || !charts.childElementCount) {
        for (const x of r.records) records.push(x);  // (a spread of 10^5 records exceeds the argument limit)
        next = r.next;
        drawCharts(charts, events, records);
      }
    } catch (e) { showError(error, e.message); }
  }
  await poll();
  return setInterval(poll, POLL_MS);
}

function drawHead(head, d, name, error) {
  const stop = d.state === "running" ? el("button", {type: "button", onclick: async (e) => {
    try {
      await api("/api/run/stop", {name});
      e.target.textContent = "Stopping (checkpoint at the end of this step)…";
      e.target.disabled = true;
    } catch (err) { showError(error, err.message); }
  }}, "Stop (SIGTERM)") : null;
  fill(head, el("p", {}, badge(d.state), ` step ${d.step}${d.max_steps ? " / " + d.max_steps : ""}`,
    d.arch ? ` · ${d.arch} ${d.method}` : "", ` · checkpoints: ${d.checkpoints.join(", ") || "none"}`,
    d.model ? " · final model: yes" : ""), stop);
}

function drawCharts(charts, events, records) {
  const marks = records.filter((r) => r.guard || r.warning).map((r) => ({
    x: r.step, kind: r.guard ? "guard" : "warning",
    label: `step ${r.step}: ${r.guard || r.warning}: ${r.reason || r.message}` + (r.action ? ` (action ${r.action})` : ""),
  }));
  // train.observe.eval_tasks: every eval/<task>/<metric> the run logged, one chart of all of them
  const taskKeys = [...new Set(records.flatMap((r) => Object.keys(r).filter((k) => k.startsWith("eval/"))))].sort();
  const specs = taskKeys.length ? [...CHARTS, ["eval-tasks-chart", "evaluation tasks", taskKeys.map((k) => [k.slice(5), k])]] : [...CHARTS];
  // GRPO with several reward functions: each function's mean reward (rewards/<name>/mean) beside the total
  const funcKeys = [...new Set(records.flatMap((r) => Object.keys(r).filter((k) => /^rewards\/.+\/mean$/.test(k))))];
  if (funcKeys.length) specs.push(["reward-funcs-chart", "reward by function", funcKeys.map((k) => [k.slice(8, -5), k])]);
  fill(charts, ...specs.map(([testid, title, series]) => {
    const s = series.map(([label, key, scale]) => ({
      name: label, points: records.filter((r) => typeof r[key] === "number").map((r) => [r.step, r[key] * (scale || 1)]),
    }));
    const count = testid === "loss-chart" ? s[0].points.length : undefined;
    return s.every((x) => !x.points.length) && testid !== "loss-chart" ? null :
      lineChart({testid, title, series: s.filter((x) => x.points.length || testid === "loss-chart"), markers: marks, count});
  }).filter(Boolean));
  fill(events, ...(marks.length ? [el("h2", {}, "Guard interventions and warnings"),
    el("ul", {"data-testid": "run-events"}, marks.map((m) => el("li", {class: m.kind}, m.label)))] : []));
}

function drawExtra(box, d, name) {
  const parts = [];
  const prof = d.profile_report;
  if (prof && prof.error) parts.push(el("p", {class: "warn"}, prof.error));
  else if (prof) {
    parts.push(el("h2", {}, "Profile: measured beside the plan"),
      table(["", "measured", "planned"], prof.timing.map((t) => {
        const f = t.what === "MFU" ? pct : (v) => num(v, t.what === "tokens/s" ? 0 : 4);
        return [t.what, f(t.measured), f(t.planned)];
      }),
        {"data-testid": "profile-timing"}),
      table(["per device", "measured", "planned"], prof.memory.map((m) => [m.what, gib(m.measured), gib(m.planned)])),
      el("div", {class: "plots"}, prof.plots.map((p) => el("img", {
        src: `/api/run/file?name=${encodeURIComponent(name)}&file=${encodeURIComponent(p)}`,
        alt: `profile plot ${p}`, loading: "lazy"}))));
    if (prof.report_md) parts.push(el("details", {}, el("summary", {}, "report.md"), el("pre", {}, prof.report_md)));
  }
  const ev = d.evaluation;
  if (ev && ev.error) parts.push(el("p", {class: "warn"}, ev.error));
  else if (ev) {
    parts.push(el("h2", {}, "Evaluation (fitlm eval)"), table(["task", "metric", "value", "± stderr"],
      ev.rows.map((r) => [r.task, r.metric, num(r.value, 4), typeof r.stderr === "number" ? num(r.stderr, 4) : ""]),
      {"data-testid": "run-evaluation"}));
  }
  const ro = d.rollouts;
  if (ro) {
    parts.push(el("h2", {}, `Completions of step ${ro.step} (rollouts.jsonl)`), table(ro.columns,
      ro.rows.map((r) => r.map((v) => typeof v === "number" ? num(v, 4) : v === null ? "" : String(v))),
      {"data-testid": "run-rollouts", class: "rollouts"}));
  }
  if (d.config_yaml) {
    parts.push(el("details", {}, el("summary", {}, "config.yaml"), el("pre", {"data-testid": "run-config"}, d.config_yaml)));
  }
  if (d.model) parts.push(el("p", {}, el("a", {href: "/chat?model=" + encodeURIComponent(d.path)}, "Chat with it"), " · ",
    el("a", {href: "/export?model=" + encodeURIComponent(d.path)}, "Export it")));
  fill(box, parts);
}
