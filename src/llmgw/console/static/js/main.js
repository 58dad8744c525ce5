// The console's shell: sign-in, the hash router, and the live-update loop.
//
// Each page is a module whose default export is {title, create(ctx)}; create
// returns {el, refresh(), dispose?()}. The shell owns the timer so that only
// one refresh is ever in flight and nothing polls while the tab is hidden: a
// console left open in a background tab on a 2,000-node fleet should cost
// the control plane nothing.

import {
  api, ApiError, clearToken, getSession, may, setSession, setToken, setUnauthorizedHandler, signedIn,
} from "./api.js";
import { errorText } from "./dom.js";
import overview from "./pages/overview.js";
import nodes from "./pages/nodes.js";
import models from "./pages/models.js";
import replicas from "./pages/replicas.js";
import plan from "./pages/plan.js";
import usage from "./pages/usage.js";
import events from "./pages/events.js";

const PAGES = { overview, nodes, models, replicas, plan, usage, events };
// What each page reads (docs/sso.md): a role without it does not see the page.
const NEEDS = {
  overview: "fleet.read", nodes: "fleet.read", models: "catalog.read", replicas: "fleet.read",
  plan: "fleet.read", usage: "usage.read", events: "fleet.read",
};
// A few seconds: live enough to watch a replica come up, slow enough that ten
// open consoles are not a load on the control plane.
const POLL_MS = 4000;
// ... and never more than a fifth of the time spent loading: on a fleet
// where one refresh takes a second (the node list of 2,000 nodes), the page
// polls every five, instead of keeping the control plane and the browser
// busy all the time.
const MAX_BUSY_FRACTION = 0.2;

const $ = (id) => document.getElementById(id);

let current = null; // {name, page, instance}
let timer = null;
let inFlight = null;
let lastRefreshMs = 0;
let addressTimer = null;

function allowedPages() {
  return Object.keys(PAGES).filter((name) => may(NEEDS[name]));
}

function parseHash() {
  const raw = location.hash.replace(/^#\/?/, "");
  const [name, query] = raw.split("?");
  const allowed = allowedPages();
  const fallback = allowed.includes("overview") ? "overview" : allowed[0];
  return { name: allowed.includes(name) ? name : fallback, params: new URLSearchParams(query || "") };
}

function setStatus(text, isError = false) {
  const el = $("status");
  el.textContent = text;
  el.classList.toggle("error", isError);
}

async function refresh() {
  if (!current || inFlight) return inFlight;
  const instance = current.instance;
  inFlight = (async () => {
    const started = performance.now();
    try {
      await instance.refresh();
      lastRefreshMs = performance.now() - started;
      if (current && current.instance === instance) {
        setStatus(`Updated ${new Date().toLocaleTimeString("en-GB", { hour12: false })}`);
      }
    } catch (err) {
      if (!(err instanceof ApiError && err.status === 401)) setStatus(`Update failed: ${errorText(err)}`, true);
    } finally {
      inFlight = null;
    }
  })();
  return inFlight;
}

function schedule() {
  clearTimeout(timer);
  timer = null;
  if (!signedIn() || document.hidden || !current) return;
  const delay = Math.max(POLL_MS, lastRefreshMs / MAX_BUSY_FRACTION);
  timer = setTimeout(async () => {
    timer = null;
    await refresh();
    schedule();
  }, delay);
}

function showPage() {
  if (!signedIn()) return showSignIn();
  const { name, params } = parseHash();
  if (current && current.name === name) return;
  if (current && current.instance.dispose) current.instance.dispose();
  const page = PAGES[name];
  const ctx = {
    params,
    // Filters write themselves into the address without a reload, so a view
    // can be bookmarked or shared and survives the browser's back button.
    setParams(next) {
      const qs = new URLSearchParams(next);
      for (const [k, v] of [...qs.entries()]) if (!v) qs.delete(k);
      const str = qs.toString();
      const hash = `#/${name}${str ? `?${str}` : ""}`;
      // Only on a change, and after typing pauses: replaceState is an IPC
      // round trip in Chromium and was the slowest part of a keystroke.
      clearTimeout(addressTimer);
      if (hash === location.hash) return;
      addressTimer = setTimeout(() => {
        if (current && current.name === name) history.replaceState(null, "", hash);
      }, 150);
    },
    refreshNow: () => {
      // A refresh already in flight may have read the state before the
      // action; wait for it and read again.
      const pending = inFlight || Promise.resolve();
      return pending.then(refresh);
    },
  };
  const instance = page.create(ctx);
  current = { name, page, instance };
  document.title = `${page.title} · llmgw console`;
  const allowed = allowedPages();
  for (const a of document.querySelectorAll("#nav a")) {
    a.hidden = !allowed.includes(a.dataset.page);
    if (a.dataset.page === name) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  const who = getSession();
  $("whoami").textContent = who ? `${who.name} (${who.roles.join(", ")})` : "";
  $("whoami").hidden = !who;
  $("page").replaceChildren(instance.el);
  $("signin").hidden = true;
  $("nav").hidden = false;
  $("signout").hidden = false;
  setStatus("Loading…");
  lastRefreshMs = 0;
  refresh();
  schedule();
}

function showSignIn(message = "") {
  clearTimeout(timer);
  timer = null;
  if (current && current.instance.dispose) current.instance.dispose();
  current = null;
  $("page").replaceChildren();
  $("nav").hidden = true;
  $("signout").hidden = true;
  $("whoami").hidden = true;
  $("signin").hidden = false;
  $("signin-error").textContent = message;
  setStatus("");
  document.title = "Sign in · llmgw console";
  $("token").focus();
}

async function signIn(event) {
  event.preventDefault();
  const token = $("token").value.trim();
  if (!token) return;
  setToken(token);
  $("signin-error").textContent = "";
  try {
    // Check the token once here so a typo is reported on the form, not as a
    // page that flashes and bounces back.
    await api("/summary");
  } catch (err) {
    if (err instanceof ApiError && err.status === 401) return; // handler showed the form
    $("signin-error").textContent = `Could not sign in: ${errorText(err)}`;
    clearToken();
    return;
  }
  $("token").value = "";
  showPage();
}

async function signOut() {
  if (getSession()) {
    // The server ends the session; the cookie it clears was never readable here.
    await fetch("/console/auth/logout", { method: "POST", headers: { "X-Llmgw-Csrf": "1" } }).catch(() => {});
    setSession(null);
  }
  clearToken();
  showSignIn("Signed out.");
}

// Whether the control plane offers SSO, and whether this browser is signed in.
async function loadSession() {
  try {
    const response = await fetch("/console/auth/session", { cache: "no-store" });
    const info = await response.json();
    $("sso").hidden = !info.sso;
    setSession(info.signed_in ? info : null);
  } catch {
    $("sso").hidden = true;
  }
}

async function boot() {
  setUnauthorizedHandler((message) => showSignIn(message));
  $("signin-form").addEventListener("submit", signIn);
  $("signout").addEventListener("click", signOut);
  // A failed SSO sign-in comes back with its reason in the address: shown as text, then dropped.
  const query = new URLSearchParams(location.search);
  const failed = query.get("signin_error");
  if (failed) history.replaceState(null, "", location.pathname + location.hash);
  await loadSession();
  window.addEventListener("hashchange", showPage);
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && current) refresh();
    schedule();
  });
  if (failed && !signedIn()) showSignIn(failed);
  else showPage();
}

boot();
