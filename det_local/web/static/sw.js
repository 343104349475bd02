// det-local dashboard: the service worker that carries the login (web/guard.py).
//
// The access token is kept in this origin's Cache Storage (scheme, host AND port: a server on
// another port of this host cannot read it, unlike a cookie, which every port of a host is
// sent). This worker adds it as the header X-Det-Local-Token to this origin's own GET requests
// (pages, /api/, streams, downloads) and to nothing else: a request to any other origin goes
// out untouched, so no other server ever receives the token.
"use strict";

const STORE = "det-local-login";
const KEY = "/__det_local_login__";
const HEADER = "X-Det-Local-Token";

self.addEventListener("install", (event) => event.waitUntil(self.skipWaiting()));
self.addEventListener("activate", (event) => event.waitUntil(self.clients.claim()));

async function storedToken() {
  const cache = await caches.open(STORE);
  const hit = await cache.match(KEY);
  return hit ? (await hit.text()).trim() : "";
}

async function withToken(request) {
  const token = await storedToken();
  if (!token) return fetch(request);
  const headers = new Headers(request.headers);
  headers.set(HEADER, token);
  const navigate = request.mode === "navigate";
  return fetch(new Request(request.url, {
    method: "GET",
    headers,
    credentials: "omit",
    cache: request.cache === "only-if-cached" ? "default" : request.cache,
    // a navigation's redirect is followed by the browser (and comes back through here)
    redirect: navigate ? "manual" : request.redirect,
    referrerPolicy: "no-referrer",
    signal: request.signal,
  }));
}

self.addEventListener("fetch", (event) => {
  const request = event.request;
  // this origin's own reads only: never another port, host or scheme
  if (new URL(request.url).origin !== self.location.origin) return;
  if (request.method !== "GET") return;
  event.respondWith(withToken(request));
});
