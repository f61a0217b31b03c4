// swarmbatch web view: plain JavaScript, no build step, no outside resources. Reads the REST API beside it with the
// API key the user signs in with (kept in sessionStorage: gone when the tab closes). Text from the API is only ever
// set as textContent, never parsed as HTML.
"use strict";

const KEY = "swarmbatch.apiKey";
const API = new URL("../v1/", location.href); // /ui/ -> /v1/ (also behind a path prefix)
const POLL_MS = 2000;
const TERMINAL = new Set(["completed", "failed", "expired", "cancelled"]);
let timer = null;

// ---- helpers ------------------------------------------------------------------------------------------------------
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "on") for (const [event, fn] of Object.entries(value)) node.addEventListener(event, fn);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

class ApiError extends Error {}

async function api(path) {
  const response = await fetch(new URL(path, API), {headers: {Authorization: `Bearer ${sessionStorage.getItem(KEY)}`}});
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try { message = (await response.json()).error.message || message; } catch (e) { /* not our error body */ }
    if (response.status === 401) signOut(message);
    throw new ApiError(message);
  }
  return response;
}

const json = async (path) => (await api(path)).json();
const jsonLines = async (path) => (await (await api(path)).text()).split("\n").filter(Boolean).map((l) => JSON.parse(l));
const plural = (n, noun) => `${n} ${noun}${n === 1 ? "" : "s"}`;
const when = (unix) => (unix ? new Date(unix * 1000).toLocaleString() : "—");
const short = (peer) => `…${peer.slice(-8)}`;

function seconds(job) {
  if (!job.in_progress_at) return 0;
  const end = job.completed_at || job.failed_at || job.cancelled_at || job.expired_at || Date.now() / 1000;
  return Math.max(0, end - job.in_progress_at);
}

function throughput(job) {
  const s = seconds(job);
  return s > 0 && job.tokens_generated ? `${(job.tokens_generated / s).toFixed(1)} tok/s` : "—";
}

function progressBar(job, wide = false) {
  const {total, completed, failed} = job.request_counts;
  const done = total ? (100 * completed) / total : 0;
  const bad = total ? (100 * failed) / total : 0;
  return el("div", {class: wide ? "bar wide" : "bar", role: "progressbar", "aria-valuemin": 0, "aria-valuemax": total,
                    "aria-valuenow": completed + failed, "data-status": job.status, title: `${completed} completed, ${failed} failed of ${total}`},
    el("div", {class: "done", style: `width:${done}%`}), el("div", {class: "failed", style: `left:${done}%;width:${bad}%`}));
}

const status = (job) => el("span", {class: `status ${job.status}`}, job.status.replace("_", " "));
const counts = (job) => `${job.request_counts.completed} / ${job.request_counts.total}` +
  (job.request_counts.failed ? ` (${job.request_counts.failed} failed)` : "");

function schedule(fn, ms) {
  clearTimeout(timer);
  timer = setTimeout(fn, ms);
}

function stamp(text) {
  document.getElementById("updated").textContent = text;
}

// ---- sign in / out ------------------------------------------------------------------------------------------------
function signOut(message = "") {
  sessionStorage.removeItem(KEY);
  clearTimeout(timer);
  document.getElementById("sign-in-error").textContent = message;
  show(false);
}

function show(signedIn) {
  document.getElementById("sign-in").hidden = signedIn;
  document.getElementById("nav").hidden = !signedIn;
  document.getElementById("main").hidden = !signedIn;
  if (!signedIn) document.getElementById("api-key").focus();
}

async function signIn(event) {
  event.preventDefault();
  const input = document.getElementById("api-key");
  sessionStorage.setItem(KEY, input.value.trim());
  try {
    await json("batches?limit=1"); // the key works
  } catch (e) {
    signOut(e instanceof ApiError ? e.message : `the API did not answer (${e.message})`);
    return;
  }
  input.value = "";
  show(true);
  route();
}

// ---- pages --------------------------------------------------------------------------------------------------------
function page(title, ...content) {
  const main = document.getElementById("main");
  main.replaceChildren(el("h1", {}, title), ...content.flat(Infinity).filter(Boolean));
}

