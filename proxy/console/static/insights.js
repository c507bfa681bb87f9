// Diagnosis (the control plane's findings, linking their example sessions) and the learning chart
// (reward and held-out score per version, drawn here as inline SVG).
import { api, auth } from "./api.js";
import { fmtNum, fmtTime, h, link, s, table } from "./dom.js";

export async function showDiagnosis(_parts, query) {
  const tenant = auth.who.admin ? query.get("tenant") || "" : "";
  const d = await api("/atdp/v1/diagnosis", { query: { tenant } });
  const view = h("section", { id: "diagnosis" }, h("h1", {}, "Diagnosis: where to fix"),
    h("p", {}, `${d.sessions} sessions since ${fmtTime(d.since)}; recommendation: `,
      h("strong", {}, d.recommendation ?? "nothing to fix")));
  if (!d.findings.length) {
    view.append(h("p", { class: "muted" }, "No findings."));
    return view;
  }
  view.append(h("ol", { class: "findings" }, d.findings.map((f) => h("li", { class: `finding layer-${f.layer}` },
    h("h3", {}, h("span", { class: "badge" }, f.layer), ` ${f.title}`),
    h("p", {}, `score ${fmtNum(f.score, 2)} · ${f.kind} · tenants ${f.tenants.join(", ") || "–"}`),
    h("p", { class: "muted" }, f.why),
    h("p", { class: "examples" }, "examples: ", f.examples.length ? f.examples.map((sid, i) => [i ? ", " : "",
      link(["session", f.tenants.length === 1 ? f.tenants[0] : "", sid], sid)]) : "–"),
    h("details", {}, h("summary", {}, "evidence and SQL"), h("pre", {}, JSON.stringify(f.evidence, null, 2)),
      h("pre", {}, f.sql))))));
  return view;
}

export async function showLearning(_parts, query) {
  const tenant = auth.who.admin ? query.get("tenant") || "" : "";
  const out = await api("/atdp/v1/learning", { query: { tenant } });
  const view = h("section", { id: "learning" }, h("h1", {}, "Learning"),
    h("p", {}, out.tenant ? `tenant ${out.tenant}` : "every tenant", ": mean session reward of the sessions each ",
      "version served, and its held-out score in the replay gate (candidate vs the version serving then)."));
  const points = out.data.filter((v) => v.mean_reward !== null || v.held_out);
  view.append(points.length ? chart(points) : h("p", { class: "muted" }, "No rewarded sessions or gate results yet."));
  view.append(table(["version", "status", "sessions", "rewarded", "mean reward", "± s.e.", "held-out (candidate)",
                     "held-out (serving)", "difference [95% CI]"],
    out.data.map((v) => [v.name, v.status, String(v.sessions), String(v.rewarded_sessions), fmtNum(v.mean_reward),
      fmtNum(v.reward_se), fmtNum(v.held_out?.candidate_mean), fmtNum(v.held_out?.serving_mean),
      v.held_out ? `${fmtNum(v.held_out.diff_mean)} [${fmtNum(v.held_out.ci_low)}, ${fmtNum(v.held_out.ci_high)}]` : "–"])));
  return view;
}

const W = 720;
const H = 300;
const PAD = { left: 48, right: 16, top: 16, bottom: 48 };

function chart(points) {
  const values = points.flatMap((p) => [p.mean_reward, p.held_out?.candidate_mean,
    p.mean_reward !== null && p.reward_se !== null ? p.mean_reward + p.reward_se : null,
    p.mean_reward !== null && p.reward_se !== null ? p.mean_reward - p.reward_se : null]).filter((x) => x !== null && x !== undefined);
  let lo = Math.min(0, ...values);
  let hi = Math.max(1, ...values);
  if (hi - lo < 1e-9) hi = lo + 1;
  const x = (i) => PAD.left + (points.length === 1 ? 0.5 : i / (points.length - 1)) * (W - PAD.left - PAD.right);
  const y = (v) => PAD.top + (1 - (v - lo) / (hi - lo)) * (H - PAD.top - PAD.bottom);
  const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img", id: "learning-chart",
                         "aria-label": "reward and held-out score per version" });
  for (let k = 0; k <= 4; k++) {
    const v = lo + (k / 4) * (hi - lo);
    svg.append(s("line", { x1: PAD.left, x2: W - PAD.right, y1: y(v), y2: y(v), class: "grid" }),
               s("text", { x: PAD.left - 6, y: y(v) + 4, "text-anchor": "end", class: "axis" }, v.toFixed(2)));
  }
  const every = Math.ceil(points.length / 12); // at most a dozen version names under the axis
  points.forEach((p, i) => {
    if (i % every === 0 || i === points.length - 1) {
      svg.append(s("text", { x: x(i), y: H - PAD.bottom + 18, "text-anchor": "middle", class: "axis" }, p.name));
    }
  });
  const series = (get, cls, label) => {
    const pts = points.map((p, i) => [i, get(p)]).filter(([, v]) => v !== null && v !== undefined);
    if (pts.length > 1) svg.append(s("polyline", { points: pts.map(([i, v]) => `${x(i)},${y(v)}`).join(" "), class: `line ${cls}` }));
    for (const [i, v] of pts) {
      svg.append(s("circle", { cx: x(i), cy: y(v), r: 4, class: `dot ${cls}` },
        s("title", {}, `${points[i].name}: ${label} ${v.toFixed(3)}`)));
    }
  };
  points.forEach((p, i) => {
    if (p.mean_reward !== null && p.reward_se !== null) {
      svg.append(s("line", { x1: x(i), x2: x(i), y1: y(p.mean_reward - p.reward_se), y2: y(p.mean_reward + p.reward_se), class: "err reward" }));
    }
  });
  series((p) => p.mean_reward, "reward", "mean reward");
  series((p) => p.held_out?.candidate_mean, "held-out", "held-out score");
  const legend = (i, cls, label) => [
    s("circle", { cx: PAD.left + 10 + i * 200, cy: H - 12, r: 5, class: `dot ${cls}` }),
    s("text", { x: PAD.left + 20 + i * 200, y: H - 8, class: "axis" }, label)];
  svg.append(...legend(0, "reward", "mean session reward (± s.e.)"), ...legend(1, "held-out", "held-out score (replay gate)"));
  return h("figure", {}, svg);
}
