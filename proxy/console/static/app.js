// The console's shell: sign-in, navigation, and the hash router (#/page/part?query).
import { api, auth, signIn } from "./api.js";
import { clear, errorBox, h } from "./dom.js";
import { showDiagnosis, showLearning } from "./insights.js";
import { showSession, showSessions } from "./sessions.js";
import { showVersion, showVersions } from "./versions.js";

const app = () => document.getElementById("app");
let renders = 0;

const PAGES = {
  sessions: showSessions,
  session: showSession,
  versions: showVersions,
  version: showVersion,
  diagnosis: showDiagnosis,
  learning: showLearning,
};

function parseHash() {
  const raw = location.hash.replace(/^#\/?/, "");
  const [path, query = ""] = raw.split("?");
  const parts = path.split("/").map((p) => decodeURIComponent(p));
  return { page: parts[0] || "sessions", parts: parts.slice(1), query: new URLSearchParams(query) };
}

function showSignIn(message) {
  document.getElementById("nav").hidden = true;
  document.getElementById("signout").hidden = true;
  document.getElementById("who").textContent = "";
  const input = h("input", { id: "key", type: "password", autocomplete: "off", required: true,
                             placeholder: "tenant key or admin key", "aria-label": "API key" });
  const form = h("form", { id: "signin", class: "card narrow" },
    h("h1", {}, "Sign in"),
    h("p", {}, "A tenant key shows its own tenant; the admin key every tenant and the version controls. ",
      "The key stays in this tab's session storage and is sent as a header only."),
    input, h("button", { type: "submit" }, "Sign in"),
    message ? errorBox(message) : null);
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    try {
      await signIn(input.value.trim());
      if (!location.hash || location.hash === "#/") location.hash = "#/sessions"; // routes on hashchange
      else await route();
    } catch (err) {
      showSignIn(err.status === 401 ? "That key is not valid." : err);
    }
  });
  clear(app()).append(form);
  input.focus();
}

function showChrome() {
  const who = auth.who;
  document.getElementById("nav").hidden = false;
  document.getElementById("signout").hidden = false;
  document.getElementById("who").textContent = who.admin ? "admin (all tenants)" : `tenant ${who.tenant}`;
  for (const a of document.querySelectorAll("#nav a[data-admin]")) a.hidden = !who.admin;
  const { page } = parseHash();
  for (const a of document.querySelectorAll("#nav a")) {
    a.classList.toggle("active", a.getAttribute("href") === `#/${page}` ||
      a.getAttribute("href") === `#/${page}s`);
  }
}

async function route() {
  if (!auth.key()) return showSignIn();
  if (!auth.who) {
    try {
      auth.who = await api("/atdp/v1/whoami");
    } catch (err) {
      auth.clear();
      return showSignIn(err.status === 401 ? "Signed out: the key is no longer valid." : err);
    }
  }
  showChrome();
  const { page, parts, query } = parseHash();
  const show = PAGES[page];
  const root = clear(app());
  document.body.removeAttribute("data-ready");
  root.append(h("p", { class: "muted" }, "Loading…"));
  const started = performance.now();
  try {
    if (!show) throw new Error("No such page.");
    const view = await show(parts, query);
    clear(root).append(view);
  } catch (err) {
    clear(root).append(errorBox(err));
    if (err.status === 401) {
      auth.clear();
      auth.who = null;
      showSignIn("Signed out: the key is no longer valid.");
      return;
    }
  }
  // What the browser test and the load benchmark wait for: this page is drawn, in this many ms.
  document.body.dataset.loadedMs = String(Math.round(performance.now() - started));
  document.body.dataset.sinceNavigationMs = String(Math.round(performance.now()));
  document.body.dataset.ready = page;
  document.body.dataset.renders = String(++renders);
}

document.getElementById("signout").addEventListener("click", () => {
  auth.clear();
  auth.who = null;
  location.hash = "";
  showSignIn();
});
window.addEventListener("hashchange", route);
route();
