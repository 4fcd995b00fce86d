// dtq dashboard: hash routing between the views, the one live event stream, and the timers.
// No framework, no build step; every value from the API is rendered as text (dom.js).

import { api, eventsUrl } from "./api.js";
import { Throughput } from "./chart.js";
import { deadLettersView } from "./dlq.js";
import { fill, h } from "./dom.js";
import { limitListView } from "./limits.js";
import { LiveEvents } from "./live.js";
import { overviewView } from "./overview.js";
import { scheduleListView, scheduleView } from "./schedules.js";
import { taskListView, taskView } from "./tasks.js";
import { installKeyButton, settings, updateKeyButton } from "./ui.js";
import { workflowView } from "./workflows.js";

const shared = {
  throughput: new Throughput(),
  queueNames: [],
};

let current = null; // {onEvent, refresh, tick, destroy} of the view on screen

function route() {
  const raw = location.hash.replace(/^#/, "") || "/";
  const [path, query] = raw.split("?", 2);
  const params = new URLSearchParams(query || "");
  let parts;
  try {
    parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  } catch {
    return { name: "overview" }; // a malformed address
  }
  if (parts[0] === "tasks") return { name: "tasks", params };
  if (parts[0] === "task" && parts[1]) return { name: "task", id: parts[1] };
  if (parts[0] === "dlq") return { name: "dlq" };
  if (parts[0] === "schedules") return { name: "schedules" };
  if (parts[0] === "limits") return { name: "limits" };
  if (parts[0] === "schedule" && parts[1]) return { name: "schedule", id: parts[1] };
  if (parts[0] === "workflow" && parts[1]) return { name: "workflow", id: parts[1] };
  return { name: "overview" };
}

function show() {
  if (current && current.destroy) current.destroy();
  const where = route();
  const root = document.getElementById("view");
  fill(root);
  for (const a of document.querySelectorAll(".nav a")) {
    const active = a.dataset.view === where.name || (where.name === "task" && a.dataset.view === "tasks")
      || (where.name === "schedule" && a.dataset.view === "schedules");
    a.classList.toggle("active", active);
    if (active) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  if (where.name === "tasks") current = taskListView(root, shared, where.params);
  else if (where.name === "task") current = taskView(root, shared, where.id);
  else if (where.name === "dlq") current = deadLettersView(root, shared);
  else if (where.name === "schedules") current = scheduleListView(root, shared);
  else if (where.name === "schedule") current = scheduleView(root, shared, where.id);
  else if (where.name === "limits") current = limitListView(root, shared);
  else if (where.name === "workflow") current = workflowView(root, shared, where.id);
  else current = overviewView(root, shared);
  const titles = {
    task: () => "task " + where.id.slice(0, 8),
    schedule: () => "schedule " + where.id,
    workflow: () => "workflow " + where.id.slice(0, 8),
  };
  document.title = `dtq · ${titles[where.name] ? titles[where.name]() : where.name}`;
}

function setLive(state, text) {
  const el = document.getElementById("live");
  el.className = `live live-${state}`;
  el.dataset.state = state;
  el.textContent = text;
}

async function main() {
  let config;
  try {
    config = await api.config();
  } catch (err) {
    fill(document.getElementById("view"), h("p", { class: "error-banner" }, `Cannot load the dashboard configuration: ${err.message}`));
    return;
  }
  settings.authRequired = Boolean(config.auth_required);
  installKeyButton();
  updateKeyButton();
  window.addEventListener("hashchange", show);
  show();
  const live = new LiveEvents(eventsUrl(config.ws_path), {
    onEvent(event) {
      shared.throughput.record(event);
      if (current && current.onEvent) current.onEvent(event);
    },
    onState: setLive,
    onOpen(again) {
      // Events published while disconnected were missed: read the state again.
      if (again && current && current.refresh) current.refresh();
    },
  });
  live.start();
  setInterval(() => {
    if (current && current.tick) current.tick();
  }, 1000);
  document.addEventListener("visibilitychange", () => {
    if (document.visibilityState === "visible" && current && current.refresh) current.refresh();
  });
}

main();