async function jobsPage() {
  const listing = await json("batches?limit=100");
  const rows = listing.data.map((job) => el("tr", {"data-job": job.id},
    el("td", {}, el("a", {href: `#/jobs/${job.id}`, class: "mono"}, job.id)),
    el("td", {}, status(job)),
    el("td", {}, progressBar(job)),
    el("td", {class: "num"}, counts(job)),
    el("td", {class: "num"}, job.tokens_generated),
    el("td", {class: "num"}, throughput(job)),
    el("td", {class: "error"}, job.blocked_reason || (job.errors ? plural(job.errors.data.length, "line error") : "")),
    el("td", {class: "mono muted"}, job.model),
    el("td", {}, when(job.created_at))));
  page("Jobs", listing.data.length ? el("table", {id: "jobs"},
    el("thead", {}, el("tr", {}, ["Job", "Status", "Progress", "Requests", "Tokens", "Throughput", "Errors", "Model",
                                  "Created"].map((h) => el("th", {}, h)))),
    el("tbody", {}, rows)) : el("p", {class: "muted"}, "No jobs yet for this key: submit one with the API, the openai SDK, or 'swarmbatch submit'."),
    listing.has_more ? el("p", {class: "muted"}, "Showing the newest 100.") : null);
  stamp(`Updated ${new Date().toLocaleTimeString()}; refreshing every ${POLL_MS / 1000} s.`);
  schedule(route, POLL_MS);
}

async function download(path, filename) {
  const blob = await (await api(path)).blob();
  const link = el("a", {href: URL.createObjectURL(blob), download: filename});
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 10000);
}

function errorsTable(lines) {
  if (!lines.length) return el("p", {class: "muted", id: "no-errors"}, "No errors.");
  return el("table", {id: "errors"},
    el("thead", {}, el("tr", {}, ["Line", "custom_id", "Code", "Parameter", "Message"].map((h) => el("th", {}, h)))),
    el("tbody", {}, lines.map((l) => el("tr", {},
      el("td", {class: "num"}, l.error.line ?? ""), el("td", {class: "mono"}, l.custom_id ?? ""),
      el("td", {class: "mono"}, l.error.code), el("td", {class: "mono"}, l.error.param ?? ""),
      el("td", {}, l.error.message)))));
}

async function jobPage(id) {
  const [job, errors] = await Promise.all([json(`batches/${encodeURIComponent(id)}`),
                                           jsonLines(`batches/${encodeURIComponent(id)}/errors`)]);
  const facts = [["Status", status(job)], ["Requests", counts(job)], ["Tokens generated", job.tokens_generated],
    ["Throughput", throughput(job)], ["Model", job.model], ["Endpoint", job.endpoint],
    ["Input file", job.input_filename || job.input_file_id || "—"], ["Created", when(job.created_at)],
    ["Started", when(job.in_progress_at)], ["Finished", when(job.completed_at || job.failed_at || job.cancelled_at || job.expired_at)],
    ["Expires", when(job.expires_at)], ["Waiting for", job.blocked_reason || "—"],
    ["Checked steps", `${job.verification.steps_verified} verified, ${job.verification.mismatches} mismatches`]];
  page(`Job ${job.id}`, progressBar(job, true),
    el("dl", {class: "facts"}, facts.map(([k, v]) => [el("dt", {}, k), el("dd", {}, v)])),
    el("div", {class: "actions"},
      el("button", {type: "button", id: "download-output", on: {click: () => download(`batches/${job.id}/results`, `${job.id}.output.jsonl`)}},
         TERMINAL.has(job.status) ? "Download output" : "Download output so far"),
      el("button", {type: "button", id: "download-errors", on: {click: () => download(`batches/${job.id}/errors`, `${job.id}.errors.jsonl`)}},
         "Download errors"),
      el("a", {class: "button", href: "#/jobs"}, "All jobs")),
    el("h2", {}, `Errors (${errors.length})`), errorsTable(errors),
    Object.keys(job.metadata || {}).length ? [el("h2", {}, "Metadata"), el("pre", {}, JSON.stringify(job.metadata, null, 2))] : null);
  stamp(`Updated ${new Date().toLocaleTimeString()}` + (TERMINAL.has(job.status) ? "." : `; refreshing every ${POLL_MS / 1000} s.`));
  if (!TERMINAL.has(job.status)) schedule(route, POLL_MS);
}

function servers(snapshot) {
  const byPeer = new Map();
  for (const block of snapshot.blocks) {
    for (const s of block.servers) if (!byPeer.has(s.peer_id)) byPeer.set(s.peer_id, s);
  }
  return [...byPeer.values()].sort((a, b) => a.start - b.start || a.peer_id.localeCompare(b.peer_id));
}

