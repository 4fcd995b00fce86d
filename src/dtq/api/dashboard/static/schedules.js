// Schedules: the list (spec, template, state, next and last firing, counters) with Pause /
// Resume and Trigger per row, and one schedule's page (its definition, next fire times and
// history of decisions). Both refresh on the schedule events of the live stream and poll.

import { api, serverNow } from "./api.js";
import { clock, fill, h, link, pretty, relative, setText, shortId, syncRows, taskHref } from "./dom.js";
import { act, coalesce, errorBanner } from "./ui.js";

const LIMIT = 500;
const NEXT_TIMES = 10;
// The schedule events refresh the views; the poll is only a safety net.
const POLL_MS = 30000;

/** Whether an event of the live stream is about a schedule (``name``: about that one). */
function aboutSchedule(event, name) {
  const meta = event.metadata || {};
  const kinds = ["SCHEDULE_FIRED", "SCHEDULE_SKIPPED", "CONFIGURATION_CHANGED"];
  if (!kinds.includes(event.type) || !meta.schedule) return false;
  return name === undefined || meta.schedule === name;
}

/** "0 7 * * * (Europe/Paris)" or "every 5 min". */
export function specText(d) {
  if (d.cron) return `${d.cron} (${d.tz})`;
  const s = Number(d.every);
  const units = [[86400, "d"], [3600, "h"], [60, "min"], [1, "s"]];
  const parts = [];
  let left = s;
  for (const [size, unit] of units) {
    if (left >= size) {
      parts.push(`${Math.floor(left / size)} ${unit}`);
      left %= size;
    }
  }
  return `every ${parts.join(" ") || `${s} s`}`;
}

function statePill(s) {
  const text = s.state === "paused" && s.paused_reason ? `paused: ${s.paused_reason}` : s.state;
  return h("span", { class: `pill st-${s.state}`, dataset: { state: s.state } }, text);
}

function when(iso) {
  if (!iso) return h("span", { class: "muted" }, "—");
  return h("span", { title: iso }, clock(iso), h("span", { class: "muted" }, ` · ${relative(iso, serverNow())}`));
}

/** Pause or resume, and trigger: the same confirmed actions in the list and on the page. */
function pauseAction(s, after) {
  const pausing = s.state !== "paused";
  return act({
    title: `${pausing ? "Pause" : "Resume"} schedule ${s.name}?`,
    body: h("p", {}, pausing
      ? "It fires nothing until it is resumed."
      : `It goes on from now; the ticks of the pause are decided by its catch-up policy (${s.definition.catchup}).`),
    confirmLabel: pausing ? "Pause schedule" : "Resume schedule",
    run: () => (pausing ? api.pauseSchedule(s.name) : api.resumeSchedule(s.name)),
    success: (r) => `Schedule ${r.name} ${r.state === "paused" ? "paused" : "resumed"}${r.changed ? "" : " (it already was)"}.`,
    after,
  });
}

function triggerAction(s, after) {
  return act({
    title: `Trigger schedule ${s.name} now?`,
    body: [h("p", {}, "One task of its template now: ", h("span", { class: "mono" }, s.definition.task_type),
      " on queue ", h("strong", {}, s.definition.queue), "."),
    h("p", {}, "Its next tick is not moved; a manual firing ignores the pause and the overlap policy.")],
    confirmLabel: "Trigger",
    run: () => api.triggerSchedule(s.name),
    success: (t) => `Schedule ${s.name} triggered: task ${shortId(t.task_id)}.`,
    after,
  });
}

function actionButtons(s, testSuffix, after) {
  const toggle = h("button", { type: "button", class: "btn btn-small", "data-testid": `schedule-toggle${testSuffix}` });
  const trigger = h("button", { type: "button", class: "btn btn-small", "data-testid": `schedule-trigger${testSuffix}` }, "Trigger");
  let current = s;
  toggle.addEventListener("click", () => pauseAction(current, after));
  trigger.addEventListener("click", () => triggerAction(current, after));
  return {
    node: h("div", { class: "row-actions" }, toggle, trigger),
    update(next) {
      current = next;
      setText(toggle, next.state === "paused" ? "Resume" : "Pause");
    },
  };
}

