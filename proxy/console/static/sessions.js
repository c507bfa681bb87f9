// Sessions: the filtered, keyset-paginated list, and one session as a timeline of steps.
import { api, auth } from "./api.js";
import { fmtNum, fmtTime, h, link, redactedText, table } from "./dom.js";
import { feedbackForm } from "./feedback.js";

const FILTERS = ["tenant", "client", "task_id", "status", "version", "eligibility", "min_reward", "max_reward",
                 "since", "until"];
const STATUSES = ["", "open", "closed", "deleted"];

// Cursors of the pages before the current one (keyset pagination goes forward; this goes back).
let cursorsBack = [];

export async function showSessions(_parts, query) {
  const params = {};
  for (const name of [...FILTERS, "cursor"]) if (query.get(name)) params[name] = query.get(name);
  if (!auth.who.admin) delete params.tenant;
  if (!params.cursor) cursorsBack = [];
  const page = await api("/atdp/v1/sessions", { query: { ...params, limit: 50 } });
  const view = h("section", { id: "sessions" }, h("h1", {}, "Sessions"), filterForm(params));
  if (!page.data.length) view.append(h("p", { class: "muted", id: "no-sessions" }, "No sessions match."));
  else view.append(sessionTable(page.data));
  const nav = h("p", { class: "pager" });
  if (params.cursor) {
    nav.append(h("button", { type: "button", id: "prev-page", onclick: () => {
      const back = cursorsBack.pop();
      go({ ...params, cursor: back || undefined });
    } }, "← Newer"));
  }
  if (page.next_cursor) {
    nav.append(h("button", { type: "button", id: "next-page", onclick: () => {
      cursorsBack.push(params.cursor || "");
      go({ ...params, cursor: page.next_cursor });
    } }, "Older →"));
  }
  view.append(nav);
  return view;
}

function go(params) {
  const q = new URLSearchParams(Object.entries(params).filter(([, v]) => v));
  location.hash = `#/sessions${q.toString() ? "?" + q : ""}`;
}

function filterForm(params) {
  const field = (name, label, props = {}) => h("label", {}, label,
    h("input", { name, value: params[name] || "", ...props }));
  const status = h("select", { name: "status" }, STATUSES.map((x) =>
    h("option", { value: x, selected: params.status === x }, x || "any")));
  const eligibility = h("select", { name: "eligibility" }, ["", "eligible", "debug_only", "audit_only", "quarantined", "deleted"]
    .map((x) => h("option", { value: x, selected: params.eligibility === x }, x || "any")));
  const form = h("form", { id: "filters", class: "filters" },
    auth.who.admin ? field("tenant", "tenant") : null,
    field("client", "client"), field("task_id", "task"),
    h("label", {}, "status", status), field("version", "version"),
    h("label", {}, "eligibility", eligibility),
    field("min_reward", "reward ≥", { type: "number", step: "any" }),
    field("max_reward", "reward ≤", { type: "number", step: "any" }),
    field("since", "since", { placeholder: "2026-01-31T00:00Z" }),
    field("until", "until", { placeholder: "ISO 8601" }),
    h("button", { type: "submit" }, "Filter"));
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    const data = Object.fromEntries(new FormData(form).entries());
    cursorsBack = [];
    go(data);
  });
  return form;
}

function sessionTable(rows) {
  return table(["session", "tenant", "client", "task", "status", "steps", "reward", "started"],
    rows.map((r) => [link(["session", r.tenant, r.id], r.id), r.tenant, r.client ?? "–", r.task_id ?? "–", r.status,
                     String(r.steps), fmtNum(r.reward, 2), fmtTime(r.started_at)]));
}

export async function showSession(parts) {
  const [tenant, id] = parts;
  const query = auth.who.admin && tenant ? { tenant } : {};
  const doc = await api(`/atdp/v1/sessions/${encodeURIComponent(id)}`, { query });
  const view = h("section", { id: "session" },
    h("h1", {}, "Session ", h("code", {}, doc.id)),
    h("dl", { class: "facts" },
      fact("tenant", doc.tenant), fact("client", doc.client ?? "–"), fact("task", doc.task_id ?? "–"),
      fact("status", doc.status), fact("reward", fmtNum(doc.reward, 3)), fact("started", fmtTime(doc.started_at)),
      fact("ended", fmtTime(doc.ended_at)), doc.replay_of ? fact("replay of", doc.replay_of) : null));
  const steps = h("ol", { class: "timeline" }, doc.steps.map(stepView));
  view.append(h("h2", {}, `Timeline (${doc.steps.length} steps)`), steps);
  view.append(h("h2", {}, "Feedback"), feedbackList(doc.feedback),
              feedbackForm(doc, tenant, () => showSession(parts).then((v) => view.replaceWith(v))));
  return view;
}

function fact(label, value) {
  return [h("dt", {}, label), h("dd", {}, value)];
}

