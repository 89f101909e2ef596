// The Export view: `fitlm export` as a job (POST /api/export), its log and written files polled (GET /api/job).
"use strict";

VIEWS.export = async function (main) {
  const q = new URLSearchParams(location.search);
  let found = {models: [], adapters: []};
  try { found = await api("/api/models"); } catch (e) { /* typed paths still work */ }
  const error = alertBox("export-error");
  const [mField, model] = field("Model", el("input", {type: "text", list: "ex-models", value: q.get("model") || "",
    spellcheck: "false"}), "a finished run, a model directory or a GGUF file");
  const [fField, format] = field("Format", el("select", {}, ["hf", "gguf", "onnx"].map((f) => el("option", {value: f}, f))));
  const [oField, out] = field("Output path", el("input", {type: "text", spellcheck: "false"}),
    "a directory for hf, a file for gguf and onnx");
  const [dField, dtype] = field("GGUF type", el("select", {},
    ["f16", "f32", "q8_0", "q4_k_m", "q5_k_m", "q6_k"].map((f) => el("option", {value: f}, f))));
  const [aField, adapter] = field("Adapter to merge (optional)", el("input", {type: "text", list: "ex-adapters"}));
  const [sField, dynamic] = field("ONNX dynamic shapes", el("input", {type: "checkbox"}));
  const [nField, noTok] = field("GGUF without tokenizer", el("input", {type: "checkbox"}));
  const [qField, seqLen] = field("ONNX sequence length", el("input", {type: "number", min: 1, step: 1}),
    "static shapes; default model.max_seq_len");
  const [bField, batch] = field("ONNX batch size", el("input", {type: "number", min: 1, step: 1, value: 1}));
  const [hField, shard] = field("HF shard size", el("input", {type: "text", value: "5GiB"}),
    "safetensors files above this are split, with an index");
  const status = el("section", {"aria-label": "export job", "data-testid": "export-job"});
  const suggest = () => {
    if (out.dataset.touched || !model.value.trim()) return;
    const base = model.value.trim().replace(/\/+$/, "");
    out.value = base + "-export" + {hf: "", gguf: ".gguf", onnx: ".onnx"}[format.value];
  };
  out.addEventListener("input", () => { out.dataset.touched = "1"; });
  model.addEventListener("change", suggest);
  format.addEventListener("change", suggest);
  suggest();
  const form = el("form", {onsubmit: async (e) => {
    e.preventDefault();
    try {
      showError(error, "");
      const job = await api("/api/export", {model: model.value.trim(), format: format.value, out: out.value.trim(),
        dtype: format.value === "gguf" ? dtype.value : null, adapter: adapter.value.trim(),
        dynamic_shape: dynamic.checked, no_tokenizer: noTok.checked,
        seq_len: format.value === "onnx" && seqLen.value ? Number(seqLen.value) : null,
        batch_size: format.value === "onnx" ? Number(batch.value) : null,
        max_shard_size: format.value === "hf" ? shard.value.trim() : null});
      watch(job.id);
    } catch (err) { showError(error, err.message); }
  }},
  el("datalist", {id: "ex-models"}, found.models.map((m) => el("option", {value: m}))),
  el("datalist", {id: "ex-adapters"}, found.adapters.map((m) => el("option", {value: m}))),
  el("div", {class: "row"}, mField, fField, oField), el("div", {class: "row"}, dField, aField, sField, nField),
  el("div", {class: "row"}, qField, bField, hField), el("p", {}, el("button", {type: "submit"}, "Export")));
  main.append(el("h1", {}, "Export"), form, error, status);

  let watching = null;
  function watch(id) {
    clearInterval(watching);  // a new export: the previous job's status stops being drawn
    const timer = setInterval(async () => {
      try {
        const j = await api("/api/job?id=" + encodeURIComponent(id));
        fill(status, el("h2", {}, "fitlm export"), el("p", {}, el("code", {}, j.command)),
          j.state === "running" ? el("progress", {"aria-label": "exporting", "data-testid": "export-progress",
            ...(j.progress ? {value: j.progress[0], max: j.progress[1]} : {})}) : el("p", {class: j.state === "done" ? "ok" :
            "alert", "data-testid": "export-state", "data-state": j.state}, j.state === "done" ? `done in ${j.seconds} s` :
            `failed (exit ${j.returncode}): see the log`),
          j.files.length ? table(["written", "bytes"], j.files.map((f) => [f.path, num(f.bytes)]),
            {"data-testid": "export-files"}) : null,
          el("pre", {class: "log"}, j.log));
        if (j.state !== "running") clearInterval(timer);
      } catch (err) { showError(error, err.message); clearInterval(timer); }
    }, 1000);
    watching = timer;
    VIEWS.timers.push(timer);
  }
};