// -- the list --------------------------------------------------------------------------------

export function scheduleListView(root) {
  const body = h("tbody");
  const banner = h("div");
  const count = h("span", { class: "muted" });
  fill(root,
    h("section", { class: "panel" },
      h("div", { class: "panel-head" }, h("h2", {}, "Schedules"), count),
      banner,
      h("div", { class: "scroll" }, h("table", { class: "grid-table", "data-testid": "schedules" },
        h("thead", {}, h("tr", {},
          [["Schedule"], ["Spec"], ["Queue / type"], ["State"], ["Next fire"], ["Last fired"], ["Last task"],
            ["Fired", "num"], ["Skipped", "num"], ["Missed", "num"], [""]].map(([t, cls]) => h("th", { class: cls || null }, t)))),
        body))));

  let schedules = [];
  const refresh = coalesce(async () => {
    try {
      schedules = (await api.schedules(LIMIT)).schedules;
      fill(banner);
      syncRows(body, schedules, (s) => s.name, row,
        h("td", { colspan: 11, class: "empty" }, "No schedule yet: PUT /api/v1/schedules/{name}, dtq schedule add, or schedule= on a task."));
      setText(count, `${schedules.length} shown`);
    } catch (err) {
      fill(banner, errorBanner(err));
    }
  }, 500);

  function row(first) {
    let s = first;
    const c = {};
    const td = (col, cls) => (c[col] = h("td", { class: cls || null, "data-col": col }));
    const actions = actionButtons(s, `-${s.name}`, () => refresh.now());
    const tr = h("tr", { "data-schedule": s.name },
      h("td", {}, link(`#/schedule/${encodeURIComponent(s.name)}`, s.name)),
      td("spec", "mono"), td("target"), td("state"), td("next"), td("last"), td("task", "mono"),
      td("fired", "num"), td("skipped", "num"), td("missed", "num"),
      h("td", {}, actions.node));
    const render = () => {
      fill(c.next, s.state === "ended" ? h("span", { class: "muted" }, "ended") : when(s.next_fire_at));
      fill(c.last, when(s.last_fired_at));
    };
    return {
      row: tr,
      tick: render,
      update(next) {
        s = next;
        setText(c.spec, specText(s.definition));
        setText(c.target, `${s.definition.queue} / ${s.definition.task_type}`);
        const stateKey = `${s.state}/${s.paused_reason || ""}`;
        if (c.state.dataset.key !== stateKey) {
          fill(c.state, statePill(s));
          c.state.dataset.key = stateKey;
        }
        render();
        fill(c.task, s.last_task_id ? h("a", { href: taskHref(s.last_task_id), title: s.last_task_id }, shortId(s.last_task_id)) : "");
        setText(c.fired, s.fired);
        setText(c.skipped, s.skipped_overlap);
        setText(c.missed, s.missed);
        actions.update(s);
      },
    };
  }

  refresh.now();
  const poll = setInterval(refresh, POLL_MS);
  return {
    refresh: refresh.now,
    onEvent(event) {
      if (aboutSchedule(event)) refresh();
    },
    tick() {
      for (const entry of (body._rows || new Map()).values()) entry.tick();
    },
    destroy() {
      refresh.stop();
      clearInterval(poll);
    },
  };
}

// -- one schedule ----------------------------------------------------------------------------

const HISTORY_LABELS = {
  fired: "fired",
  triggered: "triggered by hand",
  skipped_overlap: "skipped: the previous task had not finished",
  buffered: "held back until the previous task finishes",
  missed: "missed",
  created: "created",
  updated: "updated",
  paused: "paused",
  resumed: "resumed",
};