function cellClass(server) {
  if (!server.compatible || server.member === false) return "ignored";
  return server.state;
}

function swarmMap(snapshot) {
  const n = snapshot.num_blocks;
  const indices = [...Array(n).keys()];
  const missing = new Set(snapshot.missing.flatMap(([a, b]) => indices.filter((i) => i >= a && i < b)));
  const holds = (s, i) => snapshot.blocks[i].servers.some((x) => x.peer_id === s.peer_id);
  const rows = servers(snapshot).map((s) => el("tr", {"data-peer": s.peer_id},
    el("th", {class: "mono", title: s.peer_id}, short(s.peer_id)),
    indices.map((i) => el("td", {class: holds(s, i) ? `cell ${cellClass(s)}` : "cell", title: holds(s, i) ? `block ${i}: ${s.state}` : ""})),
    el("td", {}, s.state + (s.compatible ? "" : ` (protocol ${s.version}: not used)`) + (s.member === false ? " (not a member)" : "") + (s.banned ? " (banned)" : "")),
    el("td", {class: "num"}, `${s.start}:${s.end}`),
    el("td", {class: "num"}, s.throughput),
    el("td", {class: "num"}, s.cache_tokens_left),
    el("td", {class: "num"}, s.rtt_ms ?? "—")));
  const coverage = el("tr", {class: "coverage"}, el("th", {}, "covered"),
    indices.map((i) => el("td", {class: `cell ${missing.has(i) ? "missing" : "covered"}`, title: `block ${i}`}, missing.has(i) ? "!" : "")),
    el("td", {colspan: 5}, snapshot.complete ? "All blocks are served." : `Missing blocks: ${snapshot.missing.map(([a, b]) => `${a}:${b}`).join(", ")}`));
  return el("div", {class: "scroll"}, el("table", {class: "grid", "data-model": snapshot.model},
    el("thead", {}, el("tr", {}, el("th", {}, "server \\ block"), indices.map((i) => el("th", {class: "num"}, i)),
      ["State", "Span", "Throughput (blocks/s)", "Cache tokens free", "RTT ms"].map((h) => el("th", {}, h)))),
    el("tbody", {}, rows, coverage)));
}

const LEGEND = el("p", {class: "legend"}, [["online", "online"], ["joining", "joining"], ["offline", "offline"],
  ["ignored", "not used (old protocol or not a member)"], ["missing", "no server"]].map(([cls, text]) =>
  el("span", {}, el("i", {class: `cell ${cls}`}), text)));

async function swarmPage() {
  const swarm = await json("swarm");
  const sections = swarm.data.map((s) => [
    el("h2", {}, s.model),
    el("p", {class: "muted"}, `model id ${s.model_id}, ${s.num_blocks} blocks; seen by worker ${s.worker} ${s.age_seconds} s ago (${when(s.taken_at)})`),
    swarmMap(s)]);
  const unseen = swarm.models.filter((m) => !swarm.data.some((s) => s.model === m));
  page("Swarm", sections.length ? [LEGEND, sections] : null,
    unseen.length ? el("p", {class: "muted"}, `No worker has reported the swarm of ${unseen.join(", ")} yet: workers publish what they see while they run jobs.`) : null);
  stamp(`Updated ${new Date().toLocaleTimeString()}; refreshing every ${(POLL_MS * 2.5) / 1000} s.`);
  schedule(route, POLL_MS * 2.5);
}

// ---- routing ------------------------------------------------------------------------------------------------------
async function route() {
  clearTimeout(timer);
  if (!sessionStorage.getItem(KEY)) return show(false);
  const [, view, id] = location.hash.split("/");
  for (const link of document.querySelectorAll("nav a[data-view]")) link.classList.toggle("active", link.dataset.view === (view || "jobs"));
  try {
    if (view === "swarm") await swarmPage();
    else if (view === "jobs" && id) await jobPage(decodeURIComponent(id));
    else await jobsPage();
  } catch (e) {
    if (!sessionStorage.getItem(KEY)) return;
    page("Error", el("p", {class: "error", role: "alert"}, e.message));
    schedule(route, POLL_MS * 2.5);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("sign-in-form").addEventListener("submit", signIn);
  document.getElementById("sign-out").addEventListener("click", () => signOut());
  window.addEventListener("hashchange", route);
  if (sessionStorage.getItem(KEY)) show(true);
  route();
});
