// One workflow (docs/workflows.md): its DAG drawn as SVG, nodes in columns by dependency depth
// (a node's column is one more than its deepest parent's), an edge from each parent to its
// child, each node coloured by its status and linked to its task, the policy written on every
// edge that is not "fail"; then the nodes as a table. Read from GET /api/v1/workflows/{id}
// every 1.5 s while the workflow runs, and at once on an event of the workflow or one of its
// node tasks.

import { api } from "./api.js";
import { clock, fill, h, link, s, setText, shortId, statusPill, taskHref } from "./dom.js";
import { act, coalesce, errorBanner } from "./ui.js";

const POLL_MS = 1500;
const DRAW_MAX = 500; // more nodes than this are listed, not drawn
const NODE_W = 168;
const NODE_H = 46;
const COL_GAP = 84;
const ROW_GAP = 16;
const PAD = 12;

export function workflowHref(id) {
  return "#/workflow/" + encodeURIComponent(id);
}

/** Each node's depth: 0 for a node without dependencies, else 1 + its deepest parent's. */
export function depths(nodes) {
  const byName = new Map(nodes.map((n) => [n.name, n]));
  const depth = new Map();
  const visit = (name, seen) => {
    if (depth.has(name)) return depth.get(name);
    const node = byName.get(name);
    if (!node || seen.has(name)) return 0; // the core refuses cycles; never loop on one
    seen.add(name);
    let d = 0;
    for (const e of node.after) d = Math.max(d, visit(e.node, seen) + 1);
    depth.set(name, d);
    return d;
  };
  for (const n of nodes) visit(n.name, new Set());
  return depth;
}

/** {x, y} of each node's box, columns by depth, rows in the order the workflow gives them. */
export function layout(nodes) {
  const depth = depths(nodes);
  const rows = new Map();
  const at = new Map();
  for (const n of nodes) {
    const col = depth.get(n.name);
    const row = rows.get(col) || 0;
    rows.set(col, row + 1);
    at.set(n.name, { x: PAD + col * (NODE_W + COL_GAP), y: PAD + row * (NODE_H + ROW_GAP) });
  }
  const cols = Math.max(...depth.values()) + 1;
  const height = Math.max(...rows.values());
  return {
    at,
    width: PAD * 2 + cols * NODE_W + (cols - 1) * COL_GAP,
    height: PAD * 2 + height * NODE_H + (height - 1) * ROW_GAP,
  };
}

function label(text, max) {
  return text.length > max ? text.slice(0, max - 1) + "…" : text;
}

