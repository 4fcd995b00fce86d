// Toasts, the confirmation dialog, and destructive actions: each asks for confirmation (and
// for the API key when the API needs one and this tab has none yet), then calls the API and
// reports the outcome.

import { ApiError, apiKey } from "./api.js";
import { fill, h } from "./dom.js";

export const settings = { authRequired: false };

export function toast(message, kind = "info") {
  const box = document.getElementById("toasts");
  const item = h("div", { class: `toast toast-${kind}`, role: kind === "error" ? "alert" : "status" }, message);
  box.append(item);
  setTimeout(() => item.remove(), kind === "error" ? 9000 : 5000);
}

/**
 * Ask for confirmation in the page's own dialog (never window.confirm).
 * Resolves to true when confirmed; asks for the API key too when one is needed and unknown.
 */
export function confirmDialog({ title, body, confirmLabel = "Confirm" }) {
  const dialog = document.getElementById("confirm");
  const form = document.getElementById("confirm-form");
  const keyField = document.getElementById("confirm-key");
  const keyInput = document.getElementById("confirm-key-input");
  if (dialog.open) return Promise.resolve(false); // one question at a time
  const ok = document.getElementById("confirm-ok");
  const back = document.getElementById("confirm-cancel");
  fill(document.getElementById("confirm-title"), title);
  fill(document.getElementById("confirm-body"), body);
  ok.textContent = confirmLabel;
  const needKey = settings.authRequired && !apiKey.get();
  keyField.hidden = !needKey;
  keyInput.value = "";
  keyInput.required = needKey;
  return new Promise((resolve) => {
    const done = (answer) => {
      form.removeEventListener("submit", onSubmit);
      back.removeEventListener("click", onBack);
      dialog.removeEventListener("cancel", onBack);
      dialog.close();
      resolve(answer);
    };
    const onSubmit = (ev) => {
      ev.preventDefault();
      if (needKey) {
        const key = keyInput.value.trim();
        if (!key) {
          keyInput.focus();
          return;
        }
        apiKey.set(key);
        updateKeyButton();
      }
      done(true);
    };
    const onBack = (ev) => {
      ev.preventDefault();
      done(false);
    };
    form.addEventListener("submit", onSubmit);
    back.addEventListener("click", onBack);
    dialog.addEventListener("cancel", onBack);
    dialog.showModal();
    (needKey ? keyInput : back).focus();
  });
}

/**
 * Run one destructive action after confirmation. ``run`` calls the API; ``success`` turns its
 * answer into the message shown. Resolves to the answer, or null (declined or refused).
 */
export async function act({ title, body, confirmLabel, run, success, after }) {
  if (!(await confirmDialog({ title, body, confirmLabel }))) return null;
  try {
    const answer = await run();
    toast(success(answer), "ok");
    return answer;
  } catch (err) {
    if (err instanceof ApiError && (err.status === 401 || err.status === 403)) {
      apiKey.clear();
      updateKeyButton();
      toast(`${err.code}: ${err.message}. Enter the API key again on the next action.`, "error");
    } else if (err instanceof ApiError) {
      toast(`${err.code}: ${err.message}`, "error");
    } else {
      toast(String(err), "error");
    }
    return null;
  } finally {
    if (after) after();
  }
}

export function updateKeyButton() {
  const button = document.getElementById("key-button");
  button.hidden = !settings.authRequired;
  const has = Boolean(apiKey.get());
  button.textContent = has ? "API key: set (forget)" : "API key: not set";
  button.dataset.state = has ? "set" : "unset";
}

export function installKeyButton() {
  const button = document.getElementById("key-button");
  button.addEventListener("click", async () => {
    if (apiKey.get()) {
      apiKey.clear();
      toast("API key forgotten in this tab.");
    } else if (await confirmDialog({
      title: "API key",
      body: h("p", {}, "Destructive actions (cancel, pause, resume, dead-letter actions, schedule pause, resume and trigger) send this key as X-API-Key."),
      confirmLabel: "Keep for this tab",
    })) {
      toast("API key kept for this tab.", "ok");
    }
    updateKeyButton();
  });
  updateKeyButton();
}

/**
 * ``fn`` (async) run at most once per ``waitMs`` and never twice at once, however often the
 * returned function is called: a burst of events costs one request, and the last call of a
 * burst is always followed by a run. ``.now()`` runs it at once (or right after the run in
 * flight).
 */
export function coalesce(fn, waitMs) {
  let timer = null;
  let running = false;
  let again = false;
  let last = 0;
  let stopped = false;
  const run = async () => {
    timer = null;
    if (stopped) return;
    if (running) {
      again = true;
      return;
    }
    running = true;
    last = Date.now();
    try {
      await fn();
    } finally {
      running = false;
      if (again) {
        again = false;
        schedule();
      }
    }
  };
  const schedule = () => {
    if (timer !== null || stopped) return;
    timer = setTimeout(run, Math.max(0, last + waitMs - Date.now()));
  };
  schedule.now = () => {
    clearTimeout(timer);
    timer = null;
    run();
  };
  schedule.stop = () => {
    stopped = true;
    clearTimeout(timer);
  };
  return schedule;
}

/** An error shown in place of a view's content while the API does not answer. */
export function errorBanner(err) {
  return h("p", { class: "error-banner", role: "alert" }, `${err.code || "ERROR"}: ${err.message}`);
}
