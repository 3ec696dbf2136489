// What omnid's and the edge's dashboards share: the event stream, a short history of
// snapshots, rates from cumulative counts, uPlot charts that follow a changing set of
// series, keyed tables and number formats. Plain JS, no build step; uPlot is vendored.
"use strict";

window.Live = (() => {
  const HISTORY = 600; // points kept per series: ten minutes at one snapshot a second

  // The snapshot the page was served with (a JSON data block, never run as script), if any.
  function inlined() {
    const block = document.getElementById("snapshot");
    try {
      const snap = block ? JSON.parse(block.textContent) : null;
      return snap && typeof snap.at === "number" ? snap : null;
    } catch (err) {
      return null;
    }
  }

  // The first snapshot, inlined in the page, drawn at once; then the snapshot stream.
  // EventSource reconnects on its own; the status says how it goes. A snapshot no newer
  // than the last one drawn (the stream's first can be the page's) is not drawn again.
  function connect(url, onSnapshot, statusEl) {
    const say = (text, cls) => {
      statusEl.textContent = text;
      statusEl.className = "status " + cls;
    };
    const time = (snap) => new Date(snap.at * 1000).toLocaleTimeString();
    let last = -Infinity;
    const draw = (snap) => {
      if (snap.at <= last) return;
      last = snap.at;
      onSnapshot(snap);
    };
    say("connecting", "wait");
    const first = inlined();
    if (first) {
      draw(first);
      say("as of " + time(first) + " · connecting", "wait");
    }
    const source = new EventSource(url);
    source.onmessage = (ev) => {
      let snap;
      try {
        snap = JSON.parse(ev.data);
      } catch (err) {
        say("bad snapshot", "bad");
        return;
      }
      say("live · " + time(snap), "ok");
      draw(snap);
    };
    source.addEventListener("failed", () => say("snapshot failed (see the server's log)", "bad"));
    source.addEventListener("end", () => say("server stopping", "bad"));
    source.onerror = () => say("disconnected · retrying", "bad");
    return source;
  }

  // Columns of numbers over time, one per series key; a key that appears late is
  // back-filled with gaps, one that goes missing gets gaps.
  class History {
    constructor(max = HISTORY) {
      this.max = max;
      this.t = [];
      this.cols = new Map();
    }
    push(t, values) {
      this.t.push(t);
      for (const [key, col] of this.cols) col.push(key in values ? values[key] : null);
      for (const key of Object.keys(values)) {
        if (!this.cols.has(key)) {
          const col = new Array(this.t.length - 1).fill(null);
          col.push(values[key]);
          this.cols.set(key, col);
        }
      }
      if (this.t.length > this.max) {
        this.t.shift();
        for (const col of this.cols.values()) col.shift();
      }
    }
    col(key) {
      return this.cols.get(key) || new Array(this.t.length).fill(null);
    }
  }

  // Per-second rates of cumulative counts, between consecutive snapshots. A count that
  // went down (an instance unloaded, a process restarted) restarts from there.
  class Rates {
    constructor() {
      this.prev = new Map();
    }
    rate(key, t, count) {
      const prev = this.prev.get(key);
      this.prev.set(key, [t, count]);
      if (count == null || !prev || t <= prev[0]) return null;
      return Math.max(0, (count - prev[1]) / (t - prev[0]));
    }
  }

  const PALETTE = [210, 25, 130, 280, 350, 50, 180, 95, 320, 240, 5, 160];
  const hues = new Map();
  function hue(key) {
    if (!hues.has(key)) hues.set(key, PALETTE[hues.size % PALETTE.length] + 7 * Math.floor(hues.size / PALETTE.length));
    return hues.get(key);
  }
  const stroke = (key) => `hsl(${hue(key)}, 65%, 42%)`;
  const fill = (key) => `hsl(${hue(key)}, 60%, 78%)`;

  // A uPlot chart in `box` whose series may change between updates (models come and
  // go): rebuilt when they do, else only given new data. `spec`: [{key, label, color,
  // fill, dash, values, legend}] where `values` (optional) is the column to plot for
  // `key` and `legend(i)` the value the legend shows. The y axis starts at 0 and reaches
  // `minTop` at least, so a flat line of zeros stays a flat line at the bottom.
  class Chart {
    constructor(box, title, format, minTop = 1) {
      this.box = box;
      this.title = title;
      this.format = format || num;
      this.minTop = minTop;
      this.plot = null;
      this.keys = "";
      this.note = document.createElement("div");
      this.note.className = "chart-note";
      this.note.textContent = "waiting for data";
      box.appendChild(this.note);
      window.addEventListener("resize", () => this.plot && this.plot.setSize(this.size()));
    }
    size() {
      return { width: Math.max(280, this.box.clientWidth - 4), height: 190 };
    }
    update(history, spec) {
      if (history.t.length < 1) return;
      const keys = spec.map((s) => s.key + "|" + (s.label || "")).join(",");
      const data = [history.t, ...spec.map((s) => s.values || history.col(s.key))];
      if (keys !== this.keys || !this.plot) {
        if (this.plot) this.plot.destroy();
        this.keys = keys;
        this.note.textContent = spec.length ? "" : "nothing to plot yet";
        const fmt = this.format;
        const minTop = this.minTop;
        this.plot = new uPlot(
          {
            title: this.title,
            ...this.size(),
            scales: { x: { time: true }, y: { range: (u, lo, hi) => [0, Math.max(hi || 0, minTop) * 1.1] } },
            axes: [{}, { size: 70, values: (u, splits) => splits.map((v) => fmt(v)) }],
            series: [
              {},
              ...spec.map((s) => ({
                label: s.label || s.key,
                stroke: s.color || stroke(s.key),
                fill: s.fill,
                dash: s.dash,
                width: 1.5,
                spanGaps: false,
                points: { show: false },
                value: (u, v, si, i) => fmt(s.legend ? s.legend(i) : v),
              })),
            ],
          },
          data,
          this.box,
        );
      } else {
        this.plot.setData(data);
      }
    }
  }

  // Rows of `tbody` kept in step with `rows`, by `row.name`; cells carry data-col.
  function table(tbody, rows, columns) {
    const seen = new Set();
    for (const row of rows) {
      seen.add(row.name);
      let tr = tbody.querySelector(`tr[data-name="${CSS.escape(row.name)}"]`);
      if (!tr) {
        tr = document.createElement("tr");
        tr.dataset.name = row.name;
        for (const [col] of columns) {
          const td = document.createElement("td");
          td.dataset.col = col;
          tr.appendChild(td);
        }
        tbody.appendChild(tr);
      }
      for (const [col, render] of columns) {
        const td = tr.querySelector(`td[data-col="${col}"]`);
        const out = render(row);
        const text = out == null ? "–" : typeof out === "object" ? out.text : String(out);
        if (td.textContent !== text) td.textContent = text;
        const cls = out && typeof out === "object" ? out.cls || "" : "";
        if (td.className !== cls) td.className = cls;
        const title = out && typeof out === "object" ? out.title || "" : "";
        if (td.title !== title) td.title = title;
      }
    }
    for (const tr of [...tbody.querySelectorAll("tr")]) if (!seen.has(tr.dataset.name)) tr.remove();
  }

  function bytes(v) {
    if (v == null) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) {
      v /= 1024;
      i++;
    }
    return (i && Math.abs(v) < 10 ? v.toFixed(1) : Math.round(v)) + " " + units[i];
  }
  function seconds(v) {
    if (v == null) return "–";
    return v < 1 ? (v * 1000).toPrecision(3) + " ms" : v.toPrecision(3) + " s";
  }
  function num(v) {
    if (v == null) return "–";
    if (v === 0) return "0";
    const a = Math.abs(v);
    return a >= 100 ? Math.round(v).toString() : a >= 1 ? v.toFixed(1) : v.toPrecision(2);
  }
  const rate = (v) => (v == null ? "–" : num(v) + "/s");
  // how long before `now` (unix seconds) the unix time `t` was: "3 s ago", "2 min ago"
  function ago(t, now) {
    if (t == null) return "–";
    const s = Math.max(0, now - t);
    if (s < 120) return Math.round(s) + " s ago";
    if (s < 7200) return Math.round(s / 60) + " min ago";
    return Math.round(s / 3600) + " h ago";
  }

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else if (k === "style") Object.assign(node.style, v);
      else node.setAttribute(k, v);
    }
    for (const c of children) node.append(c);
    return node;
  }

  return { connect, History, Rates, Chart, table, bytes, seconds, num, rate, ago, el, stroke, fill };
})();
