// Tasks: the recent-tasks list with filters, and one task's page (every field, its progress,
// result or error, history as a timeline with its deadline), both kept live by the event
// stream (a TASK_PROGRESS event updates the progress on screen without a read).

import { api, serverNow } from "./api.js";
import { clock, duration, fill, h, link, pretty, relative, setText, shortId, statusPill, syncRows, taskHref } from "./dom.js";
import { act, coalesce, errorBanner } from "./ui.js";

export const STATUSES = ["pending", "queued", "running", "succeeded", "retrying", "failed", "dead_lettered", "cancelled", "expired"];
const TERMINAL = new Set(["succeeded", "failed", "dead_lettered", "cancelled", "expired"]);
const LIMITS = ["50", "100", "200", "500"];

function select(name, label, options, value) {
  const el = h("select", { name, "aria-label": label, "data-testid": `filter-${name}` },
    options.map(([v, text]) => h("option", { value: v }, text)));
  el.value = value;
  return el;
}

// -- the list --------------------------------------------------------------------------------

export function taskListView(root, shared, params) {
  const filters = {
    queue: params.get("queue") || "",
    status: params.get("status") || "",
    task_type: params.get("task_type") || "",
    limit: params.get("limit") || "50",
  };
  const queueSelect = select("queue", "Queue", [["", "any queue"]], "");
  const statusSelect = select("status", "Status", [["", "any status"], ...STATUSES.map((st) => [st, st.replace("_", " ")])], filters.status);
  const typeInput = h("input", { type: "search", name: "task_type", placeholder: "task type", "aria-label": "Task type", "data-testid": "filter-type", spellcheck: "false" });
  typeInput.value = filters.task_type;
  const limitSelect = select("limit", "How many", LIMITS.map((n) => [n, `${n} newest`]), LIMITS.includes(filters.limit) ? filters.limit : "50");
  const body = h("tbody");
  const banner = h("div");
  const count = h("span", { class: "muted" });
  fill(root,
    h("section", { class: "panel" },
      h("div", { class: "panel-head" }, h("h2", {}, "Recent tasks"), count),
      h("div", { class: "filters" }, queueSelect, statusSelect, typeInput, limitSelect),
      banner,
      h("div", { class: "scroll" }, h("table", { class: "grid-table", "data-testid": "tasks" },
        h("thead", {}, h("tr", {},
          ["Task", "Type", "Queue", "Status", "Attempt", "Priority", "Created", "Finished", "Deadline"].map((t) => h("th", {}, t)))),
        body))));

  function setQueueOptions(names) {
    const all = [...new Set([...names, filters.queue].filter(Boolean))].sort();
    const current = [...queueSelect.options].slice(1).map((o) => o.value);
    if (all.join("\n") !== current.join("\n")) {
      fill(queueSelect, h("option", { value: "" }, "any queue"), all.map((n) => h("option", { value: n }, n)));
    }
    queueSelect.value = filters.queue;
  }
  setQueueOptions(shared.queueNames);

  let tasks = [];
  const refresh = coalesce(async () => {
    try {
      const [list, q] = await Promise.all([api.tasks(filters), api.queues()]);
      tasks = list.tasks;
      shared.queueNames = q.queues.map((x) => x.queue);
      setQueueOptions(shared.queueNames);
      fill(banner);
      render();
    } catch (err) {
      fill(banner, errorBanner(err));
    }
  }, 1000);

  function row(first) {
    let t = first;
    const c = {};
    const td = (col, cls) => (c[col] = h("td", { class: cls || null, "data-col": col }));
    const tr = h("tr", { "data-task": t.task_id },
      h("td", { class: "mono" }, h("a", { href: taskHref(t.task_id), title: t.task_id }, shortId(t.task_id))),
      td("type"), td("queue"), td("status"), td("attempt", "num"), td("priority", "num"), td("created"), td("finished"), td("deadline"));
    return {
      row: tr,
      tick: () => setText(c.deadline, deadlineShort(t)),
      update(next) {
        t = next;
        setText(c.type, t.task_type);
        setText(c.queue, t.queue);
        if (c.status.dataset.status !== t.status) {
          fill(c.status, statusPill(t.status));
          c.status.dataset.status = t.status;
        }
        setText(c.attempt, `${t.attempt} / ${t.max_attempts}`);
        setText(c.priority, t.priority);
        setText(c.created, clock(t.created_at));
        setText(c.finished, clock(t.finished_at));
        setText(c.deadline, deadlineShort(t));
      },
    };
  }

  function render() {
    syncRows(body, tasks, (t) => t.task_id, row,
      h("td", { colspan: 9, class: "empty" }, "No task matches these filters."));
    setText(count, `${tasks.length} shown`);
  }

  function apply() {
    filters.queue = queueSelect.value;
    filters.status = statusSelect.value;
    filters.task_type = typeInput.value.trim();
    filters.limit = limitSelect.value;
    const query = new URLSearchParams(Object.entries(filters).filter(([k, v]) => v && !(k === "limit" && v === "50")));
    const hash = `#/tasks${query.toString() ? "?" + query : ""}`;
    history.replaceState(null, "", hash); // the filters stay in the address, no re-render
    refresh.now();
  }
  for (const el of [queueSelect, statusSelect, limitSelect]) el.addEventListener("change", apply);
  let typing = null;
  typeInput.addEventListener("input", () => {
    clearTimeout(typing);
    typing = setTimeout(apply, 300);
  });

  refresh.now();
  const poll = setInterval(refresh, 10000);
  return {
    refresh: refresh.now,
    onEvent(event) {
      if (event.task_id && event.type !== "TASK_PROGRESS") refresh(); // no column shows progress
    },
    tick() {
      for (const entry of (body._rows || new Map()).values()) entry.tick();
    },
    destroy() {
      refresh.stop();
      clearInterval(poll);
      clearTimeout(typing);
    },
  };
}

