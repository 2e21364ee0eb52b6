// The search page of `densefit serve`: a client of the server's HTTP API (GET /health,
// POST /search), nothing else. The API key stays in this page's memory and goes out as the
// X-API-Key header, never in a URL.
"use strict";

const $ = (id) => document.getElementById(id);
const STOPWORDS = new Set((document.body.dataset.stopwords || "").split(" "));
const WORD = /[\p{L}\p{N}_]{2,}/gu; // BM25's tokens: runs of 2+ word characters, lower-cased

function headers(json) {
  const h = json ? { "Content-Type": "application/json" } : {};
  const key = $("api-key").value.trim();
  if (key) h["X-API-Key"] = key;
  return h;
}

// The server's one-line message from an error response, whatever the route's error shape.
async function errorOf(response) {
  let body = null;
  try {
    body = await response.json();
  } catch (_) {
    return `HTTP ${response.status}`;
  }
  const error = body && body.error;
  if (typeof error === "string") return error;
  if (error && typeof error.message === "string") return error.message;
  return `HTTP ${response.status}`;
}

// The server's (or the page's) message; the last answer's hits go with it.
function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
  if (message) {
    $("hits").replaceChildren();
    $("summary").textContent = "";
  }
}

function needKey(message) {
  const first = $("key-box").hidden;
  $("store").textContent = "this server needs an API key";
  $("key-box").hidden = false;
  showError(message);
  if (first) $("api-key").focus();
}

// What the store can do: the modes it searches by, its model and size.
async function connect() {
  let response;
  try {
    response = await fetch("/health", { headers: headers(false), cache: "no-store" });
  } catch (err) {
    showError(`the server cannot be reached: ${err.message}`);
    return false;
  }
  if (response.status === 401) {
    needKey(await errorOf(response));
    return false;
  }
  if (!response.ok) {
    showError(await errorOf(response));
    return false;
  }
  const health = await response.json();
  const modes = health.modes || [];
  if (!modes.length) {
    $("store").textContent =
      "This server only embeds (it serves no store): POST /v1/embeddings or /embed, see /docs.";
    for (const el of $("search").elements) el.disabled = true;
    return false;
  }
  const mode = $("mode");
  const chosen = mode.value;
  mode.replaceChildren(...modes.map((m) => new Option(m, m, false, m === chosen)));
  if (health.max_k) $("k").max = health.max_k;
  $("store").textContent =
    `${health.model} · ${Number(health.documents).toLocaleString("en")} documents` +
    (health.engine ? ` · ${health.engine}` : "");
  showError("");
  return true;
}

let connected = false;

async function search(event) {
  event.preventDefault();
  if (!connected) {
    connected = await connect();
    if (!connected) return;
  }
  const query = $("query").value;
  const body = { query, k: Number($("k").value) || 10, mode: $("mode").value };
  const filters = $("filters").value.trim();
  if (filters) {
    try {
      body.filters = JSON.parse(filters);
    } catch (err) {
      showError(`filter: not valid JSON (${err.message})`);
      return;
    }
  }
  $("go").disabled = true;
  const started = performance.now();
  try {
    const response = await fetch("/search", {
      method: "POST",
      headers: headers(true),
      body: JSON.stringify(body),
    });
    if (response.status === 401) {
      needKey(await errorOf(response));
      return;
    }
    if (!response.ok) {
      showError(await errorOf(response));
      return;
    }
    const hits = (await response.json()).results[0].hits;
    const ms = Math.round(performance.now() - started);
    showError("");
    render(hits, body.mode === "dense" ? null : terms(query));
    $("summary").textContent = `${hits.length} hit${hits.length === 1 ? "" : "s"} · ${body.mode} · ${ms} ms`;
  } catch (err) {
    showError(`the server cannot be reached: ${err.message}`);
  } finally {
    $("go").disabled = false;
  }
}

// The query's words a BM25 search matches on (its stop words left out).
function terms(query) {
  const words = (query.toLowerCase().match(WORD) || []).filter((w) => !STOPWORDS.has(w));
  return new Set(words);
}

// `text` as nodes, the words in `words` marked (textContent only: no HTML from a document).
function highlighted(text, words) {
  if (!words || !words.size) return [document.createTextNode(text)];
  const nodes = [];
  let last = 0;
  for (const match of text.matchAll(WORD)) {
    if (!words.has(match[0].toLowerCase())) continue;
    if (match.index > last) nodes.push(document.createTextNode(text.slice(last, match.index)));
    const mark = document.createElement("mark");
    mark.textContent = match[0];
    nodes.push(mark);
    last = match.index + match[0].length;
  }
  nodes.push(document.createTextNode(text.slice(last)));
  return nodes;
}

function element(tag, className, ...children) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  el.append(...children);
  return el;
}

function render(hits, words) {
  const list = $("hits");
  list.replaceChildren(
    ...hits.map((hit) => {
      const head = element(
        "div",
        "head",
        element("span", "rank", `#${hit.rank}`),
        element("span", "score", Number(hit.score).toFixed(4)),
        element("code", "id", hit.id),
      );
      if (hit.title) head.append(element("strong", "title", ...highlighted(hit.title, words)));
      const text = element("p", "text", ...highlighted(hit.text, words));
      text.title = "the first lines: click for the whole text";
      text.addEventListener("click", () => text.classList.add("open"));
      const item = element("li", "hit", head, text);
      const meta = Object.entries(hit.meta || {});
      if (meta.length) {
        item.append(
          element(
            "dl",
            "meta",
            ...meta.flatMap(([k, v]) => [element("dt", "", k), element("dd", "", JSON.stringify(v))]),
          ),
        );
      }
      return item;
    }),
  );
}

document.addEventListener("DOMContentLoaded", async () => {
  $("search").addEventListener("submit", search);
  $("mode").addEventListener("change", () => {
    if ($("query").value) $("search").requestSubmit();
  });
  $("api-key").addEventListener("change", async () => {
    connected = await connect();
  });
  $("query").focus();
  connected = await connect(); // a server with a key: the key box takes the focus
});
