// The Plan view: a source and the knobs in, `fitlm plan --json`'s object out (POST /api/plan), drawn.
"use strict";

function knobControl(k, value) {
  let c;
  if (k.kind === "select") {
    c = el("select", {name: k.key, "data-key": k.key},
      k.choices.map((v) => el("option", {value: JSON.stringify(v), selected: JSON.stringify(v) === JSON.stringify(value)},
        String(v))));
  } else if (k.kind === "bool") {
    c = el("input", {type: "checkbox", name: k.key, "data-key": k.key, checked: !!value});
  } else {
    c = el("input", {type: "number", name: k.key, "data-key": k.key, min: 0, step: 1, value: value ?? k.default});
  }
  c.title = k.help;  // the whole docstring; the line under the control is its first clause
  return field(k.label, c, shortHelp(k.help));
}

function shortHelp(text) {
  const first = text.split(/(?<=\.)\s/)[0].replace(/\.$/, "");  // the first sentence (choices listed with ;)
  return first.length > 90 ? first.slice(0, 88).replace(/\s\S*$/, "") + "…" : first;
}

function knobValue(c) {
  if (c.type === "checkbox") return c.checked;
  if (c.tagName === "SELECT") return JSON.parse(c.value);
  return c.value === "" ? null : Number(c.value);
}

VIEWS.plan = async function (main, info) {
  const q = new URLSearchParams(location.search);
  const state = {overrides: {}, last: null, ticket: 0};
  const error = alertBox("plan-error");
  const [srcField, src] = field("Config, model directory or scenario",
    el("input", {type: "text", list: "scenarios", value: q.get("config") || "", placeholder: "configs/tiny.yaml",
      autocomplete: "off", spellcheck: "false"}),
    `a YAML path, a model directory / checkpoint / .gguf, or a shipped scenario (${info.scenarios.join(", ")})`);
  const [devField, dev] = field("Device", el("select", {},
    // none picked: the server chooses as `fitlm plan` does, and the plan names the device and why
    el("option", {value: ""}, "fitlm plan's choice"),
    info.devices.map((d) => el("option", {value: d.name, selected: d.name === q.get("device")},
      d.memory_bytes ? `${d.name} (${gib(d.memory_bytes)})` : `${d.name} (measured here)`))));
  const [numField, count] = field("Devices", el("input", {type: "number", min: 1, step: 1,
    value: q.get("num_devices") || "", placeholder: "the layout's"}), "data parallel takes the devices left over");
  const knobs = el("fieldset", {class: "knobs"}, el("legend", {}, "Knobs"));
  const out = el("section", {class: "plan-out", "aria-label": "plan"});
  const load = el("button", {type: "submit"}, "Plan");
  const form = el("form", {class: "plan-form", onsubmit: (e) => { e.preventDefault(); state.overrides = {}; run(); }},
    el("datalist", {id: "scenarios"}, info.scenarios.map((s) => el("option", {value: s}))),
    el("div", {class: "row"}, srcField, load), el("div", {class: "row"}, devField, numField), knobs);
  main.append(el("h1", {}, "Plan"), el("div", {class: "plan-layout"}, form, el("div", {}, error, out)));

  const controls = {};
  for (const k of info.knobs) {
    const [wrap, c] = knobControl(k, k.default);
    c.addEventListener("change", () => { state.overrides[k.key] = knobValue(c); run(); });
    controls[k.key] = c;
    knobs.append(wrap);
  }
  dev.addEventListener("change", () => run());
  count.addEventListener("change", () => run());

  function request(extra) {
    return Object.assign({
      source: src.value.trim(), device: dev.value || null,
      num_devices: count.value ? Number(count.value) : null, overrides: state.overrides,
    }, extra || {});
  }

  async function run(extra) {
    if (!src.value.trim()) { showError(error, "give a config, a model directory or a scenario, then Plan"); return; }
    const params = new URLSearchParams({config: src.value.trim()});
    if (dev.value) params.set("device", dev.value);
    if (count.value) params.set("num_devices", count.value);
    history.replaceState(null, "", "/plan?" + params);
    out.setAttribute("aria-busy", "true");
    const ticket = ++state.ticket;  // only the newest request's answer is drawn (answers can cross)
    try {
      const r = await api("/api/plan", request(extra));
      if (ticket !== state.ticket) return;
      showError(error, "");
      state.last = r;
      for (const [key, v] of Object.entries(r.knobs)) {
        const c = controls[key];
        if (!c || document.activeElement === c) continue;
        if (c.type === "checkbox") c.checked = !!v;
        else if (c.tagName === "SELECT") c.value = JSON.stringify(v);
        else c.value = v;
      }
      drawPlan(out, r, request());
    } catch (e) {
      if (ticket !== state.ticket) return;
      showError(error, e.message);
      out.replaceChildren();
    } finally {
      if (ticket === state.ticket) out.removeAttribute("aria-busy");
    }
  }
  state.search = () => run({search: true, top: 5});
  out.addEventListener("search", () => state.search());
  if (src.value) run();
};