// -- deadlines -------------------------------------------------------------------------------

/** The task's deadline in words: "in 4 min 3 s", "expired at ...", "met", or "". */
export function deadline(task, now = serverNow()) {
  if (task.status === "expired") {
    const at = task.expired_at || task.finished_at || task.updated_at;
    return { state: "expired", text: `expired at ${clock(at)}`, at };
  }
  if (!task.expires_at) return { state: "none", text: "no deadline", at: null };
  const left = Date.parse(task.expires_at) - now;
  if (TERMINAL.has(task.status)) {
    return { state: "met", text: `finished before its deadline (${clock(task.expires_at)})`, at: task.expires_at };
  }
  if (task.status === "running") {
    return { state: "met", text: `started before its deadline (${clock(task.expires_at)}); runs to the end`, at: task.expires_at };
  }
  if (left >= 0) return { state: "future", text: `expires in ${duration(left)} (at ${clock(task.expires_at)})`, at: task.expires_at };
  return { state: "due", text: `deadline passed ${duration(-left)} ago; expired at the next sweep`, at: task.expires_at };
}

function deadlineShort(task) {
  const d = deadline(task);
  if (d.state === "future") return `in ${duration(Date.parse(task.expires_at) - serverNow())}`;
  if (d.state === "expired") return "expired";
  if (d.state === "due") return "due";
  if (d.state === "met") return "in time";
  return "";
}

// -- one task --------------------------------------------------------------------------------

const OWN_SECTIONS = new Set(["payload", "result", "metadata", "progress"]);

/** The progress panel's content: a bar when the handler gave a fraction, its data, when. */
function progressContent(progress, now) {
  const parts = [];
  if (progress.fraction !== null && progress.fraction !== undefined) {
    const percent = Math.floor(progress.fraction * 100 + 1e-9);
    parts.push(h("div", { class: "progress-line" },
      h("progress", { max: "1", value: String(progress.fraction), "aria-label": "Progress", "data-testid": "task-progress-bar" }),
      h("span", { class: "num", "data-testid": "task-progress-percent" }, `${percent}%`)));
  }
  if (progress.data !== null && progress.data !== undefined) {
    parts.push(h("pre", { class: "json", "data-testid": "task-progress-data" }, pretty(progress.data)));
  }
  parts.push(h("p", { class: "muted", "data-testid": "task-progress-updated" }, `updated ${relative(progress.updated_at, now)}`));
  return parts;
}

