// det-local dashboard: logging in (web/guard.py). The login address (?token=...) answers with a
// page carrying no data but this script: it keeps the token in this origin's Cache Storage
// (kept apart by scheme, host and port, unlike cookies), registers the service worker
// (/sw.js) that adds it as a header to this origin's requests, and opens the address without
// the token. A page refused for want of the token runs it too: a reload that bypassed the
// worker (Shift+Reload) is retried once through it.
"use strict";

const STORE = "det-local-login";
const KEY = "/__det_local_login__";
const RETRY = "det-local-login-retry";

function say(text) {
  const out = document.getElementById("login-status");
  if (out) out.textContent = text;
}

async function ready() {
  await navigator.serviceWorker.register("/sw.js", {scope: "/"});
  await navigator.serviceWorker.ready;
}

async function login(box) {
  if (!("serviceWorker" in navigator) || !self.caches) {
    say("this browser keeps no service worker here: open the dashboard at http://127.0.0.1 " +
        "or http://localhost (an ssh tunnel for another machine), in a window that is not " +
        "private, or send the header 'Authorization: Bearer TOKEN'");
    return;
  }
  const url = new URL(location.href);
  const token = url.searchParams.get("token");
  url.searchParams.delete("token");
  const clean = url.href;  // absolute, this origin ("//elsewhere" as a path would leave it)
  if (box.dataset.mode === "store" && token) {
    const cache = await caches.open(STORE);
    await cache.put(KEY, new Response(token));
    await ready();
    sessionStorage.removeItem(RETRY);
    location.replace(clean);
    return;
  }
  // refused: once, when the token is kept but this page did not come through the worker
  const kept = await (await caches.open(STORE)).match(KEY);
  const last = Number(sessionStorage.getItem(RETRY) || 0);
  if (kept && !token && !navigator.serviceWorker.controller && Date.now() - last > 10000) {
    sessionStorage.setItem(RETRY, String(Date.now()));
    await ready();
    location.replace(clean);
  }
}

const box = document.getElementById("login");
if (box) login(box).catch((err) => say(`cannot log in: ${err}`));