function stepView(step) {
  const g = step.governance;
  const redactions = Object.entries(g.redaction.counts || {});
  const obs = step.observation;
  const li = h("li", { class: `step status-${step.status}`, id: `step-${step.seq}`, "data-step-id": step.id },
    h("header", {},
      h("strong", {}, `#${step.seq}`), " ", h("span", { class: "badge" }, step.status), " ",
      h("span", {}, step.observation.api), " · model ", h("code", {}, step.model ?? "–"),
      " · version ", h("code", { class: "version" }, step.model_version ?? "–"),
      " · ", fmtTime(step.timings.started_at)),
    h("p", { class: "meta" },
      `ttft ${fmtNum(step.timings.ttft_ms, 1)} ms · total ${fmtNum(step.timings.total_ms, 1)} ms · `,
      `tokens ${step.usage.prompt_tokens} in / ${step.usage.completion_tokens} out (${step.tokens.source})`,
      step.usage.cost !== null && step.usage.cost !== undefined ? ` · cost ${step.usage.cost}` : ""),
    h("p", { class: `eligibility ${g.eligibility}` }, h("strong", {}, g.eligibility),
      g.eligibility_reason ? ": " : "", g.eligibility_reason || "",
      step.trained_in.length ? ` · trained in ${step.trained_in.length} version(s)` : ""),
    redactions.length
      ? h("p", { class: "redaction" }, "redacted: ",
          redactions.map(([entity, n], i) => [i ? ", " : "", h("mark", { class: "redacted" }, entity), ` ×${n}`]))
      : null,
    step.error ? h("p", { class: "error" }, `error ${step.error.type || ""}: ${step.error.message || ""}`) : null);
  if (obs.messages.length) {
    li.append(h("h4", {}, `new messages (${obs.messages.length}, after ${obs.history_len} earlier)`),
              ...obs.messages.map((m) => messageView(m.role, m.content)));
  }
  for (const r of obs.tool_results) {
    li.append(h("div", { class: `msg tool-result${r.is_error ? " is-error" : ""}` },
      h("span", { class: "role" }, `tool result ${r.tool_call_id}${r.is_error ? " (error)" : ""}`),
      contentView(isMessage(r.content) ? r.content.content : r.content)));
  }
  const act = step.action;
  const answer = h("div", { class: "msg assistant action" }, h("span", { class: "role" }, "model answer"));
  if (act.reasoning) answer.append(h("details", {}, h("summary", {}, "reasoning"), h("pre", {}, redactedText(act.reasoning))));
  if (act.text) answer.append(h("pre", {}, redactedText(act.text)));
  for (const tc of act.tool_calls) {
    answer.append(h("div", { class: "tool-call" }, "tool call ", h("code", {}, tc.name ?? "?"), ` (${tc.id ?? ""}) `,
      h("pre", {}, redactedText(typeof tc.arguments === "string" ? tc.arguments : JSON.stringify(tc.arguments, null, 2)))));
  }
  li.append(answer);
  return li;
}

// A stored message body ({"role", "content", ...}) rather than bare content.
function isMessage(body) {
  return body !== null && typeof body === "object" && !Array.isArray(body) && "content" in body;
}

function messageView(role, body) {
  const content = isMessage(body) ? body.content : body;
  const box = h("div", { class: `msg ${role || "unknown"}` }, h("span", { class: "role" }, role || "message"),
    contentView(content));
  if (body && Array.isArray(body.tool_calls)) {
    for (const tc of body.tool_calls) {
      const fn = tc.function || {};
      box.append(h("div", { class: "tool-call" }, "tool call ", h("code", {}, fn.name ?? "?"),
        h("pre", {}, redactedText(String(fn.arguments ?? "")))));
    }
  }
  return box;
}

function contentView(content) {
  if (content === null || content === undefined) return h("pre", { class: "muted" }, "(empty)");
  if (typeof content === "string") return h("pre", {}, redactedText(content));
  if (Array.isArray(content)) {
    return h("div", {}, content.map((part) => {
      if (part && typeof part.text === "string") return h("pre", {}, redactedText(part.text));
      if (part && part.type === "tool_result") {
        return h("div", { class: `tool-result${part.is_error ? " is-error" : ""}` },
          h("span", { class: "role" }, `tool result ${part.tool_use_id ?? ""}${part.is_error ? " (error)" : ""}`),
          contentView(part.content));
      }
      return h("pre", {}, redactedText(JSON.stringify(part, null, 2)));
    }));
  }
  return h("pre", {}, redactedText(JSON.stringify(content, null, 2)));
}

function feedbackList(items) {
  if (!items.length) return h("p", { class: "muted", id: "feedback-list" }, "No feedback yet.");
  return h("div", { id: "feedback-list" }, table(["when", "scope", "reward", "source", "comment", "correction", "late"],
    items.map((f) => [fmtTime(f.created_at), f.step_id ? `step ${f.step_id}` : "session", fmtNum(f.reward, 2),
                      f.source, f.comment ? redactedText(f.comment) : "–", f.correction ? redactedText(f.correction) : "–",
                      f.late ? "yes" : "no"])));
}

