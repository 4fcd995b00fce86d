// Limits: each declared limit (docs/limits.md) with its definition and its use now (tasks
// holding a place, tasks parked for one; a keyed limit's summed over its key values), read
// from GET /api/v1/limits every two seconds while the view is on screen.

import { api } from "./api.js";
import { fill, h, setText, syncRows } from "./dom.js";
import { coalesce, errorBanner } from "./ui.js";

const POLL_MS = 2000;

/** "100/s, burst 20", or "—" for a limit without a rate. */
export function rateText(d) {
  if (!d.rate) return "—";
  return d.burst ? `${d.rate}, burst ${d.burst}` : d.rate;
}

export function limitListView(root) {
  const body = h("tbody");
  const banner = h("div");
  const count = h("span", { class: "muted" });
  fill(root,
    h("section", { class: "panel" },
      h("div", { class: "panel-head" }, h("h2", {}, "Limits"), count),
      banner,
      h("div", { class: "scroll" }, h("table", { class: "grid-table", "data-testid": "limits" },
        h("thead", {}, h("tr", {},
          [["Limit"], ["Queue / type"], ["Key"], ["Rate"], ["Concurrency", "num"], ["Source"],
            ["Running", "num"], ["Waiting", "num"], ["Key values", "num"]].map(([t, cls]) => h("th", { class: cls || null }, t)))),
        body))));

  const refresh = coalesce(async () => {
    try {
      const limits = (await api.limits()).limits;
      fill(banner);
      syncRows(body, limits, (l) => l.name, row,
        h("td", { colspan: 9, class: "empty" }, "No limit yet: PUT /api/v1/limits/{name}, dtq limit set, or rate_limit= / concurrency= on a task."));
      setText(count, `${limits.length} defined`);
    } catch (err) {
      fill(banner, errorBanner(err));
    }
  }, 500);

  refresh.now();
  const poll = setInterval(refresh, POLL_MS);
  return {
    refresh: refresh.now,
    destroy() {
      refresh.stop();
      clearInterval(poll);
    },
  };
}

function row(first) {
  const c = {};
  const td = (col, cls) => (c[col] = h("td", { class: cls || null, "data-col": col }));
  const tr = h("tr", { "data-limit": first.name },
    h("td", { class: "mono" }, first.name),
    td("target"), td("key", "mono"), td("rate", "mono"), td("concurrency", "num"), td("source"),
    td("running", "num"), td("waiting", "num"), td("keys", "num"));
  return {
    row: tr,
    update(l) {
      const use = l.use || {};
      setText(c.target, `${l.queue} / ${l.task_type || "every type"}`);
      setText(c.key, l.key || "—");
      setText(c.rate, rateText(l));
      setText(c.concurrency, l.concurrency == null ? "—" : l.concurrency);
      setText(c.source, l.source);
      setText(c.running, use.running ?? 0);
      setText(c.waiting, use.waiting ?? 0);
      const keys = use.keys == null ? "—" : `${use.keys}${use.capped ? "+" : ""}`;
      setText(c.keys, keys);
    },
  };
}