function drawPlan(out, r, req) {
  const p = r.plan, d = p.device, total = p.per_device.total;
  const f = p.finetune;
  const trainable = f.method === "full" ? "" : ` · ${f.method}: ${count(f.trainable_params)} trainable`;
  const parts = r.memory_parts;  // the server's segments, shares included
  const searchBtn = el("button", {type: "button", onclick: () => out.dispatchEvent(new Event("search"))},
    "Fastest layout");
  fill(out, [
    // which device the figures are for, and why (the server chooses as `fitlm plan` does when none is picked)
    p.device_source ? el("p", {class: "muted", "data-testid": "plan-device-source"}, p.device_source.note) : null,
    el("p", {class: "headline"}, `${p.model.arch} ${count(p.model.params)} params${trainable} · ${p.layout} · `
      + `${p.memory_options} · ${d.num_devices}× ${d.name}`),
    el("div", {class: "verdict"},
      el("p", {class: "total", "data-testid": "plan-total", "data-bytes": total}, gib(total), el("small", {}, " per device")),
      el("p", {class: p.fits ? "fits yes" : "fits no", "data-testid": "plan-fits", "data-fits": String(p.fits)},
        p.fits ? `fits: ${gib(total)} of ${gib(d.usable_bytes)} usable` : !p.fits_device ?
          `does not fit: ${gib(p.diagnosis.over_by_bytes)} over ${gib(d.usable_bytes)} usable` :
          `does not fit the host: ${gib(p.host.over_by_bytes)} over its usable RAM (see Host memory)`),
      el("p", {}, `each component at the peak moment: ${p.peak_phase}`)),
    stackedBar(parts, d.usable_bytes, "plan-bar"),
    table(["component", "per device at the peak", "share"], parts.map((x, i) => [
      el("span", {}, el("i", {class: "swatch", style: `background:${PALETTE[i % PALETTE.length]}`}), x.name),
      gib(x.bytes), pct(x.share)]),
      {class: "parts", "data-testid": "plan-parts"}),
    hostSection(p.host),
    speedSection(p),
    (p.notes || []).length ? el("ul", {class: "notes"}, p.notes.map((n) => el("li", {}, n))) : null,
    p.diagnosis ? diagnosisSection(p.diagnosis) : null,
    p.search ? searchSection(p.search) : el("p", {}, searchBtn, " ranks every fitting layout × memory option"),
    commandsSection(r, req)]);
}

function hostSection(h) {
  const r = h.per_rank;
  return el("section", {"aria-label": "host memory"}, el("h2", {}, "Host memory"),
    table(["per rank (rank 0)", "load", "step", "save"], [["bytes", gib(r.load), gib(r.step), gib(r.save)]]),
    el("p", {class: h.fits ? "" : "warn"}, `per node (${h.ranks_per_node} rank(s)): ${gib(h.per_node[h.peak_moment])} at `
      + `${h.peak_moment} of ${gib(h.usable_bytes)} usable (${h.ram_source || "host RAM"})`
      + (h.fits ? "" : ` — over by ${gib(h.over_by_bytes)}: fewer ranks per node, more RAM, or less offload`)));
}

function speedSection(p) {
  const rows = Object.entries(p.time_breakdown_s).filter(([, v]) => v > 0).map(([k, v]) => [k.replaceAll("_", " "),
    num(v, 4) + " s"]);
  return el("section", {"aria-label": "speed"}, el("h2", {}, "Speed"),
    el("p", {class: "speed", "data-testid": "plan-speed"},
      `step ${num(p.step_time_s, 3)} s · ${num(p.tokens_per_s)} tokens/s · MFU ${pct(p.mfu)} `
      + `(efficiency ${pct(p.device.efficiency)} of ${p.device.tflops} TFLOP/s)`),
    table(["time", "per step"], rows));
}

function diagnosisSection(g) {
  return el("section", {"aria-label": "why out of memory", "data-testid": "plan-diagnosis"},
    el("h2", {}, "Why OOM"),
    el("p", {}, `${g.dominant} dominates; over by ${gib(g.over_by_bytes)}. Remedies, largest saving first:`),
    table(["change", "saves", "then", ""], g.remedies.map((x) => [x.change, gib(x.saves_bytes), gib(x.total),
      x.fits ? "fits" : "still over"])));
}

function searchSection(s) {
  return el("section", {"aria-label": "fastest layouts", "data-testid": "plan-search"},
    el("h2", {}, `Fastest fitting layouts on ${s.num_devices} devices (${s.fitting_candidates} fit)`),
    s.top.length ? table(["#", "layout", "memory", "per device", "tokens/s", "MFU", "why"], s.top.map((c, i) => [
      String(i + 1), c.layout, c.memory_options, gib(c.per_device_total), num(c.tokens_per_s), pct(c.mfu), c.why]))
      : el("p", {class: "warn"}, "no layout fits: add devices, or a device with more memory"));
}

function commandsSection(r, req) {
  const cmd = (label, text) => {
    const b = el("button", {type: "button", "data-label": `Copy ${label}`}, `Copy ${label}`);
    b.addEventListener("click", () => copyText(text, b));
    return el("div", {class: "cmd"}, el("code", {"data-testid": `cmd-${label}`}, text), b);
  };
  const [nameField, name] = field("Run name", el("input", {type: "text", value: "ui-run", spellcheck: "false"}),
    "the run is written to RUNS_DIR/NAME");
  const status = alertBox("start-status");
  const start = el("button", {type: "button", onclick: async () => {
    try {
      const job = await api("/api/run/start", Object.assign({}, req, {name: name.value}));
      status.className = "ok";
      status.replaceChildren(`started: ${job.command} — `, el("a", {href: runHref(job.target)}, "watch it"));
      status.hidden = false;
    } catch (e) {
      status.className = "alert";
      showError(status, e.message);
    }
  }}, "Start run");
  return el("section", {"aria-label": "commands"}, el("h2", {}, "Reproduce or run"),
    cmd("plan", r.commands.plan), cmd("train", r.commands.train),
    el("p", {}, el("button", {type: "button", onclick: () => download("plan.yaml", r.yaml)}, "Download YAML")),
    el("div", {class: "row"}, nameField, start), status);
}
