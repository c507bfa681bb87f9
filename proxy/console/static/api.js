// The ATDP API with the operator's key: kept in sessionStorage (this tab only, gone when it closes),
// sent as a header, never put in a URL.

const KEY = "atdp.key";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export const auth = {
  key: () => sessionStorage.getItem(KEY),
  set: (key) => sessionStorage.setItem(KEY, key),
  clear: () => sessionStorage.removeItem(KEY),
  who: null, // {admin, tenant, key_id} from /atdp/v1/whoami
};

export async function api(path, { method = "GET", query = {}, body } = {}) {
  const q = new URLSearchParams(Object.entries(query).filter(([, v]) => v !== undefined && v !== null && v !== ""));
  const url = q.toString() ? `${path}?${q}` : path;
  const headers = { authorization: `Bearer ${auth.key() || ""}` };
  if (body !== undefined) headers["content-type"] = "application/json";
  const r = await fetch(url, { method, headers, body: body === undefined ? undefined : JSON.stringify(body),
                               cache: "no-store", credentials: "omit", referrerPolicy: "no-referrer" });
  const text = await r.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = null; }
  if (!r.ok) {
    const message = data && data.error && data.error.message ? data.error.message : `HTTP ${r.status}`;
    throw new ApiError(r.status, `${r.status}: ${message}`);
  }
  return data;
}

export async function signIn(key) {
  auth.set(key);
  try {
    auth.who = await api("/atdp/v1/whoami");
  } catch (e) {
    auth.clear();
    auth.who = null;
    throw e;
  }
  return auth.who;
}
