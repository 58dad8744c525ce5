// A real OpenID Connect provider for the SSO tests: panva's oidc-provider
// (certified by the OpenID Foundation) with its own sign-in page.
//
// The package's development sign-in page loads a web font from the internet,
// so the tests' browser would leave the machine; this one is self-contained
// and checks a password, like a real provider. Consent is granted without a
// page: the console is a first-party client.
//
// Configured by one JSON document in OIDC_TEST_CONFIG:
//   {issuer, port, audience,
//    clients: [{client_id, client_secret, redirect_uris}],
//    accounts: {login: {password, claims...}},
//    service_groups: {client_id: [groups]}}   (claims of client_credentials tokens)
// Prints "ready" once it listens.

import http from "node:http";
import { exportJWK, generateKeyPair } from "jose";
import Provider from "oidc-provider";

const cfg = JSON.parse(process.env.OIDC_TEST_CONFIG);
const { privateKey } = await generateKeyPair("RS256", { extractable: true });
const signingKey = { ...(await exportJWK(privateKey)), kid: "test-key-1", alg: "RS256", use: "sig" };

const accounts = cfg.accounts;

const provider = new Provider(cfg.issuer, {
  clients: cfg.clients.map((c) => ({
    grant_types: ["authorization_code", "client_credentials"],
    response_types: ["code"],
    token_endpoint_auth_method: "client_secret_basic",
    ...c,
  })),
  jwks: { keys: [signingKey] },
  cookies: { keys: ["llmgw-test-cookie-key"] },
  pkce: { required: () => true },
  claims: {
    openid: ["sub"],
    email: ["email", "email_verified"],
    profile: ["name", "preferred_username", "groups", "team"],
  },
  // Scope claims in the ID token itself (the relying party reads groups there).
  conformIdTokenClaims: false,
  findAccount: async (_ctx, id) => {
    const account = accounts[id];
    if (!account) return undefined;
    const { password: _password, ...claims } = account;
    return { accountId: id, claims: async () => ({ sub: id, ...claims }) };
  },
  interactions: { url: (_ctx, interaction) => `/interaction/${interaction.uid}` },
  features: {
    devInteractions: { enabled: false },
    clientCredentials: { enabled: true },
    resourceIndicators: {
      enabled: true,
      getResourceServerInfo: (_ctx, resource) => {
        if (resource !== cfg.audience) throw new Error(`unknown resource ${resource}`);
        return { scope: "admin", audience: resource, accessTokenFormat: "jwt",
                 jwt: { sign: { alg: "RS256" } } };
      },
    },
  },
  extraTokenClaims: async (_ctx, token) => {
    if (token.kind !== "ClientCredentials") return undefined;
    return { groups: (cfg.service_groups || {})[token.clientId] || [] };
  },
});

const escape = (s) => String(s).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

function page(uid, error) {
  return `<!doctype html><html><head><meta charset="utf-8"><title>Test provider sign-in</title></head>
<body><h1>Sign in to the test provider</h1>
${error ? `<p role="alert">${escape(error)}</p>` : ""}
<form method="post" action="/interaction/${escape(uid)}/login">
<label>Username <input name="username" autocomplete="username" required></label>
<label>Password <input name="password" type="password" autocomplete="current-password" required></label>
<button type="submit">Sign in</button></form></body></html>`;
}

async function readForm(req) {
  const chunks = [];
  for await (const chunk of req) chunks.push(chunk);
  return new URLSearchParams(Buffer.concat(chunks).toString("utf8"));
}

async function consent(req, res, details) {
  const { prompt: { details: missing }, params, session, grantId } = details;
  const grant = grantId
    ? await provider.Grant.find(grantId)
    : new provider.Grant({ accountId: session.accountId, clientId: params.client_id });
  if (missing.missingOIDCScope) grant.addOIDCScope(missing.missingOIDCScope.join(" "));
  if (missing.missingOIDCClaims) grant.addOIDCClaims(missing.missingOIDCClaims);
  if (missing.missingResourceScopes) {
    for (const [indicator, scopes] of Object.entries(missing.missingResourceScopes)) {
      grant.addResourceScope(indicator, scopes.join(" "));
    }
  }
  await provider.interactionFinished(req, res, { consent: { grantId: await grant.save() } },
    { mergeWithLastSubmission: true });
}

async function interaction(req, res, uid, action) {
  const details = await provider.interactionDetails(req, res);
  if (details.prompt.name === "consent") return consent(req, res, details);
  if (action === "/login" && req.method === "POST") {
    const form = await readForm(req);
    const account = accounts[form.get("username")];
    if (!account || account.password !== form.get("password")) {
      res.writeHead(200, { "content-type": "text/html; charset=utf-8" });
      return res.end(page(uid, "Wrong username or password."));
    }
    return provider.interactionFinished(req, res, { login: { accountId: form.get("username") } },
      { mergeWithLastSubmission: false });
  }
  res.writeHead(200, { "content-type": "text/html; charset=utf-8", "cache-control": "no-store" });
  return res.end(page(uid));
}

const handle = provider.callback();
const server = http.createServer((req, res) => {
  const match = new URL(req.url, cfg.issuer).pathname.match(/^\/interaction\/([^/]+)(\/login)?$/);
  if (!match) return handle(req, res);
  interaction(req, res, match[1], match[2]).catch((err) => {
    res.writeHead(500, { "content-type": "text/plain" });
    res.end(String(err));
  });
});
server.listen(cfg.port, "127.0.0.1", () => console.log("ready"));
