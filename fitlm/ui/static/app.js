// The router: the path names the view (/plan, /runs, /runs/NAME, /chat, /export); links inside the page
// switch views without a reload, and each view's polling stops when another is shown.
"use strict";

VIEWS.timers = [];
let INFO = null;
let SHOWN = 0;  // navigations so far: a view still loading when the user moved on must not draw or poll

async function show(path) {
  const me = ++SHOWN;
  VIEWS.timers.forEach(clearInterval);
  VIEWS.timers = [];
  // Each navigation draws into a fresh container: a view that resolves late fills its own, detached one.
  const main = el("div", {class: "view"});
  document.getElementById("view").replaceChildren(main);
  const [, view, ...rest] = path.split("/");
  const name = VIEWS[view] ? view : "plan";
  for (const a of document.querySelectorAll("nav a")) {
    if (a.dataset.view === name) a.setAttribute("aria-current", "page"); else a.removeAttribute("aria-current");
  }
  document.title = `fitlm · ${name}`;
  try {
    if (!INFO) INFO = await api("/api/info");
    if (me !== SHOWN) return;
    const timer = await VIEWS[name](main, INFO, rest.join("/") || null);
    if (me !== SHOWN) { clearInterval(timer); return; }
    if (timer) VIEWS.timers.push(timer);
  } catch (e) {
    const box = alertBox("view-error");
    showError(box, e.message);
    main.append(box);
  }
}

document.addEventListener("click", (e) => {
  const a = e.target.closest("a[href^='/']");
  if (!a || a.hasAttribute("download") || e.ctrlKey || e.metaKey || a.getAttribute("href").startsWith("/api/")) return;
  e.preventDefault();
  history.pushState(null, "", a.getAttribute("href"));
  show(location.pathname);
});
window.addEventListener("popstate", () => show(location.pathname));
show(location.pathname);
