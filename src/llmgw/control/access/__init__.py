"""Who may use the admin API and the console: roles, single sign-on (OIDC), sessions.

roles     the roles, the actions each admin route performs, and the one table between them
settings  the ``--oidc-*`` flags, checked at start-up
oidc      the relying party: discovery, authorization code with PKCE, token verification
rolemap   a verified token's claims to a principal (groups to roles)
sessions  console sessions and logins in flight, under the hashes of their cookies
door      a request's credential to a principal (admin token, provider token, session)
login     the console's sign-in routes
"""
