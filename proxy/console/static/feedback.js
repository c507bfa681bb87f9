// Human feedback on a session or one step, through POST /atdp/v1/sessions/{id}/feedback (idempotent:
// one key per filled-in form, so a double click or a retry stores it once; audited by the route).
import { api, auth } from "./api.js";
import { errorBox, h } from "./dom.js";

export function feedbackForm(doc, tenant, refresh) {
  let idempotencyKey = crypto.randomUUID();
  const fresh = () => { idempotencyKey = crypto.randomUUID(); };
  const scope = h("select", { name: "step_id", id: "fb-scope", onchange: fresh },
    h("option", { value: "" }, "the whole session"),
    doc.steps.map((st) => h("option", { value: st.id }, `step #${st.seq}`)));
  const score = h("input", { name: "reward", id: "fb-score", type: "number", step: "any",
                             placeholder: "score, e.g. 0.5", oninput: fresh });
  const comment = h("textarea", { name: "comment", id: "fb-comment", rows: 2, maxlength: 65536, oninput: fresh });
  const correction = h("textarea", { name: "correction", id: "fb-correction", rows: 2, maxlength: 65536,
                                     oninput: fresh });
  const status = h("p", { class: "muted", id: "fb-status", role: "status" });
  const send = async (reward) => {
    const body = { source: "human", idempotency_key: idempotencyKey };
    if (scope.value) body.step_id = scope.value;
    if (reward !== null) body.reward = reward;
    if (comment.value.trim()) body.comment = comment.value;
    if (correction.value.trim()) body.correction = correction.value;
    if (body.reward === undefined && !body.comment && !body.correction) {
      status.replaceChildren(errorBox("Give a reward, a comment or a correction."));
      return;
    }
    status.textContent = "Sending…";
    try {
      const query = auth.who.admin && tenant ? { tenant } : {};
      await api(`/atdp/v1/sessions/${encodeURIComponent(doc.id)}/feedback`, { method: "POST", query, body });
      fresh();
      status.textContent = "Stored.";
      await refresh();
    } catch (err) {
      status.replaceChildren(errorBox(err));
    }
  };
  const scored = () => {
    const x = score.value.trim();
    if (x === "") return null;
    const n = Number(x);
    return Number.isFinite(n) ? n : NaN;
  };
  const form = h("form", { id: "feedback", class: "card" },
    h("label", {}, "on ", scope),
    h("div", { class: "thumbs" },
      h("button", { type: "button", id: "fb-up", title: "reward +1", onclick: () => send(1) }, "Thumbs up (+1)"),
      h("button", { type: "button", id: "fb-down", title: "reward −1", onclick: () => send(-1) }, "Thumbs down (−1)"),
      h("label", {}, "or a score ", score)),
    h("label", {}, "comment", comment),
    h("label", {}, "correction (what the answer should have been)", correction),
    h("button", { type: "submit", id: "fb-send" }, "Send feedback"), status);
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    const reward = scored();
    if (Number.isNaN(reward)) {
      status.replaceChildren(errorBox("The score must be a number."));
      return;
    }
    send(reward);
  });
  return form;
}
