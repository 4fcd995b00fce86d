// Overview: per-queue counts, throughput from the event stream, live workers. Rows and cards
// are made once and updated in place, so nothing moves under the pointer while numbers change.

import { api } from "./api.js";
import { sparkline, throughputChart } from "./chart.js";
import { duration, fill, h, link, setText, syncRows } from "./dom.js";
import { act, coalesce, errorBanner } from "./ui.js";

const DLQ_SAMPLE = 500; // dead letters read to split the (global) DLQ count by queue

function card(label, testid, extraNode) {
  const value = h("div", { class: "card-value" });
  const extra = extraNode || h("span");
  const node = h("div", { class: "card", "data-testid": testid },
    h("div", { class: "card-label" }, label), value, h("div", { class: "card-extra" }, extra));
  return {
    node,
    set(v, more) {
      setText(value, v);
      if (!extraNode) setText(extra, more || "");
    },
  };
}

function headRow(...cols) {
  return h("thead", {}, h("tr", {}, cols.map(([text, cls]) => h("th", { class: cls || null }, text))));
}

export function overviewView(root, shared) {
  const queueBody = h("tbody");
  const workerBody = h("tbody");
  const chartBox = h("div", { class: "chart-box" });
  const banner = h("div");
  const totals = {
    queues: card("Queues", "card-queues"),
    waiting: card("Waiting", "card-waiting"),
    inFlight: card("In flight", "card-in-flight"),
    retry: card("Retry scheduled", "card-retry"),
    dlq: card("Dead letters", "card-dlq", link("#/dlq", "open the DLQ")),
    workers: card("Workers alive", "card-workers"),
    rate: card("Throughput", "card-throughput"),
  };
  fill(root,
    banner,
    h("section", { class: "cards", "aria-label": "Totals" }, Object.values(totals).map((c) => c.node)),
    h("section", { class: "panel" },
      h("h2", {}, "Queues"),
      h("div", { class: "scroll" }, h("table", { class: "grid-table", "data-testid": "queues" },
        headRow(["Queue"], ["Depth", "num"], ["Waiting", "num"], ["In flight", "num"],
          ["Retry scheduled", "num"], ["DLQ", "num"], ["State"], ["Workers", "num"],
          ["Finished, 5 min"], [""]),
        queueBody))),
    h("section", { class: "panel" },
      h("h2", {}, "Throughput"),
      h("p", { class: "legend" },
        h("span", { class: "swatch swatch-ok" }), "succeeded",
        h("span", { class: "swatch swatch-failed" }), "failed attempts",
        h("span", { class: "muted" }, " · tasks per second in 5-second steps, from the live event stream since this page opened")),
      chartBox),
    h("section", { class: "panel" },
      h("h2", {}, "Workers"),
      h("div", { class: "scroll" }, h("table", { class: "grid-table", "data-testid": "workers" },
        headRow(["Worker"], ["Status"], ["Queues"], ["In flight", "num"], ["Processed", "num"],
          ["Failed", "num"], ["Last heartbeat", "num"], ["Host"]),
        workerBody))));

  let queues = [];
  let workers = [];
  let workersAt = Date.now();
  let dlqByQueue = new Map();
  let dlqCounted = { total: -1, at: 0, partial: false };

  async function countDeadLetters(total) {
    if (total === dlqCounted.total && Date.now() - dlqCounted.at < 30000) return;
    const counts = new Map();
    if (total > 0) {
      const { dead_letters: list } = await api.deadLetters(DLQ_SAMPLE);
      for (const d of list) counts.set(d.original_queue, (counts.get(d.original_queue) || 0) + 1);
    }
    dlqByQueue = counts;
    dlqCounted = { total, at: Date.now(), partial: total > DLQ_SAMPLE };
  }

  const refresh = coalesce(async () => {
    try {
      const [q, w] = await Promise.all([api.queues(), api.workers()]);
      queues = q.queues;
      workers = w.workers;
      workersAt = Date.now();
      shared.queueNames = queues.map((x) => x.queue);
      await countDeadLetters(queues.length ? queues[0].dlq_depth : 0);
      fill(banner);
      render();
    } catch (err) {
      fill(banner, errorBanner(err));
    }
  }, 1000);

  function dlqCell(queue) {
    const n = dlqByQueue.get(queue) || 0;
    return dlqCounted.partial ? `≥ ${n}` : String(n);
  }

  function drawSpark(cell, queue) {
    const t = shared.throughput;
    fill(cell, sparkline(t.series(queue)), h("span", { class: "rate" }, `${t.rate(queue).toFixed(1)}/s`));
  }

  function queueRow(first) {
    let q = first;
    const cells = {};
    const td = (col, cls = "num") => (cells[col] = h("td", { class: cls, "data-col": col }));
    const spark = h("td", { class: "spark-cell" });
    const state = h("span", { class: "pill" });
    const toggle = h("button", { type: "button", class: "btn btn-small", "data-testid": `toggle-${q.queue}` });
    toggle.addEventListener("click", () => act({
      title: `${q.paused ? "Resume" : "Pause"} queue ${q.queue}?`,
      body: h("p", {}, q.paused
        ? "Workers start taking tasks from this queue again."
        : "Workers stop taking new tasks from this queue; running tasks finish."),
      confirmLabel: q.paused ? "Resume queue" : "Pause queue",
      run: () => (q.paused ? api.resume(q.queue) : api.pause(q.queue)),
      success: (r) => `Queue ${r.queue} ${r.paused ? "paused" : "resumed"}${r.changed ? "" : " (it already was)"}.`,
      after: refresh.now,
    }));
    const row = h("tr", { "data-queue": q.queue },
      h("td", {}, link(`#/tasks?queue=${encodeURIComponent(q.queue)}`, q.queue)),
      td("depth"), td("waiting"), td("in-flight"), td("retry"), td("dlq"),
      h("td", { "data-col": "state" }, state), td("workers"), spark, h("td", {}, toggle));
    return {
      row,
      tick: () => drawSpark(spark, q.queue),
      update(next) {
        q = next;
        setText(cells.depth, q.depth);
        setText(cells.waiting, q.waiting);
        setText(cells["in-flight"], q.pending);
        setText(cells.retry, q.retry_scheduled);
        setText(cells.dlq, dlqCell(q.queue));
        setText(cells.workers, q.workers_active);
        setText(state, q.paused ? "paused" : "active");
        state.setAttribute("class", `pill ${q.paused ? "st-paused" : "st-active"}`);
        setText(toggle, q.paused ? "Resume" : "Pause");
        drawSpark(spark, q.queue);
      },
    };
  }

  function heartbeatAge(w) {
    if (w.heartbeat_age_s === null || w.heartbeat_age_s === undefined) return "";
    return `${duration(w.heartbeat_age_s * 1000 + (Date.now() - workersAt))} ago`;
  }

  function workerRow(first) {
    let w = first;
    const c = {};
    const td = (col, cls = "num") => (c[col] = h("td", { class: cls, "data-col": col }));
    const status = h("span", { class: "pill" });
    const row = h("tr", { "data-worker": w.worker_id },
      h("td", { class: "mono" }, w.worker_id),
      h("td", { "data-col": "status" }, status),
      td("queues", ""), td("in-flight"), td("processed"), td("failed"), td("heartbeat"), td("host", "muted"));
    return {
      row,
      tick: () => setText(c.heartbeat, heartbeatAge(w)),
      update(next) {
        w = next;
        const st = w.stale ? "stale" : w.status || "unknown";
        setText(status, st);
        status.setAttribute("class", `pill wk-${st}`);
        setText(c.queues, (w.queues || []).join(", "));
        setText(c["in-flight"], `${w.active_tasks} / ${w.concurrency}`);
        setText(c.processed, w.tasks_processed);
        setText(c.failed, w.tasks_failed);
        setText(c.heartbeat, heartbeatAge(w));
        setText(c.host, `${w.hostname}${w.pid ? ` (pid ${w.pid})` : ""}`);
      },
    };
  }

  function renderCards() {
    const sum = (k) => queues.reduce((n, q) => n + q[k], 0);
    const alive = workers.filter((w) => w.alive && !w.stale).length;
    const t = shared.throughput;
    const minute = t.lastMinute();
    totals.queues.set(queues.length);
    totals.waiting.set(sum("waiting"));
    totals.inFlight.set(sum("pending"));
    totals.retry.set(sum("retry_scheduled"));
    totals.dlq.set(queues.length ? queues[0].dlq_depth : 0);
    totals.workers.set(alive, workers.length > alive ? `${workers.length - alive} stale` : "");
    totals.rate.set(`${t.rate().toFixed(1)}/s`, `last minute: ${minute.ok} ok, ${minute.failed} failed`);
  }

  function render() {
    renderCards();
    syncRows(queueBody, queues, (q) => q.queue, queueRow,
      h("td", { colspan: 10, class: "empty" }, "No queue yet: submit a task and its queue appears here."));
    fill(chartBox, throughputChart(shared.throughput.series()));
    syncRows(workerBody, workers, (w) => w.worker_id, workerRow,
      h("td", { colspan: 8, class: "empty" }, "No live worker. Start one with: dtq worker run"));
  }

  render();
  refresh.now();
  const poll = setInterval(refresh, 5000);

  return {
    refresh: refresh.now,
    onEvent(event) {
      if (event.type !== "TASK_PROGRESS") refresh(); // progress changes no count shown here
    },
    tick() {
      renderCards();
      fill(chartBox, throughputChart(shared.throughput.series()));
      for (const body of [queueBody, workerBody]) {
        for (const entry of (body._rows || new Map()).values()) entry.tick();
      }
    },
    destroy() {
      refresh.stop();
      clearInterval(poll);
    },
  };
}
