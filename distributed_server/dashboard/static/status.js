// distributed-core status page: polls /api/v1/status (with the task stream since the
// last poll, sampled) once a second (not while the tab is hidden) and draws progress bars, the task stream on a
// canvas, and the workers' table. No library, nothing fetched from elsewhere.
"use strict";

(function () {
  const POLL_MS = 1000;
  const STREAM_WINDOW_S = 30;      // the task stream shows this many recent seconds
  const STREAM_KEEP = 20000;       // entries kept for drawing
  const STREAM_LIMIT = 100;        // entries asked for per poll (spread over the second)
  const PREFIX_SEGMENTS = [        // [class, states] in bar order
    ["memory", ["memory"]],
    ["erred", ["erred"]],
    ["processing", ["processing"]],
    ["no-worker", ["no-worker"]],
    ["waiting", ["waiting", "queued"]],
  ];

  const $ = (id) => document.getElementById(id);
  let streamNext = 0;              // next task-stream sequence number to ask for
  let stream = [];                 // [seq, key, worker, start, stop, ok, prefix]
  let clockOffset = 0;             // scheduler time - our time, in seconds
  let last = null;                 // the latest status
  let lastRate = null;             // [time, task_stream_total] of the previous poll
  let polls = 0;
  let busy = false;

  // A token in the link has set the cookie: keep it out of the address bar and history.
  if (new URLSearchParams(location.search).has("token")) {
    history.replaceState(null, "", location.pathname);
  }

  function fmtBytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i === 0 ? n.toFixed(0) : n.toFixed(n < 10 ? 2 : 1)) + " " + units[i];
  }
  function fmtInt(n) { return n === null || n === undefined ? "–" : n.toLocaleString("en-US"); }
  function fmtSeconds(s) {
    if (s === null || s === undefined) return "–";
    return s < 1 ? (s * 1000).toFixed(s < 0.01 ? 1 : 0) + " ms" : s.toFixed(2) + " s";
  }
  function hue(text) {
    let h = 0;
    for (let i = 0; i < text.length; i++) h = (h * 31 + text.charCodeAt(i)) | 0;
    return Math.abs(h) % 360;
  }
  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  async function getJSON(path) {
    const response = await fetch(path, { credentials: "same-origin", cache: "no-store" });
    if (!response.ok) throw new Error(response.status + " " + (await response.text()));
    return response.json();
  }

  async function poll() {
    if (busy || document.hidden) return;
    busy = true;
    try {
      const status = await getJSON("/api/v1/status?stream_after=" + streamNext +
        "&stream_limit=" + STREAM_LIMIT);
      const chunk = status.stream;
      clockOffset = status.time - Date.now() / 1000;
      if (chunk.next < streamNext) stream = [];  // the scheduler restarted
      streamNext = chunk.next;
      for (const entry of chunk.entries) stream.push(entry);
      if (stream.length > STREAM_KEEP) stream = stream.slice(stream.length - STREAM_KEEP);
      polls++;
      render(status);
      $("connection").className = "dot ok";
      $("connection").title = "connected";
    } catch (err) {
      $("connection").className = "dot bad";
      $("connection").title = "cannot reach the scheduler: " + err.message;
    } finally {
      busy = false;
    }
  }

  function render(status) {
    const previous = last;
    last = status;
    window.dcoreStatus = status;  // for people (and tests) poking at the page
    const s = status.scheduler;
    $("scheduler").textContent = s.address + " · v" + s.version + " · core " +
      (s.compiled ? "compiled" : "interpreted");
    $("updated").textContent = "updated " + new Date(status.time * 1000).toLocaleTimeString();
    renderTotals(status, previous);
    renderProgress(status);
    renderWorkers(status);
    drawStream(status);
    document.body.dataset.polls = String(polls);
  }

  function renderTotals(status) {
    const c = status.cluster, t = status.tasks, server = status.server;
    $("t-workers").textContent = fmtInt(c.workers);
    $("t-threads").textContent = fmtInt(c.threads);
    $("t-tasks").textContent = fmtInt(c.tasks);
    $("t-processing").textContent = fmtInt(t.processing);
    $("t-memory-tasks").textContent = fmtInt(t.memory);
    $("t-erred").textContent = fmtInt(t.erred);
    $("t-memory").textContent = fmtBytes(c.memory);
    $("t-spilled").textContent = fmtBytes(c.spilled);
    $("t-cpu").textContent = Math.round(c.cpu * 100) + " %";
    $("t-lag").textContent = fmtSeconds(server.loop_lag_max);
    const now = [status.time, server.task_stream_total];
    if (lastRate !== null && now[0] > lastRate[0]) {
      const rate = Math.max(0, (now[1] - lastRate[1]) / (now[0] - lastRate[0]));
      $("t-rate").textContent = fmtInt(Math.round(rate));
    }
    lastRate = now;
  }

  function renderProgress(status) {
    const box = $("progress");
    const rows = status.prefixes;
    let total = 0, done = 0;
    if (!rows.length) {
      box.replaceChildren(el("p", { class: "muted" }, "no tasks"));
    } else {
      const nodes = [];
      for (const p of rows) {
        const n = p.released + p.waiting + p.queued + p["no-worker"] + p.processing +
          p.memory + p.erred;
        total += n;
        done += p.memory + p.erred;
        const name = el("div", { class: "prefix-name", title: p.name }, p.name);
        const bar = el("div", {
          class: "bar", "data-prefix": p.name, "data-total": String(n),
          "data-memory": String(p.memory), "data-erred": String(p.erred),
          "data-processing": String(p.processing),
        });
        for (const [cls, states] of PREFIX_SEGMENTS) {
          const k = states.reduce((sum, state) => sum + p[state], 0);
          if (k > 0) {
            const seg = el("div", { class: "seg " + cls, title: cls + ": " + fmtInt(k) });
            seg.style.width = (100 * k / n) + "%";
            bar.appendChild(seg);
          }
        }
        const count = el("div", { class: "prefix-count" },
          fmtInt(p.memory) + " / " + fmtInt(n) + " in memory" +
          (p.erred ? " · " + fmtInt(p.erred) + " erred" : "") +
          (p.processing ? " · " + fmtInt(p.processing) + " running" : ""));
        nodes.push(name, bar, count);
      }
      box.replaceChildren(...nodes);
    }
    box.dataset.total = String(total);
    box.dataset.done = String(done);
    const notes = [];
    if (status.prefixes_not_shown) notes.push(status.prefixes_not_shown + " more prefixes not shown");
    if (status.counts_age > 2) {
      notes.push("task counts from " + Math.round(status.counts_age) + " s ago (this core " +
        "keeps no counters: counting is redone only as often as costs ~1% of the scheduler)");
    }
    $("progress-more").textContent = notes.join(" · ");
  }

  function renderWorkers(status) {
    const body = document.querySelector("#workers tbody");
    const rows = [];
    const workers = status.workers.slice().sort((a, b) => a.name.localeCompare(b.name));
    for (const w of workers) {
      const tr = el("tr", { "data-worker": w.address });
      tr.appendChild(el("td", {}, w.name));
      const addr = el("td", { class: "addr" });
      if (w.dashboard && /^https?:\/\//.test(w.dashboard)) {
        const a = el("a", { href: w.dashboard + "/metrics", title: "the worker's /metrics" },
          w.address);
        addr.appendChild(a);
      } else {
        addr.textContent = w.address;
      }
      tr.appendChild(addr);
      tr.appendChild(el("td", { class: "num" }, fmtInt(w.nthreads)));
      tr.appendChild(el("td", { class: "num" }, fmtInt(w.processing)));
      tr.appendChild(el("td", { class: "num" }, fmtInt(w.in_memory)));
      const mem = el("td");
      const bar = el("span", { class: "membar" });
      const biggest = Math.max(1, ...workers.map((x) => (x.memory || 0) + (x.spilled || 0)));
      const fill = el("span", { class: "fill" });
      fill.style.width = (100 * (w.memory || 0) / biggest) + "%";
      const spill = el("span", { class: "spill" });
      spill.style.left = fill.style.width;
      spill.style.width = (100 * (w.spilled || 0) / biggest) + "%";
      bar.append(fill, spill);
      mem.append(bar, el("span", { class: "memtext" }, fmtBytes(w.memory)));
      tr.appendChild(mem);
      tr.appendChild(el("td", { class: "num" }, fmtBytes(w.spilled)));
      tr.appendChild(el("td", { class: "num" },
        w.cpu === null ? "–" : Math.round(w.cpu * 100) + " %"));
      tr.appendChild(el("td", w.paused ? { class: "paused" } : {},
        w.paused ? "paused" : "running"));
      rows.push(tr);
    }
    body.replaceChildren(...rows);
  }

  function drawStream(status) {
    const canvas = $("stream");
    const workers = status.workers.map((w) => w.address).sort();
    const seen = new Set(workers);
    const nowS = Date.now() / 1000 + clockOffset;
    const from = nowS - STREAM_WINDOW_S;
    for (const e of stream) {
      if (e[4] >= from && !seen.has(e[2])) { seen.add(e[2]); workers.push(e[2]); }
    }
    const rowH = 18, top = 4, left = 4, axis = 16;
    const cssWidth = canvas.clientWidth || 800;
    const cssHeight = top + Math.max(1, workers.length) * rowH + axis;
    const ratio = window.devicePixelRatio || 1;
    canvas.width = Math.round(cssWidth * ratio);
    canvas.height = Math.round(cssHeight * ratio);
    canvas.style.height = cssHeight + "px";
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, cssWidth, cssHeight);
    const width = cssWidth - left * 2;
    const x = (t) => left + (t - from) / STREAM_WINDOW_S * width;
    const row = new Map(workers.map((w, i) => [w, i]));
    let shown = 0;
    for (const e of stream) {
      const [, , worker, start, stop, ok, prefix] = e;
      if (stop < from) continue;
      const i = row.get(worker);
      if (i === undefined) continue;
      const x0 = x(Math.max(start, from));
      const w = Math.max(1, x(stop) - x0);
      ctx.fillStyle = ok ? "hsl(" + hue(prefix) + ", 60%, 52%)" : "#d93f3f";
      ctx.fillRect(x0, top + i * rowH + 2, w, rowH - 4);
      shown++;
    }
    ctx.fillStyle = "#6b7280";
    ctx.font = "11px system-ui, sans-serif";
    for (let s = 0; s <= STREAM_WINDOW_S; s += 5) {
      const label = s === 0 ? "now" : "-" + s + " s";
      const tx = x(nowS - s);
      ctx.fillRect(tx, cssHeight - axis, 1, 4);
      ctx.fillText(label, Math.min(Math.max(tx - 10, 0), cssWidth - 36), cssHeight - 3);
    }
    canvas.dataset.shown = String(shown);
    $("stream-note").textContent = "last " + STREAM_WINDOW_S + " s · " + workers.length +
      " worker rows · " + fmtInt(shown) + " tasks drawn";
  }

  poll();
  setInterval(poll, POLL_MS);
  document.addEventListener("visibilitychange", () => { if (!document.hidden) poll(); });
})();
