// The dtq HTTP API, seen from the dashboard. URLs are relative to the page (/dashboard/), so a
// path prefix added by a reverse proxy is kept. The API key is kept in this tab's
// sessionStorage and sent only as the X-API-Key header of destructive requests.

const KEY_STORAGE = "dtq.apiKey";
const API_BASE = new URL("../api/v1/", location.href);

export class ApiError extends Error {
  constructor(status, code, message, details) {
    super(message);
    this.status = status;
    this.code = code;
    this.details = details || {};
  }
}

export const apiKey = {
  get() {
    try {
      return sessionStorage.getItem(KEY_STORAGE) || "";
    } catch {
      return "";
    }
  },
  set(value) {
    sessionStorage.setItem(KEY_STORAGE, value);
  },
  clear() {
    sessionStorage.removeItem(KEY_STORAGE);
  },
};

/** Server clock minus browser clock (ms), from the Date header; 0 unless they differ by > 2 s. */
export let clockSkewMs = 0;

function noteServerDate(resp) {
  const date = Date.parse(resp.headers.get("date") || "");
  if (Number.isNaN(date)) return;
  const skew = date + 500 - Date.now(); // the header has whole seconds
  clockSkewMs = Math.abs(skew) > 2000 ? skew : 0;
}

export function serverNow() {
  return Date.now() + clockSkewMs;
}

async function request(method, path, { params, destructive } = {}) {
  const url = new URL(path, API_BASE);
  for (const [k, v] of Object.entries(params || {})) {
    if (v !== "" && v !== null && v !== undefined) url.searchParams.set(k, v);
  }
  const headers = { Accept: "application/json" };
  if (destructive && apiKey.get()) headers["X-API-Key"] = apiKey.get();
  let resp;
  try {
    resp = await fetch(url, { method, headers, cache: "no-store", credentials: "omit" });
  } catch (err) {
    throw new ApiError(0, "NETWORK", `the API did not answer (${err.message})`);
  }
  noteServerDate(resp);
  let body = null;
  try {
    body = await resp.json();
  } catch {
    body = null;
  }
  if (!resp.ok && resp.status !== 409) {
    const e = (body && body.error) || {};
    throw new ApiError(resp.status, e.code || `HTTP_${resp.status}`, e.message || resp.statusText, e.details);
  }
  if (resp.status === 409) {
    const e = (body && body.error) || {};
    // TASK_RUNNING is the answer to a cancel of a running task: requested, not refused.
    if (e.code !== "TASK_RUNNING") {
      throw new ApiError(409, e.code || "HTTP_409", e.message || "conflict", e.details);
    }
    return { requested: true, message: e.message };
  }
  return body;
}

export const api = {
  config: () => fetch(new URL("config.json", location.href), { cache: "no-store" }).then((r) => r.json()),
  queues: () => request("GET", "queues"),
  workers: () => request("GET", "workers"),
  tasks: (params) => request("GET", "tasks", { params }),
  task: (id) => request("GET", `tasks/${encodeURIComponent(id)}`),
  history: (id) => request("GET", `tasks/${encodeURIComponent(id)}/history`),
  deadLetters: (limit = 100) => request("GET", "dlq", { params: { limit } }),
  deadLetter: (id) => request("GET", `dlq/${encodeURIComponent(id)}`),
  cancel: (id) => request("POST", `tasks/${encodeURIComponent(id)}/cancel`, { destructive: true }),
  pause: (queue) => request("POST", `queue/${encodeURIComponent(queue)}/pause`, { destructive: true }),
  resume: (queue) => request("POST", `queue/${encodeURIComponent(queue)}/resume`, { destructive: true }),
  requeue: (id) => request("POST", `dlq/${encodeURIComponent(id)}/requeue`, { destructive: true }),
  discard: (id) => request("POST", `dlq/${encodeURIComponent(id)}/discard`, { destructive: true }),
  purgeDlq: () => request("POST", "dlq/purge", { destructive: true }),
  schedules: (limit = 500) => request("GET", "schedules", { params: { limit } }),
  schedule: (name, next = 10) => request("GET", `schedules/${encodeURIComponent(name)}`, { params: { next } }),
  pauseSchedule: (name) => request("POST", `schedules/${encodeURIComponent(name)}/pause`, { destructive: true }),
  resumeSchedule: (name) => request("POST", `schedules/${encodeURIComponent(name)}/resume`, { destructive: true }),
  triggerSchedule: (name) => request("POST", `schedules/${encodeURIComponent(name)}/trigger`, { destructive: true }),
  limits: () => request("GET", "limits"),
  workflow: (id) => request("GET", `workflows/${encodeURIComponent(id)}`),
  cancelWorkflow: (id) => request("POST", `workflows/${encodeURIComponent(id)}/cancel`, { destructive: true }),
};

/** The WebSocket URL of the event stream (DTQ_WS_PATH), relative to the page like the API. */
export function eventsUrl(wsPath) {
  const url = new URL(".." + wsPath, location.href);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  return url.toString();
}