function drawGraph(wf) {
  const { at, width, height } = layout(wf.nodes);
  const edges = [];
  const boxes = [];
  for (const n of wf.nodes) {
    const to = at.get(n.name);
    for (const e of n.after) {
      const from = at.get(e.node);
      if (!from) continue;
      const x1 = from.x + NODE_W, y1 = from.y + NODE_H / 2;
      const x2 = to.x, y2 = to.y + NODE_H / 2;
      const mx = (x1 + x2) / 2;
      const edge = s("g", { class: `wf-edge wf-policy-${e.policy}`, "data-edge": `${e.node}->${n.name}`, "data-policy": e.policy },
        s("path", { d: `M${x1},${y1} C${mx},${y1} ${mx},${y2} ${x2 - 6},${y2}`, "marker-end": "url(#wf-arrow)" }));
      if (e.policy !== "fail") {
        edge.append(s("text", { x: mx, y: (y1 + y2) / 2 - 4, "text-anchor": "middle", class: "wf-edge-label" }, e.policy));
      }
      edges.push(edge);
    }
    const title = `${n.name} (${n.task_type}): ${n.status}` + (n.error_class ? ` — ${n.error_class}: ${n.error_message || ""}` : "");
    boxes.push(s("a", { href: taskHref(n.task_id), class: `wf-node wfn-${n.status}`, "data-node": n.name, "data-status": n.status },
      s("title", {}, title),
      s("rect", { x: to.x, y: to.y, width: NODE_W, height: NODE_H, rx: 7 }),
      s("text", { x: to.x + 10, y: to.y + 19, class: "wf-node-name" }, label(n.name, 20)),
      s("text", { x: to.x + 10, y: to.y + 36, class: "wf-node-status" }, label(`${n.status.replace("_", " ")} · ${n.task_type}`, 26))));
  }
  return s("svg", { class: "wf-graph", width, height, viewBox: `0 0 ${width} ${height}`, role: "img",
    "aria-label": `workflow graph of ${wf.nodes.length} nodes`, "data-testid": "workflow-graph" },
  s("defs", {}, s("marker", { id: "wf-arrow", viewBox: "0 0 10 10", refX: 4, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" },
    s("path", { d: "M0,0 L10,5 L0,10 z", class: "wf-arrow" }))),
  edges, boxes);
}

function afterText(after) {
  if (!after.length) return "—";
  return after.map((e) => (e.policy === "fail" ? e.node : `${e.node}(${e.policy})`)).join(", ");
}

export function workflowView(root, shared, id) {
  const pill = h("span", { "data-testid": "workflow-status" });
  const actions = h("div", { class: "actions" });
  const banner = h("div");
  const meta = h("p", { class: "muted", "data-testid": "workflow-times" });
  const graph = h("div", { class: "scroll wf-graph-box" });
  const body = h("tbody");
  fill(root,
    h("div", { class: "task-head" }, h("h1", { class: "task-title" }, "Workflow ", h("span", { class: "mono" }, id)), pill, actions),
    banner,
    h("section", { class: "panel" }, h("h2", {}, "Graph"), meta, graph),
    h("section", { class: "panel" }, h("h2", {}, "Nodes"),
      h("div", { class: "scroll" }, h("table", { class: "grid-table", "data-testid": "workflow-nodes" },
        h("thead", {}, h("tr", {}, ["Node", "Status", "Task", "Queue", "Type", "After", "Error"].map((t) => h("th", {}, t)))),
        body))));

  let wf = null;
  let taskIds = new Set(); // the nodes' task ids, to pick their events out of the stream
  let alive = true;
  let drawn = ""; // the statuses last drawn: the SVG is rebuilt only when one changed

  const refresh = coalesce(async () => {
    try {
      const got = await api.workflow(id);
      if (!alive) return;
      wf = got;
      taskIds = new Set(got.nodes.map((n) => n.task_id));
      fill(banner);
      render();
    } catch (err) {
      fill(banner, errorBanner(err));
    }
  }, 200);

  function render() {
    fill(pill, statusPill(wf.status));
    pill.dataset.status = wf.status;
    setText(meta, `created ${clock(wf.created_at)}` + (wf.finished_at ? ` · finished ${clock(wf.finished_at)}` : "")
      + (wf.cancel_requested && wf.status === "running" ? " · cancel requested" : ""));
    const key = wf.nodes.map((n) => n.status).join(",");
    if (key !== drawn) {
      drawn = key;
      if (wf.nodes.length > DRAW_MAX) fill(graph, h("p", { class: "muted" }, `${wf.nodes.length} nodes: too many to draw, the table lists them.`));
      else fill(graph, drawGraph(wf));
    }
    fill(body, wf.nodes.map((n) => h("tr", { "data-node": n.name },
      h("td", { class: "mono" }, n.name),
      h("td", {}, statusPill(n.status)),
      h("td", { class: "mono" }, link(taskHref(n.task_id), shortId(n.task_id))),
      h("td", {}, n.queue),
      h("td", { class: "mono" }, n.task_type),
      h("td", { class: "mono" }, afterText(n.after)),
      h("td", {}, n.error_class ? `${n.error_class}: ${n.error_message || ""}` : "—"))));
    fill(actions, wf.status === "running" && !wf.cancel_requested
      ? h("button", { type: "button", class: "btn btn-danger", "data-testid": "workflow-cancel", onclick: cancel }, "Cancel workflow")
      : null);
  }

  function cancel() {
    act({
      title: "Cancel this workflow?",
      body: h("p", {}, "Its waiting and queued nodes are cancelled now; its running nodes are asked to stop."),
      confirmLabel: "Cancel workflow",
      run: () => api.cancelWorkflow(id),
      success: (w) => `Workflow ${shortId(id)}: ${w.status}`,
      after: refresh.now,
    });
  }

  refresh.now();
  const poll = setInterval(() => {
    if (!wf || wf.status === "running") refresh();
  }, POLL_MS);
  return {
    refresh: refresh.now,
    onEvent(event) {
      if (!wf) return;
      const meta = event.metadata || {}; // WORKFLOW_* events: {workflow_id, status}
      if (meta.workflow_id === id || taskIds.has(event.task_id)) refresh();
    },
    destroy() {
      alive = false;
      refresh.stop();
      clearInterval(poll);
    },
  };
}
