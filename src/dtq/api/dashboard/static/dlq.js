// Dead letters: the newest entries of the (global) dead-letter stream, with requeue and
// discard per entry and a purge of them all, each after confirmation.

import { api } from "./api.js";
import { clock, fill, h, setText, shortId, syncRows, taskHref } from "./dom.js";
import { act, coalesce, errorBanner } from "./ui.js";

const LIMIT = 200;

export function deadLettersView(root) {
  const body = h("tbody");
  const banner = h("div");
  const count = h("span", { class: "muted", "data-testid": "dlq-count" });
  const purge = h("button", { type: "button", class: "btn btn-danger", "data-testid": "dlq-purge" }, "Purge all");
  fill(root,
    h("section", { class: "panel" },
      h("div", { class: "panel-head" }, h("h2", {}, "Dead letters"), count, purge),
      banner,
      h("div", { class: "scroll" }, h("table", { class: "grid-table", "data-testid": "dlq" },
        h("thead", {}, h("tr", {},
          ["Task", "Type", "Queue", "Failed at", "Attempts", "Last error", ""].map((t) => h("th", {}, t)))),
        body))));

  let total = 0;
  const refresh = coalesce(async () => {
    try {
      const [list, q] = await Promise.all([api.deadLetters(LIMIT), api.queues()]);
      total = q.queues.length ? q.queues[0].dlq_depth : list.dead_letters.length;
      fill(banner);
      syncRows(body, list.dead_letters, (d) => d.task_id, row,
        h("td", { colspan: 7, class: "empty" }, "The dead-letter queue is empty."));
      setText(count, total > list.dead_letters.length ? `${list.dead_letters.length} newest of ${total}` : `${total} in the DLQ`);
      purge.disabled = total === 0;
    } catch (err) {
      fill(banner, errorBanner(err));
    }
  }, 1000);

  function row(first) {
    const d = first;
    const error = h("td", { class: "error-cell" });
    const requeue = h("button", { type: "button", class: "btn btn-small", "data-testid": `requeue-${d.task_id}` }, "Requeue");
    const discard = h("button", { type: "button", class: "btn btn-small btn-danger", "data-testid": `discard-${d.task_id}` }, "Discard");
    requeue.addEventListener("click", () => act({
      title: `Requeue task ${shortId(d.task_id)}?`,
      body: [h("p", {}, h("span", { class: "mono" }, d.task_type), " back to queue ", h("strong", {}, d.original_queue), "."),
        h("p", {}, "Queued again with attempt 0; earlier attempts are kept in metadata.previous_attempts.")],
      confirmLabel: "Requeue",
      run: () => api.requeue(d.task_id),
      success: () => `Task ${shortId(d.task_id)} requeued.`,
      after: refresh.now,
    }));
    discard.addEventListener("click", () => act({
      title: `Discard dead letter ${shortId(d.task_id)}?`,
      body: h("p", {}, "The entry leaves the dead-letter queue; the task stays dead-lettered, marked discarded."),
      confirmLabel: "Discard",
      run: () => api.discard(d.task_id),
      success: () => `Dead letter ${shortId(d.task_id)} discarded.`,
      after: refresh.now,
    }));
    const tr = h("tr", { "data-task": d.task_id },
      h("td", { class: "mono" }, h("a", { href: taskHref(d.task_id), title: d.task_id }, shortId(d.task_id))),
      h("td", {}, d.task_type),
      h("td", {}, d.original_queue),
      h("td", {}, clock(d.failed_at)),
      h("td", { class: "num" }, `${d.attempts_made} / ${d.max_attempts}`),
      error,
      h("td", {}, h("div", { class: "row-actions" }, requeue, discard)));
    return {
      row: tr,
      update(next) {
        fill(error, h("strong", { class: "mono" }, next.last_error_class), ": ", next.last_error);
      },
    };
  }

  purge.addEventListener("click", () => act({
    title: "Purge the dead-letter queue?",
    body: h("p", {}, `Every entry present now (${total}) leaves the DLQ; the tasks stay dead-lettered, marked discarded.`),
    confirmLabel: "Purge all",
    run: () => api.purgeDlq(),
    success: (r) => `${r.purged} dead letters purged.`,
    after: refresh.now,
  }));

  refresh.now();
  const poll = setInterval(refresh, 10000);
  return {
    refresh: refresh.now,
    onEvent(event) {
      if (event.type === "TASK_DEAD_LETTERED" || event.type === "TASK_QUEUED") refresh();
    },
    destroy() {
      refresh.stop();
      clearInterval(poll);
    },
  };
}
