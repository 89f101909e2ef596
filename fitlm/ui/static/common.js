// What every view shares: the JSON calls, element building, number formats. No planner arithmetic lives here:
// every figure the views show comes from the server's JSON.
"use strict";

const GiB = 1024 ** 3;

async function api(path, body) {
  const opts = body === undefined ? {} : {
    method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body),
  };
  let res;
  try {
    res = await fetch(path, opts);
  } catch (e) {
    throw new Error("the fitlm ui server cannot be reached (" + e.message + "); is `fitlm ui` still running?");
  }
  let data;
  try {
    data = await res.json();
  } catch (e) {
    throw new Error("the server answered " + res.status + " without JSON");
  }
  if (!res.ok) throw new Error(data.error || ("HTTP " + res.status));
  return data;
}

// el("div", {class: "x", "data-testid": "y"}, child, "text", ...)
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

let uid = 0;
// A labelled control: <label for=id>text</label><control id=id>. Returns [wrapper, control].
function field(label, control, help) {
  const id = control.id || ("f" + (++uid));
  control.id = id;
  const hint = help ? el("small", {class: "help", id: id + "-help"}, help) : null;
  if (hint) control.setAttribute("aria-describedby", hint.id);
  return [el("div", {class: "field"}, el("label", {for: id}, label), control, hint), control];
}

// Bytes in GiB, or MiB / KiB below one GiB (a tiny model's plan is not a column of 0.00 GiB).
function gib(n) {
  if (n === null || n === undefined) return "–";
  const a = Math.abs(n);
  if (a >= GiB / 10 || a === 0) return (n / GiB).toFixed(2) + " GiB";
  if (a >= 2 ** 20) return (n / 2 ** 20).toFixed(1) + " MiB";
  return (n / 1024).toFixed(1) + " KiB";
}
// A parameter count: 6.74B, 158M, 3.4K.
function count(n) {
  const a = Math.abs(n);
  return a >= 1e9 ? (n / 1e9).toPrecision(3) + "B" : a >= 1e6 ? (n / 1e6).toPrecision(3) + "M" :
    a >= 1e3 ? (n / 1e3).toPrecision(3) + "K" : String(n);
}
function num(n, digits) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  return Number(n).toLocaleString("en-US", {maximumFractionDigits: digits === undefined ? 0 : digits});
}
function pct(n) { return n === null || n === undefined ? "–" : (100 * n).toFixed(1) + "%"; }

function alertBox(testid) {
  return el("div", {class: "alert", role: "alert", "data-testid": testid, hidden: true});
}
function showError(box, message) {
  box.textContent = message || "";
  box.hidden = !message;
}

function table(headers, rows, attrs) {
  return el("table", attrs || {},
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", {scope: "col"}, h)))),
    el("tbody", {}, rows.map((r) => el("tr", {}, r.map((c) => el("td", {}, c))))));
}

function download(name, text) {
  const a = el("a", {href: URL.createObjectURL(new Blob([text], {type: "text/yaml"})), download: name});
  document.body.append(a);
  a.click();
  a.remove();
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "Copied";
  } catch (e) {
    button.textContent = "Select the text to copy";
  }
  setTimeout(() => { button.textContent = button.dataset.label; }, 1500);
}

// The views register here; app.js picks one by the path.
const VIEWS = {};

// node.replaceChildren without the nulls of conditional parts (replaceChildren would print "null").
function fill(node, ...kids) {
  node.replaceChildren(...kids.flat().filter((k) => k !== null && k !== undefined && k !== false));
}

// /runs/NAME with each path segment encoded (a run name may hold "#", "?" or "%").
function runHref(name) { return "/runs/" + name.split("/").map(encodeURIComponent).join("/"); }
