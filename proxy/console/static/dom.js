// Building the page: every string from the store goes in as a text node (never parsed as HTML).

export function h(tag, props = {}, ...children) {
  const el = document.createElement(tag);
  setProps(el, props);
  add(el, children);
  return el;
}

// SVG elements (the learning chart).
export function s(tag, props = {}, ...children) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  setProps(el, props);
  add(el, children);
  return el;
}

function setProps(el, props) {
  for (const [key, value] of Object.entries(props)) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") el.addEventListener(key.slice(2), value);
    else if (key === "class") el.setAttribute("class", value);
    else el.setAttribute(key, value === true ? "" : String(value));
  }
}

export function add(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export function clear(el) {
  while (el.firstChild) el.removeChild(el.firstChild);
  return el;
}

// A link inside the console: every part is URI-encoded, so a stored id can never make it another URL.
export function link(parts, text, query = {}) {
  const path = "#/" + parts.map((p) => encodeURIComponent(p ?? "")).join("/");
  const q = new URLSearchParams(Object.entries(query).filter(([, v]) => v !== undefined && v !== null && v !== ""));
  return h("a", { href: q.toString() ? `${path}?${q}` : path }, text);
}

// Redaction placeholders (`<EMAIL>`, `<EMAIL:1a2b3c4d>`) marked where they stand in a stored text.
const PLACEHOLDER = /<([A-Z][A-Z0-9_]*)(?::[0-9a-f]{8})?>/g;

export function redactedText(value) {
  const text = String(value);
  const out = [];
  let last = 0;
  for (const m of text.matchAll(PLACEHOLDER)) {
    if (m.index > last) out.push(text.slice(last, m.index));
    out.push(h("mark", { class: "redacted", title: `redacted: ${m[1]}` }, m[1]));
    last = m.index + m[0].length;
  }
  if (last < text.length) out.push(text.slice(last));
  return out;
}

export function fmtTime(iso) {
  if (!iso) return "–";
  const d = new Date(iso);
  return Number.isNaN(d.getTime()) ? String(iso) : d.toISOString().replace("T", " ").slice(0, 19);
}

export function fmtNum(x, digits = 3) {
  return x === null || x === undefined ? "–" : Number(x).toFixed(digits);
}

export function table(headers, rows) {
  return h("table", {},
    h("thead", {}, h("tr", {}, headers.map((x) => h("th", {}, x)))),
    h("tbody", {}, rows.map((cells) => h("tr", {}, cells.map((c) => h("td", {}, c))))));
}

export function errorBox(err) {
  return h("p", { class: "error", role: "alert" }, String(err && err.message ? err.message : err));
}
