// The live event stream (the API's WebSocket): one connection for the whole page, reconnected
// by itself with exponential backoff and jitter (0.5 s doubling up to 15 s) whenever it
// closes, including after the server closes a slow consumer (1013).

const BACKOFF_FIRST_MS = 500;
const BACKOFF_MAX_MS = 15000;

export class LiveEvents {
  /**
   * @param {string} url ws:// or wss:// URL of the event stream
   * @param {{onEvent: Function, onState: Function, onOpen: Function}} handlers
   */
  constructor(url, { onEvent, onState, onOpen }) {
    this.url = url;
    this.onEvent = onEvent;
    this.onState = onState;
    this.onOpen = onOpen;
    this.failures = 0;
    this.socket = null;
    this.retryTimer = null;
    this.countdown = null;
    this.everOpened = false;
  }

  start() {
    this.connect();
    window.addEventListener("online", () => this.reconnectNow());
  }

  reconnectNow() {
    if (this.socket && this.socket.readyState <= WebSocket.OPEN) return;
    clearTimeout(this.retryTimer);
    clearInterval(this.countdown);
    this.connect();
  }

  connect() {
    this.onState("connecting", this.everOpened ? "reconnecting" : "connecting");
    let socket;
    try {
      socket = new WebSocket(this.url);
    } catch (err) {
      this.scheduleRetry(`cannot connect: ${err.message}`);
      return;
    }
    this.socket = socket;
    socket.addEventListener("open", () => {
      this.failures = 0;
      const again = this.everOpened;
      this.everOpened = true;
      this.onState("live", "live");
      this.onOpen(again);
    });
    socket.addEventListener("message", (msg) => {
      let event;
      try {
        event = JSON.parse(msg.data);
      } catch {
        return;
      }
      if (event && typeof event.type === "string") this.onEvent(event);
    });
    socket.addEventListener("close", (ev) => {
      if (this.socket !== socket) return;
      this.socket = null;
      const why = ev.code === 1013 ? "too slow, events dropped" : `closed (${ev.code})`;
      this.scheduleRetry(why);
    });
  }

  scheduleRetry(why) {
    this.failures += 1;
    const base = Math.min(BACKOFF_MAX_MS, BACKOFF_FIRST_MS * 2 ** (this.failures - 1));
    const delay = Math.round(base * (0.75 + Math.random() * 0.5));
    const due = Date.now() + delay;
    const show = () => {
      const left = Math.max(0, Math.ceil((due - Date.now()) / 1000));
      this.onState("offline", `offline: ${why}; retry in ${left} s`);
    };
    show();
    clearInterval(this.countdown);
    this.countdown = setInterval(show, 1000);
    this.retryTimer = setTimeout(() => {
      clearInterval(this.countdown);
      this.connect();
    }, delay);
  }
}