export function scheduleView(root, shared, name) {
  const pill = h("span", { "data-testid": "schedule-state" });
  const actionsBox = h("div", { class: "actions" });
  const banner = h("div");
  const fields = h("tbody");
  const definition = h("pre", { class: "json", "data-testid": "schedule-definition" });
  const nextList = h("ol", { class: "next-times", "data-testid": "schedule-next" });
  const historyBody = h("tbody");
  fill(root,
    h("p", { class: "crumbs" }, link("#/schedules", "← schedules")),
    h("div", { class: "task-head" }, h("h1", { class: "task-title" }, "Schedule ", h("span", { class: "mono" }, name)), pill, actionsBox),
    banner,
    h("div", { class: "task-grid" },
      h("section", { class: "panel" }, h("h2", {}, "State"), h("table", { class: "fields", "data-testid": "schedule-fields" }, fields)),
      h("div", {},
        h("section", { class: "panel" }, h("h2", {}, `Next ${NEXT_TIMES} fire times`), nextList),
        h("section", { class: "panel" }, h("h2", {}, "Definition"), definition))),
    h("section", { class: "panel" }, h("h2", {}, "History (newest first)"),
      h("div", { class: "scroll" }, h("table", { class: "grid-table", "data-testid": "schedule-history" },
        h("thead", {}, h("tr", {}, ["When", "Decision", "Tick", "Task", "Details"].map((t) => h("th", {}, t)))),
        historyBody))));

  let s = null;
  let alive = true;
  let actions = null;
  const refresh = coalesce(async () => {
    try {
      const got = await api.schedule(name, NEXT_TIMES);
      if (!alive) return;
      s = got;
      fill(banner);
      render();
    } catch (err) {
      fill(banner, errorBanner(err));
    }
  }, 300);

  function render() {
    fill(pill, statePill(s));
    if (!actions) {
      actions = actionButtons(s, "", () => refresh.now());
      fill(actionsBox, actions.node);
    }
    actions.update(s);
    const rows = [
      ["spec", specText(s.definition)],
      ["queue / task type", `${s.definition.queue} / ${s.definition.task_type}`],
      ["origin", s.origin],
      ["policies", `overlap ${s.definition.overlap} · catch-up ${s.definition.catchup} · grace ${s.definition.grace_s} s`],
      ["next fire", s.state === "ended" ? "ended" : when(s.next_fire_at)],
      ["last tick", when(s.last_tick_at)],
      ["last fired", when(s.last_fired_at)],
      ["last task", s.last_task_id ? h("a", { href: taskHref(s.last_task_id) }, s.last_task_id) : "—"],
      ["held back for", s.buffered_for ? when(s.buffered_for) : "—"],
      ["fired / skipped / missed", `${s.fired} / ${s.skipped_overlap} / ${s.missed}`],
      ["last error", s.last_error || "—"],
      ["created", when(s.created_at)],
      ["updated", when(s.updated_at)],
    ];
    fill(fields, rows.map(([k, v]) => h("tr", { "data-field": k }, h("th", {}, k), h("td", {}, v))));
    definition.textContent = pretty(s.definition);
    renderNext();
    fill(historyBody, s.history.length
      ? s.history.map(historyRow)
      : h("tr", {}, h("td", { colspan: 5, class: "empty" }, "No decision yet.")));
  }

  function renderNext() {
    fill(nextList, s.next_fire_times.length
      ? s.next_fire_times.map((t) => h("li", {}, clock(t), h("span", { class: "muted" }, ` · ${relative(t, serverNow())}`)))
      : h("li", { class: "muted" }, "No tick left."));
  }

  function historyRow(e) {
    const extra = Object.fromEntries(Object.entries(e).filter(([k]) => !["ts", "decision", "tick", "task_id"].includes(k)));
    return h("tr", { "data-decision": e.decision },
      h("td", {}, clock(e.ts)),
      h("td", {}, h("span", { class: `pill dc-${e.decision}` }, HISTORY_LABELS[e.decision] || e.decision)),
      h("td", {}, e.tick ? clock(e.tick) : ""),
      h("td", { class: "mono" }, e.task_id ? h("a", { href: taskHref(e.task_id), title: e.task_id }, shortId(e.task_id)) : ""),
      h("td", { class: "mono muted" }, Object.keys(extra).length ? JSON.stringify(extra) : ""));
  }

  refresh.now();
  const poll = setInterval(refresh, POLL_MS);
  return {
    refresh: refresh.now,
    onEvent(event) {
      if (aboutSchedule(event, name)) refresh();
    },
    tick() {
      if (s) renderNext();
    },
    destroy() {
      alive = false;
      refresh.stop();
      clearInterval(poll);
    },
  };
}
