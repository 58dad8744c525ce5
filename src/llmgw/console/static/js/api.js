// The admin API client: the only module that holds the token or calls fetch.
//
// The token lives in sessionStorage, not localStorage: it dies with the tab,
// so a console left open on a shared screen does not keep fleet control in
// the browser profile for the next person.

const TOKEN_KEY = "llmgw.adminToken";
const BASE = "/admin/v1";

// With single sign-on the browser holds no token at all: an HttpOnly session
// cookie travels by itself, and every call carries X-Llmgw-Csrf, which the
// control plane demands of a session's writes (a cross-site form cannot set it).
let session = null; // {name, roles, teams, actions} while signed in through SSO

export function setSession(info) {
  session = info;
}

export function getSession() {
  return session;
}

/** Signed in either way: an admin token in this tab, or an SSO session. */
export function signedIn() {
  return Boolean(session || getToken());
}

/**
 * The team a team admin's usage reads are for (the API wants one named: docs/sso.md); undefined
 * for every other caller, whose reads cover the whole fleet.
 */
export function ownTeam() {
  if (!session || session.roles.some((r) => r !== "team_admin")) return undefined;
  return session.teams[0];
}

/** Whether the caller may perform an action (docs/sso.md); the admin token may do all. */
export function may(action) {
  return !session || session.actions.includes(action);
}

export class ApiError extends Error {
  constructor(status, message, body) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.body = body;
  }
}

// Called when the API answers 401: the app returns to the sign-in form.
let onUnauthorized = () => {};

export function setUnauthorizedHandler(handler) {
  onUnauthorized = handler;
}

export function getToken() {
  return sessionStorage.getItem(TOKEN_KEY);
}

export function setToken(token) {
  sessionStorage.setItem(TOKEN_KEY, token);
}

export function clearToken() {
  sessionStorage.removeItem(TOKEN_KEY);
}

function messageOf(status, body, fallback) {
  const err = body && body.error;
  if (err && typeof err.message === "string") return err.message;
  if (body && typeof body.detail === "string") return body.detail;
  if (body && Array.isArray(body.detail)) {
    return body.detail.map((d) => `${(d.loc || []).join(".")}: ${d.msg}`).join("; ");
  }
  return fallback || `HTTP ${status}`;
}

/**
 * Call the admin API. `path` is relative to /admin/v1 ("/summary").
 * Options: method, query (object), json (body), text + contentType (raw body),
 * raw (answer the body's text unparsed: a CSV download).
 */
export async function api(path, options = {}) {
  return (await apiWithHeaders(path, options)).body;
}

/** As api(), answering {body, headers} for the few callers that read a header. */
export async function apiWithHeaders(path, { method = "GET", query, json, text, contentType, raw: wantRaw = false } = {}) {
  const token = getToken();
  if (!token && !session) {
    onUnauthorized("Sign in.");
    throw new ApiError(401, "not signed in");
  }
  let url = BASE + path;
  if (query) {
    const params = new URLSearchParams();
    for (const [k, v] of Object.entries(query)) {
      if (v === undefined || v === null || v === "") continue;
      params.set(k, String(v));
    }
    const qs = params.toString();
    if (qs) url += `?${qs}`;
  }
  const headers = token
    ? { Authorization: `Bearer ${token}`, Accept: "application/json" }
    : { "X-Llmgw-Csrf": "1", Accept: "application/json" };
  let body;
  if (json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  } else if (text !== undefined) {
    headers["Content-Type"] = contentType || "text/plain";
    body = text;
  }
  let response;
  try {
    response = await fetch(url, { method, headers, body, cache: "no-store" });
  } catch (err) {
    throw new ApiError(0, `control plane unreachable (${err.message})`);
  }
  let parsed = null;
  const raw = await response.text();
  if (wantRaw && response.ok) return { body: raw, headers: response.headers };
  if (raw) {
    try {
      parsed = JSON.parse(raw);
    } catch {
      parsed = raw;
    }
  }
  if (response.status === 401) {
    clearToken();
    const why = messageOf(401, parsed, "unauthorized");
    const what = session ? "session" : "admin token";
    session = null;
    onUnauthorized(`The control plane refused the ${what} (${why}). Sign in again.`);
    throw new ApiError(401, why, parsed);
  }
  if (!response.ok) {
    throw new ApiError(response.status, messageOf(response.status, parsed, response.statusText), parsed);
  }
  return { body: parsed, headers: response.headers };
}
