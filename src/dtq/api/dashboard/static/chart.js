// Throughput from the event stream: finished attempts counted in 5-second buckets over the
// last 5 minutes (since the page opened), per queue, drawn as hand-made SVG.

import { s } from "./dom.js";

export const BUCKET_MS = 5000;
export const BUCKETS = 60;

const OK = new Set(["TASK_SUCCEEDED"]);
const FAILED = new Set(["TASK_FAILED", "TASK_DEAD_LETTERED", "TASK_RETRY_SCHEDULED"]);

export class Throughput {
  constructor() {
    this.byQueue = new Map(); // queue -> Map(bucket index -> {ok, failed})
    this.since = Date.now();
  }

  /** Count one event if it ends an attempt; returns whether it did. */
  record(event, now = Date.now()) {
    const kind = OK.has(event.type) ? "ok" : FAILED.has(event.type) ? "failed" : null;
    if (!kind || !event.queue) return false;
    const index = Math.floor(now / BUCKET_MS);
    let buckets = this.byQueue.get(event.queue);
    if (!buckets) this.byQueue.set(event.queue, (buckets = new Map()));
    const b = buckets.get(index) || { ok: 0, failed: 0 };
    b[kind] += 1;
    buckets.set(index, b);
    for (const old of buckets.keys()) if (old <= index - BUCKETS) buckets.delete(old);
    return true;
  }

  /** The last BUCKETS buckets, oldest first, for one queue or (null) all of them. */
  series(queue = null, now = Date.now()) {
    const last = Math.floor(now / BUCKET_MS);
    const out = [];
    for (let i = last - BUCKETS + 1; i <= last; i++) out.push({ index: i, ok: 0, failed: 0 });
    const sources = queue === null ? [...this.byQueue.values()] : [this.byQueue.get(queue) || new Map()];
    for (const buckets of sources) {
      for (const point of out) {
        const b = buckets.get(point.index);
        if (b) {
          point.ok += b.ok;
          point.failed += b.failed;
        }
      }
    }
    return out;
  }

  /** Finished attempts per second over the last minute (or since the page opened). */
  rate(queue = null, now = Date.now()) {
    const points = this.series(queue, now).slice(-12);
    const total = points.reduce((n, p) => n + p.ok + p.failed, 0);
    const span = Math.min(60000, Math.max(1000, now - this.since));
    return total / (span / 1000);
  }

  lastMinute(queue = null, now = Date.now()) {
    const points = this.series(queue, now).slice(-12);
    return points.reduce((acc, p) => ({ ok: acc.ok + p.ok, failed: acc.failed + p.failed }), { ok: 0, failed: 0 });
  }
}

function niceMax(value) {
  if (value <= 1) return 1;
  const pow = 10 ** Math.floor(Math.log10(value));
  for (const m of [1, 2, 2.5, 5, 10]) if (value <= m * pow) return m * pow;
  return 10 * pow;
}

/** The stacked bar chart of the whole system in tasks per second (succeeded below, failed
 * attempts above), one bar per 5-second bucket, a grid line per minute. */
export function throughputChart(points) {
  const W = 1100;
  const H = 200;
  const left = 44;
  const right = 8;
  const top = 10;
  const bottom = 24;
  const plotW = W - left - right;
  const plotH = H - top - bottom;
  const perS = BUCKET_MS / 1000;
  const rates = points.map((p) => ({ ok: p.ok / perS, failed: p.failed / perS }));
  const max = niceMax(Math.max(0, ...rates.map((p) => p.ok + p.failed)));
  const y = (v) => top + plotH - (v / max) * plotH;
  const slot = plotW / points.length;
  const barW = Math.max(1, slot - 3);
  const svg = s("svg", {
    viewBox: `0 0 ${W} ${H}`,
    class: "chart",
    role: "img",
    "aria-label": "Finished attempts per second over the last 5 minutes",
    "data-testid": "throughput-chart",
  });
  for (const frac of [0, 0.5, 1]) {
    const v = max * frac;
    svg.append(
      s("line", { x1: left, x2: W - right, y1: y(v), y2: y(v), class: "grid" }),
      s("text", { x: left - 6, y: y(v) + 4, class: "axis", "text-anchor": "end" }, `${Math.round(v * 10) / 10}/s`),
    );
  }
  const perMinute = 60000 / BUCKET_MS;
  for (let i = 0; i <= points.length; i += perMinute) {
    const minutesAgo = (points.length - i) / perMinute;
    const x = left + i * slot;
    const anchor = i === 0 ? "start" : i === points.length ? "end" : "middle";
    svg.append(
      s("line", { x1: x, x2: x, y1: top, y2: top + plotH, class: "grid grid-v" }),
      s("text", { x, y: H - 6, class: "axis", "text-anchor": anchor }, minutesAgo ? `-${minutesAgo} min` : "now"),
    );
  }
  rates.forEach((p, i) => {
    const x = left + i * slot + 1.5;
    const n = points[i];
    if (p.ok) {
      svg.append(s("rect", { x, y: y(p.ok), width: barW, height: y(0) - y(p.ok), class: "bar-ok" },
        s("title", {}, `${n.ok} succeeded in 5 s`)));
    }
    if (p.failed) {
      svg.append(s("rect", { x, y: y(p.ok + p.failed), width: barW, height: y(p.ok) - y(p.ok + p.failed), class: "bar-failed" },
        s("title", {}, `${n.failed} failed attempts in 5 s`)));
    }
  });
  return svg;
}

/** A sparkline of one queue's finished attempts (last 5 minutes). */
export function sparkline(points) {
  const W = 120;
  const H = 26;
  const max = Math.max(1, ...points.map((p) => p.ok + p.failed));
  const step = W / (points.length - 1);
  const coords = points.map((p, i) => `${(i * step).toFixed(1)},${(H - 2 - ((p.ok + p.failed) / max) * (H - 4)).toFixed(1)}`);
  const failedAny = points.some((p) => p.failed);
  return s("svg", { viewBox: `0 0 ${W} ${H}`, class: "spark", "aria-hidden": "true" },
    s("polyline", { points: coords.join(" "), class: failedAny ? "spark-line spark-mixed" : "spark-line" }));
}
