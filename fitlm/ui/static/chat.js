// The Chat view: POST /api/chat streams server-sent events from the serve engine ({delta}, then {done} or {error}).
"use strict";

async function* events(res) {
  const reader = res.body.getReader(), dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buf += dec.decode(value, {stream: true});
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const line = buf.slice(0, i).trim();
      buf = buf.slice(i + 2);
      if (line.startsWith("data: ")) yield JSON.parse(line.slice(6));
    }
  }
}

VIEWS.chat = async function (main) {
  const q = new URLSearchParams(location.search);
  let found = {models: [], adapters: []};
  try { found = await api("/api/models"); } catch (e) { /* the form still takes a typed path */ }
  const error = alertBox("chat-error");
  const [mField, model] = field("Model", el("input", {type: "text", list: "models", value: q.get("model") || "",
    spellcheck: "false", placeholder: "runs/NAME, a model directory or a .gguf"}));
  const [aField, adapter] = field("Adapter (optional)", el("input", {type: "text", list: "adapters", spellcheck: "false"}));
  const [tField, template] = field("Template", el("select", {},
    el("option", {value: "model"}, "the model's chat template"),
    el("option", {value: "none"}, "none: continue the text (as fitlm generate)")));
  const [tempField, temperature] = field("Temperature", el("input", {type: "number", min: 0, step: "any", value: 0}),
    "0 = greedy");
  const [pField, topP] = field("Top-p", el("input", {type: "number", min: 0.01, max: 1, step: "any", value: 1}));
  const [nField, maxTokens] = field("Max tokens", el("input", {type: "number", min: 1, step: 1, value: 64}));
  const [sField, system] = field("System prompt (optional)", el("input", {type: "text"}));
  const log = el("div", {class: "chatlog", role: "log", "aria-label": "conversation", "data-testid": "chat-log"});
  const [msgField, message] = field("Message", el("textarea", {rows: 3, required: true}));
  const send = el("button", {type: "submit"}, "Send");
  const clear = el("button", {type: "button", onclick: () => { turns.length = 0; log.replaceChildren(); }}, "New chat");
  const turns = [];
  const form = el("form", {class: "chat-form", onsubmit: (e) => { e.preventDefault(); ask(); }},
    el("datalist", {id: "models"}, found.models.map((m) => el("option", {value: m}))),
    el("datalist", {id: "adapters"}, found.adapters.map((m) => el("option", {value: m}))),
    el("div", {class: "row"}, mField, aField, tField),
    el("div", {class: "row"}, tempField, pField, nField, sField), log, msgField, el("p", {}, send, " ", clear));
  main.append(el("h1", {}, "Chat"), form, error);

  async function ask() {
    const text = message.value;
    if (!text.trim()) return;
    showError(error, "");
    turns.push({role: "user", content: text});
    log.append(el("p", {class: "msg user"}, el("b", {}, "you: "), text));
    const reply = el("span", {"data-testid": "chat-reply"});
    log.append(el("p", {class: "msg assistant"}, el("b", {}, "model: "), reply));
    message.value = "";
    send.disabled = true;
    const messages = (system.value.trim() ? [{role: "system", content: system.value}] : []).concat(turns);
    let text_ = "";
    try {
      const res = await fetch("/api/chat", {method: "POST", headers: {"Content-Type": "application/json"},
        body: JSON.stringify({model: model.value.trim(), adapter: adapter.value.trim(), messages,
          template: template.value, temperature: Number(temperature.value), top_p: Number(topP.value),
          max_tokens: Number(maxTokens.value)})});
      if (!res.ok) {
        const data = await res.json().catch(() => ({}));
        throw new Error(data.error || "HTTP " + res.status);
      }
      for await (const ev of events(res)) {
        if (ev.delta !== undefined) { text_ += ev.delta; reply.textContent = text_; }
        if (ev.error) throw new Error(ev.error);
        if (ev.done) { reply.dataset.done = ev.done; reply.dataset.tokens = ev.tokens; }
      }
      turns.push({role: "assistant", content: text_});
    } catch (e) {
      turns.pop();
      reply.parentElement.remove();
      showError(error, e.message);
    } finally {
      send.disabled = false;
    }
  }
};
