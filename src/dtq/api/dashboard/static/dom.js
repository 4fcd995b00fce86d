// DOM helpers. Every value is put in the page as text (text nodes, textContent) or as an
// attribute set by name: nothing here parses HTML, and the page's Content-Security-Policy
// (Trusted Types required) makes any innerHTML assignment throw.

const SVG_NS = "http://www.w3.org/2000/svg";

function append(node, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function setProps(node, props) {
  for (const [name, value] of Object.entries(props || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") node.setAttribute("class", value);
    else if (name === "dataset") Object.assign(node.dataset, value);
    else if (name.startsWith("on") && typeof value === "function") {
      node.addEventListener(name.slice(2), value);
    } else node.setAttribute(name, value === true ? "" : String(value));
  }
  return node;
}

/** An HTML element: h("td", {class: "num"}, "text", otherNode, ...). */
export function h(tag, props, ...children) {
  return append(setProps(document.createElement(tag), props), children);
}

/** An SVG element, attributes by name. */
export function s(tag, props, ...children) {
  return append(setProps(document.createElementNS(SVG_NS, tag), props), children);
}

/** Replace the children of ``node``. */
export function fill(node, ...children) {
  node.replaceChildren();
  return append(node, children);
}

/** An in-page link to a view of the dashboard (hash routing). */
export function link(hash, ...children) {
  return h("a", { href: hash }, ...children);
}

export function taskHref(id) {
  return "#/task/" + encodeURIComponent(id);
}

// -- formatting ----------------------------------------------------------------------------

export function pretty(value) {
  if (value === undefined) return "";
  return JSON.stringify(value, null, 2);
}

/** "3 s", "4 min 12 s", "2 h 5 min", "3 d 4 h" for a duration in ms (>= 0). */
export function duration(ms) {
  const total = Math.max(0, Math.round(ms / 1000));
  if (total < 60) return `${total} s`;
  const m = Math.floor(total / 60);
  if (m < 60) return `${m} min ${total % 60} s`;
  const hours = Math.floor(m / 60);
  if (hours < 48) return `${hours} h ${m % 60} min`;
  return `${Math.floor(hours / 24)} d ${hours % 24} h`;
}

/** "12 s ago" / "in 4 min 3 s" relative to ``now`` (ms). */
export function relative(iso, now) {
  if (!iso) return "";
  const delta = Date.parse(iso) - now;
  return delta >= 0 ? `in ${duration(delta)}` : `${duration(-delta)} ago`;
}

/** Local time of an ISO timestamp, "2026-11-29 19:36:45.565". */
export function clock(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return String(iso);
  const p = (n, w = 2) => String(n).padStart(w, "0");
  return (
    `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ` +
    `${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}.${p(d.getMilliseconds(), 3)}`
  );
}

export function shortId(id) {
  return id ? String(id).slice(0, 8) : "";
}

export function statusPill(status) {
  return h("span", { class: `pill st-${status}`, dataset: { status } }, status.replace("_", " "));
}

/**
 * Keep ``tbody``'s rows in step with ``items`` without rebuilding them: a row per key, made
 * once by ``create(item)`` (returns {row, update(item)}), updated in place afterwards, in the
 * order of ``items``. Rows stay put under a pointer while their numbers change.
 */
export function syncRows(tbody, items, key, create, empty) {
  const rows = tbody._rows || (tbody._rows = new Map());
  const wanted = new Set(items.map(key));
  for (const [k, entry] of rows) {
    if (!wanted.has(k)) {
      entry.row.remove();
      rows.delete(k);
    }
  }
  const placeholder = tbody.querySelector("tr.placeholder");
  if (placeholder && items.length) placeholder.remove();
  let previous = null;
  for (const item of items) {
    const k = key(item);
    let entry = rows.get(k);
    if (!entry) {
      entry = create(item);
      rows.set(k, entry);
    }
    entry.update(item);
    const expected = previous ? previous.nextSibling : tbody.firstChild;
    if (expected !== entry.row) tbody.insertBefore(entry.row, expected);
    previous = entry.row;
  }
  if (!items.length && !tbody.querySelector("tr.placeholder") && empty) {
    tbody.append(h("tr", { class: "placeholder" }, empty));
  }
}

/** Set a node's text only when it changed (keeps selections and avoids layout work). */
export function setText(node, value) {
  const text = value === null || value === undefined ? "" : String(value);
  if (node.textContent !== text) node.textContent = text;
}
