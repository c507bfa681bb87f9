// Versions (admin key): the lineage tree, each version's card, and promote / rollback with a typed
// confirmation. The routes audit what they do (version.promote_override, version.swap / rollback).
import { api, auth } from "./api.js";
import { errorBox, fmtNum, fmtTime, h, link, table } from "./dom.js";

const needsAdmin = () => h("p", { class: "muted" }, "Versions need the admin key (a tenant key sees the learning chart).");

export async function showVersions() {
  if (!auth.who.admin) return needsAdmin();
  const listing = await api("/atdp/v1/versions");
  const view = h("section", { id: "versions" }, h("h1", {}, "Versions"),
    h("p", {}, "Serving: ", h("code", {}, listing.serving ?? "none")));
  const byParent = new Map();
  const ids = new Set(listing.data.map((v) => v.id));
  for (const v of listing.data) {
    const parent = v.parent && ids.has(v.parent) ? v.parent : null;
    if (!byParent.has(parent)) byParent.set(parent, []);
    byParent.get(parent).push(v);
  }
  for (const children of byParent.values()) children.sort((a, b) => a.created_at.localeCompare(b.created_at));
  const tree = (parent) => {
    const children = byParent.get(parent) || [];
    if (!children.length) return null;
    return h("ul", { class: parent === null ? "tree root" : "tree" }, children.map((v) => h("li", {},
      link(["version", v.name], v.name), " ", h("span", { class: `badge ${v.status}` }, v.status),
      ` ${fmtTime(v.created_at)} · ${v.lineage} trained steps`, tree(v.id))));
  };
  view.append(h("h2", {}, "Lineage"), tree(null) || h("p", { class: "muted" }, "No versions yet."));
  view.append(h("h2", {}, "Replicas"), table(["replica", "version", "open", "alive"],
    listing.replicas.map((r) => [r.url, r.version ?? "–", r.open ? "yes" : "no (swapping)", r.alive ? "yes" : "no"])));
  return view;
}

export async function showVersion(parts) {
  if (!auth.who.admin) return needsAdmin();
  const name = parts[0];
  const [card, detail] = await Promise.all([
    api(`/atdp/v1/versions/${encodeURIComponent(name)}/card`),
    api(`/atdp/v1/versions/${encodeURIComponent(name)}`),
  ]);
  const v = card.version;
  const ch = card.changed;
  const view = h("section", { id: "version-card" },
    h("p", {}, link(["versions"], "← all versions")),
    h("h1", {}, "Version ", h("code", {}, v.name), " ", h("span", { class: `badge ${v.status}`, id: "version-status" }, v.status)),
    h("dl", { class: "facts" },
      [h("dt", {}, "id"), h("dd", {}, v.id)], [h("dt", {}, "checkpoint"), h("dd", {}, h("code", {}, v.checkpoint))],
      [h("dt", {}, "created"), h("dd", {}, fmtTime(v.created_at))], [h("dt", {}, "served"), h("dd", {}, fmtTime(v.served_at))],
      [h("dt", {}, "retired"), h("dd", {}, fmtTime(v.retired_at))],
      v.error ? [h("dt", {}, "error"), h("dd", { class: "error" }, v.error)] : null),
    h("h2", {}, "What changed"),
    h("ul", {},
      h("li", {}, "parent: ", ch.parent ? link(["version", ch.parent], ch.parent) : "–"),
      h("li", {}, `trained on ${ch.lineage.steps} steps of ${ch.lineage.sessions} sessions; tenants `,
        ch.lineage.tenants.join(", ") || "–", "; tasks ", ch.lineage.tasks.join(", ") || "–"),
      h("li", {}, `reward of that data: mean ${fmtNum(ch.reward.mean)}, std ${fmtNum(ch.reward.std)}, `,
        `min ${fmtNum(ch.reward.min)}, max ${fmtNum(ch.reward.max)}`),
      h("li", {}, "training metrics: ", inline(ch.training))),
    h("h2", {}, "Why"),
    h("ul", {}, h("li", {}, "trigger: ", card.why.trigger),
      card.why.override ? h("li", {}, `operator override by ${card.why.override.actor} at ${fmtTime(card.why.override.at)}`,
        card.why.override.reason ? `: ${card.why.override.reason}` : "") : null),
    h("h2", {}, "Gates"), gates(card.gates || []),
    h("h2", {}, "Who was affected"),
    h("p", {}, `${card.affected.sessions} sessions: `, inline(card.affected.tenants)),
    h("h2", {}, "Rollback"), h("p", { id: "rollback-note" }, card.rollback.note),
    card.rollback.command ? h("pre", {}, card.rollback.command) : null);
  const actions = h("div", { class: "actions" });
  if (card.rollback.possible) actions.append(confirmAction("rollback", `Roll back ${v.name}`,
    `Every replica swaps back to ${card.rollback.restores}; ${v.name} becomes rolled_back.`, v.name,
    () => api(`/atdp/v1/versions/${encodeURIComponent(v.id)}/rollback`, { method: "POST" })));
  if (!["serving", "failed", "rejected"].includes(v.status)) {
    const reason = h("input", { id: "promote-reason", placeholder: "why (recorded in the audit log)", maxlength: 128 });
    actions.append(confirmAction("promote", `Promote ${v.name} now`,
      "The operator override: skips the gates and swaps every replica to this version now.", v.name,
      () => api("/atdp/v1/versions", { method: "POST", body: { checkpoint: v.checkpoint, name: v.name, promote: "now",
                                                                ...(reason.value.trim() ? { reason: reason.value.trim() } : {}) } }),
      reason));
  }
  view.append(h("h2", {}, "Actions"), actions.childNodes.length ? actions : h("p", { class: "muted" }, "None for this status."));
  view.append(h("details", {}, h("summary", {}, "gate detail (JSON)"), h("pre", {}, JSON.stringify(detail.gates, null, 2))));
  return view;
}