export function taskView(root, shared, id) {
  const title = h("h1", { class: "task-title" }, "Task ", h("span", { class: "mono" }, id));
  const pill = h("span", { "data-testid": "task-status" });
  const actions = h("div", { class: "actions" });
  const banner = h("div");
  const fields = h("tbody");
  const expiry = h("p", { class: "expiry", "data-testid": "task-deadline" });
  const errorBox = h("div");
  const payload = h("pre", { class: "json", "data-testid": "task-payload" });
  const result = h("pre", { class: "json", "data-testid": "task-result" });
  const metadata = h("pre", { class: "json", "data-testid": "task-metadata" });
  const progressBox = h("div");
  const dlqBox = h("div");
  const timeline = h("ol", { class: "timeline", "data-testid": "task-history" });
  const wfCrumb = h("span");
  fill(root,
    h("p", { class: "crumbs" }, link("#/tasks", "← recent tasks"), wfCrumb),
    h("div", { class: "task-head" }, title, pill, actions),
    banner,
    h("div", { class: "task-grid" },
      h("section", { class: "panel" }, h("h2", {}, "Fields"), expiry,
        h("table", { class: "fields", "data-testid": "task-fields" }, fields)),
      h("div", {},
        errorBox,
        progressBox,
        h("section", { class: "panel" }, h("h2", {}, "Payload"), payload),
        h("section", { class: "panel" }, h("h2", {}, "Result"), result),
        h("section", { class: "panel" }, h("h2", {}, "Metadata"), metadata),
        dlqBox)),
    h("section", { class: "panel" }, h("h2", {}, "History"), timeline));

  let task = null;
  let history = [];
  let dead = null;
  let alive = true;

  const refresh = coalesce(async () => {
    try {
      const [t, hist] = await Promise.all([api.task(id), api.history(id).catch(() => ({ history: [] }))]);
      dead = null;
      if (t.status === "dead_lettered") dead = await api.deadLetter(id).catch(() => null);
      if (!alive) return;
      task = t;
      history = hist.history;
      fill(banner);
      render();
    } catch (err) {
      fill(banner, errorBanner(err));
    }
  }, 150);

  function render() {
    fill(pill, statusPill(task.status));
    // A workflow node's task has the idempotency key dtq-wf:<workflow id>:<node> (docs/workflows.md).
    const wfKey = /^dtq-wf:([0-9a-f]{32}):(.+)$/.exec(task.idempotency_key || "");
    fill(wfCrumb, wfKey ? [" · ", link("#/workflow/" + wfKey[1], `workflow ${shortId(wfKey[1])}, node ${wfKey[2]}`)] : null);
    renderActions();
    fill(fields, Object.entries(task).filter(([k]) => !OWN_SECTIONS.has(k)).map(([k, v]) =>
      h("tr", { "data-field": k }, h("th", {}, k), h("td", { class: v === null ? "muted" : "mono" }, fieldText(k, v)))));
    renderDeadline();
    payload.textContent = pretty(task.payload);
    if (task.result === null && !TERMINAL.has(task.status)) result.textContent = "(no result yet)";
    else result.textContent = pretty(task.result) + (task.result_truncated ? "\n(truncated: the result was larger than the limit)" : "");
    metadata.textContent = pretty(task.metadata);
    renderProgress();
    renderError();
    renderDeadLetter();
    renderTimeline();
  }

  function fieldText(key, value) {
    if (value === null || value === undefined) return "null";
    if (typeof value === "object") return JSON.stringify(value);
    if (typeof value === "string" && /_at$/.test(key)) {
      return [value, h("div", { class: "when" }, `${clock(value)} local · ${relative(value, serverNow())}`)];
    }
    return String(value);
  }

  function renderDeadline() {
    const d = deadline(task);
    expiry.className = `expiry expiry-${d.state}`;
    setText(expiry, `Deadline: ${d.text}`);
  }

  function renderProgress() {
    if (!task.progress) {
      fill(progressBox);
      return;
    }
    fill(progressBox, h("section", { class: "panel", "data-testid": "task-progress" },
      h("h2", {}, "Progress"), progressContent(task.progress, serverNow())));
  }

  function renderError() {
    if (!task.error_class && !task.error_message) {
      fill(errorBox);
      return;
    }
    fill(errorBox, h("section", { class: "panel panel-error", "data-testid": "task-error" },
      h("h2", {}, "Error"),
      h("p", {}, h("strong", { class: "mono" }, task.error_class || "error"),
        task.retryable === null ? null : h("span", { class: "muted" }, task.retryable ? " · retryable" : " · not retryable"),
        task.retry_delay_ms ? h("span", { class: "muted" }, ` · retry delay ${task.retry_delay_ms} ms`) : null),
      h("pre", { class: "error-text", "data-testid": "task-error-message" }, task.error_message || "")));
  }

  function renderDeadLetter() {
    if (!dead) {
      fill(dlqBox);
      return;
    }
    fill(dlqBox, h("section", { class: "panel" }, h("h2", {}, "Dead letter"),
      h("table", { class: "fields" }, h("tbody", {},
        ["entry_id", "original_queue", "failed_at", "attempts_made", "last_error_class", "last_error", "worker_id"].map((k) =>
          h("tr", {}, h("th", {}, k), h("td", { class: "mono" }, fieldText(k, dead[k]))))))));
  }

  let actionsKey = "";

  function renderActions() {
    const key = `${task.status}/${dead ? dead.entry_id : ""}`;
    if (key === actionsKey) return;
    actionsKey = key;
    const buttons = [];
    if (!TERMINAL.has(task.status)) {
      const running = task.status === "running";
      buttons.push(button(running ? "Cancel (stop it)" : "Cancel", "action-cancel", () => act({
        title: `Cancel task ${shortId(id)}?`,
        body: [h("p", {}, h("span", { class: "mono" }, task.task_type), " on queue ", h("strong", {}, task.queue), ` (${task.status}).`),
          h("p", {}, running ? "It is running: the worker is asked to stop it within about a second." : "It will never run.")],
        confirmLabel: "Cancel task",
        run: () => api.cancel(id),
        success: (r) => (r.requested ? "Cancellation requested: the worker stops the task." : `Task cancelled (was ${r.previous_status}).`),
        after: refresh.now,
      })));
    }
    if (dead) {
      buttons.push(button("Requeue", "action-requeue", () => act({
        title: `Requeue task ${shortId(id)}?`,
        body: h("p", {}, "A new life: queued again with attempt 0; earlier attempts are kept in metadata.previous_attempts."),
        confirmLabel: "Requeue",
        run: () => api.requeue(id),
        success: () => "Task requeued.",
        after: refresh.now,
      })));
      buttons.push(button("Discard", "action-discard", () => act({
        title: `Discard dead letter ${shortId(id)}?`,
        body: h("p", {}, "The entry leaves the dead-letter queue; the task stays dead-lettered (marked discarded)."),
        confirmLabel: "Discard",
        run: () => api.discard(id),
        success: () => "Dead letter discarded.",
        after: refresh.now,
      })));
    }
    fill(actions, buttons);
  }

  function renderTimeline() {
    const items = history.map((e) => ({ at: Date.parse(e.ts), node: historyItem(e) }));
    const d = deadline(task);
    if (d.at) items.push({ at: Date.parse(d.at), node: deadlineItem(d) });
    items.sort((a, b) => a.at - b.at);
    fill(timeline, items.length ? items.map((i) => i.node) : h("li", { class: "muted" }, "No history (it expires with the task)."));
  }

  function historyItem(e) {
    const details = e.details && Object.keys(e.details).length ? JSON.stringify(e.details) : null;
    return h("li", { class: `tl-item tl-${e.to}` },
      h("div", { class: "tl-time" }, clock(e.ts)),
      h("div", { class: "tl-body" },
        h("div", {}, e.from ? statusPill(e.from) : h("span", { class: "muted" }, "new"), " → ", statusPill(e.to),
          h("span", { class: "muted" }, ` attempt ${e.attempt}`),
          e.worker_id ? h("span", { class: "muted" }, " · ", h("span", { class: "mono" }, e.worker_id)) : null),
        e.reason ? h("div", { class: "tl-reason" }, e.reason) : null,
        details ? h("div", { class: "tl-details mono" }, details) : null));
  }

  function deadlineItem(d) {
    return h("li", { class: `tl-item tl-deadline tl-deadline-${d.state}`, "data-testid": "timeline-deadline" },
      h("div", { class: "tl-time" }, clock(d.at)),
      h("div", { class: "tl-body" }, h("div", {}, h("strong", {}, "Deadline"), " · ", d.text)));
  }

  function button(text, testid, onclick) {
    return h("button", { type: "button", class: "btn btn-danger", "data-testid": testid, onclick }, text);
  }

  refresh.now();
  return {
    refresh: refresh.now,
    onEvent(event) {
      if (event.task_id !== id) return;
      if (event.type !== "TASK_PROGRESS") {
        refresh();
        return;
      }
      // The event carries the whole progress: shown at once, nothing read. One of an attempt
      // older than the one on screen is late and not shown (a retry starts without progress).
      if (!task || event.attempt < task.attempt) return;
      const meta = event.metadata || {};
      task.progress = { fraction: meta.fraction ?? null, data: meta.data ?? null, updated_at: event.ts };
      renderProgress();
    },
    tick() {
      if (!task) return;
      renderDeadline();
      if (task.progress) renderProgress(); // its "updated ... ago"
      const item = timeline.querySelector('[data-testid="timeline-deadline"]');
      const d = deadline(task);
      if (item && d.at) item.replaceWith(deadlineItem(d));
    },
    destroy() {
      alive = false;
      refresh.stop();
    },
  };
}