// A button that opens a confirmation asking for the version's name; the action runs only once it matches.
function confirmAction(id, label, consequence, name, run, extra = null) {
  const typed = h("input", { id: `${id}-confirm-name`, placeholder: `type ${name} to confirm`, autocomplete: "off" });
  const go = h("button", { type: "button", id: `${id}-confirm`, class: "danger", disabled: true }, `Confirm: ${label}`);
  const result = h("p", { id: `${id}-result`, role: "status" });
  const box = h("div", { class: "confirm card", hidden: true }, h("p", {}, consequence), extra, typed, go, result);
  typed.addEventListener("input", () => { go.disabled = typed.value !== name; });
  go.addEventListener("click", async () => {
    go.disabled = true;
    result.textContent = "Working…";
    try {
      const out = await run();
      const swap = out.swap ? ` (swap ${out.swap.ok ? "ok" : "failed"}, ${fmtNum(out.swap.seconds, 2)} s)` : "";
      result.textContent = `Done: ${out.name} is ${out.status}${swap}.`;
      setTimeout(() => window.dispatchEvent(new HashChangeEvent("hashchange")), 600);
    } catch (err) {
      result.replaceChildren(errorBox(err));
      go.disabled = false;
    }
  });
  const open = h("button", { type: "button", id: `${id}-open`, onclick: () => { box.hidden = false; typed.focus(); } }, `${label}…`);
  return h("div", {}, open, box);
}

function gates(list) {
  if (!list.length) return h("p", { class: "muted" }, "No gates (registered before gates, or the base version).");
  return h("ul", {}, list.map((g) => {
    const n = g.numbers || {};
    const o = n.overall;
    return h("li", {}, h("strong", {}, g.gate), ": ", h("span", { class: `badge ${g.state}` }, g.state),
      o ? h("p", {}, `n=${o.n}, candidate ${fmtNum(o.candidate_mean)}, serving ${fmtNum(o.serving_mean)}, `,
        `difference ${fmtNum(o.diff_mean)} [${fmtNum(o.ci_low)}, ${fmtNum(o.ci_high)}]`) : h("p", {}, inline(n)),
      (n.reasons || []).map((r) => h("p", { class: "muted" }, r)));
  }));
}

function inline(obj) {
  const entries = Object.entries(obj || {});
  if (!entries.length) return "–";
  return entries.map(([k, x]) => `${k} ${typeof x === "number" ? Number(x.toPrecision(4)) : JSON.stringify(x)}`).join(", ");
}
