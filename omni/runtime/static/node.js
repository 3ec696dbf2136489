// omnid's dashboard: GPU memory per GPU, swaps, per-model traffic, and the instances,
// from /v1/dashboard/events (one snapshot a second; counts cumulative, turned into rates here).
"use strict";

(() => {
  const L = window.Live;
  const $ = (id) => document.getElementById(id);
  const history = new L.History();
  const rates = new L.Rates();
  const gpuCharts = new Map(); // GPU index -> its memory chart
  const charts = {
    swaps: new L.Chart($("chart-swaps"), "Swaps per second", L.num),
    requests: new L.Chart($("chart-requests"), "Requests per second", L.num),
    latency: new L.Chart($("chart-latency"), "Latency (30 s window): p50, p99 dashed", L.seconds, 0.01),
    queue: new L.Chart($("chart-queue"), "Queued: for a permit, for a swap-in", L.num),
  };
  const lastRate = new Map(); // model -> its latest requests/s, for the table

  function onSnapshot(s) {
    const t = s.at;
    const v = {};
    for (const g of s.gpus) {
      // a resident instance is charged its whole quota: those stack up against the budget
      for (const p of g.resident) v[`gpu${g.index}:${p.name}`] = p.quota_bytes || 0;
      for (const p of [...g.swapped, ...g.stopped]) v[`gpu${g.index}:${p.name}`] = 0;
      v[`gpu${g.index}:budget`] = g.budget_bytes;
      v[`gpu${g.index}:used`] = g.resident.reduce((a, p) => a + (p.used_bytes || 0), 0);
      v[`swapwait:gpu ${g.index}`] = g.waiting;
    }
    v["swaps:in"] = rates.rate("swaps:in", t, s.swaps.in);
    v["swaps:out"] = rates.rate("swaps:out", t, s.swaps.out);
    for (const m of s.models) {
      const r = rates.rate("req:" + m.name, t, m.requests);
      lastRate.set(m.name, r);
      v["req:" + m.name] = r;
      v["p50:" + m.name] = m.latency.p50_s;
      v["p99:" + m.name] = m.latency.p99_s;
      v["queue:" + m.name] = m.waiting;
    }
    history.push(t, v);
    header(s);
    gpus(s);
    instances(s);
    plots(s);
  }

  function header(s) {
    const n = s.models.length;
    const parts = [`${n} instance${n === 1 ? "" : "s"}`, `${s.gpus.length} GPU${s.gpus.length === 1 ? "" : "s"}`];
    const drained = s.node.drained || [];
    if (drained.length) parts.push(`drained: ${drained.join(", ")} stopped (omnictl undrain starts them again)`);
    else if (s.node.draining) parts.push("draining: new requests refused (omnictl undrain)");
    $("node-meta").textContent = parts.join(" · ");
    $("node-meta").className = "meta" + (s.node.draining ? " bad" : "");
    sandbox(s.node.sandbox);
  }

  function sandbox(sb) {
    // which limits instances' sandboxes enforce; red while a required one does not hold
    const box = $("node-sandbox");
    if (!sb) return;
    const held = Object.keys(sb.enforced).filter((k) => sb.enforced[k]);
    const notHeld = Object.keys(sb.enforced).filter((k) => !sb.enforced[k]);
    let how = sb.mode;
    if (sb.mode === "isolated") how += ` (cgroup v${sb.cgroup_version}, seccomp ${sb.seccomp ? "on" : "off"})`;
    const parts = [`sandbox: ${how}`, `enforced: ${held.join(", ") || "none"}`];
    if (notHeld.length) parts.push(`NOT enforced: ${notHeld.join(", ")}`);
    if (sb.missing.length) parts.push(`required, missing: ${sb.missing.join(", ")}: no instance starts`);
    box.textContent = parts.join(" · ");
    box.className = "meta" + (sb.missing.length ? " bad" : "");
  }

  function gpus(s) {
    $("no-gpu").hidden = s.gpus.length > 0;
    const bars = $("gpu-bars");
    const seen = new Set();
    for (const g of s.gpus) {
      seen.add(String(g.index));
      let box = bars.querySelector(`.gpu[data-gpu="${g.index}"]`);
      if (!box) {
        box = L.el("div", { class: "gpu", "data-gpu": g.index });
        bars.appendChild(box);
      }
      const used = g.resident.reduce((a, p) => a + (p.used_bytes || 0), 0);
      const head = L.el(
        "div",
        { class: "gpu-head" },
        L.el("b", {}, `GPU ${g.index}`),
        L.el("span", {}, `charged ${L.bytes(g.charged_bytes)} of ${L.bytes(g.budget_bytes)}`),
        L.el("span", {}, `used ${L.bytes(used)}`),
        L.el("span", {}, `swaps in ${g.swaps_in} / out ${g.swaps_out}`),
        L.el("span", {}, `waiting for a swap-in: ${g.waiting}`),
      );
      const bar = L.el("div", { class: "bar", title: `budget ${L.bytes(g.budget_bytes)}` });
      for (const p of g.resident) {
        const share = (100 * (p.quota_bytes || 0)) / Math.max(1, g.budget_bytes);
        bar.appendChild(
          L.el(
            "div",
            {
              class: "seg",
              "data-name": p.name,
              title: `${p.name}: ${p.residency}, used ${L.bytes(p.used_bytes)} of quota ${L.bytes(p.quota_bytes)}`,
              style: { width: share + "%", background: L.fill(p.name) },
            },
            `${p.name} ${L.bytes(p.used_bytes)}`,
          ),
        );
      }
      const out = g.swapped.map((p) => p.name);
      const swapped = L.el("div", { class: "swapped-list" }, "swapped out: " + (out.join(", ") || "none"));
      box.replaceChildren(head, bar, swapped);
    }
    for (const box of [...bars.children]) if (!seen.has(box.dataset.gpu)) box.remove();
  }

  const STATE = { ready: "ok", starting: "wait", backoff: "bad", failed: "bad", stopping: "wait", draining: "wait" };
  const RESIDENCY = { resident: "ok", moving: "wait", starting: "wait", swapped: "", stopped: "bad" };

  function instances(s) {
    $("no-instances").hidden = s.models.length > 0;
    L.table(document.querySelector("#instances tbody"), s.models, [
      ["name", (m) => m.name],
      ["kind", (m) => m.kind],
      ["state", (m) => ({ text: m.state, cls: STATE[m.state] || "", title: m.failure || "" })],
      ["residency", (m) => (m.residency ? { text: m.residency, cls: RESIDENCY[m.residency] || "" } : "cpu")],
      ["gpu", (m) => (m.gpus.length ? m.gpus.join(",") : "–")],
      ["quota", (m) => (m.quota_bytes == null ? null : L.bytes(m.quota_bytes))],
      ["used", (m) => (m.used_bytes == null ? null : L.bytes(m.used_bytes))],
      ["swaps", (m) => (m.swaps_in == null ? null : `${m.swaps_in}/${m.swaps_out}`)],
      ["in_flight", (m) => m.in_flight],
      ["queued", (m) => m.waiting],
      ["requests", (m) => m.requests],
      ["rate", (m) => L.rate(lastRate.get(m.name))],
      ["errors", (m) => ({ text: String(m.errors), cls: m.errors ? "bad" : "" })],
      ["p50", (m) => L.seconds(m.latency.p50_s)],
      ["p99", (m) => L.seconds(m.latency.p99_s)],
      ["restarts", (m) => m.restarts],
      ["last_used", (m) => ({ text: L.ago(m.last_used, s.at), title: m.last_used ? new Date(m.last_used * 1000).toLocaleString() : "" })],
    ]);
  }

  function stacked(index, names) {
    // The resident instances' quotas stacked (each series the sum up to it, drawn top
    // first so the smaller sums cover the larger), the budget, and what they really use.
    const prefix = `gpu${index}:`;
    const cols = names.map((n) => history.col(prefix + n));
    const sums = [];
    let acc = new Array(history.t.length).fill(0);
    for (const col of cols) {
      acc = acc.map((a, i) => a + (col[i] || 0));
      sums.push(acc);
    }
    const spec = names.map((n, k) => ({
      key: prefix + n,
      label: n,
      values: sums[k],
      fill: L.fill(n),
      color: L.stroke(n),
      legend: (i) => cols[k][i],
    }));
    spec.reverse();
    spec.push({ key: prefix + "budget", label: "budget", color: "#b42318", dash: [6, 4] });
    spec.push({ key: prefix + "used", label: "used", color: "#1d2330", dash: [2, 3] });
    return spec;
  }

  function plots(s) {
    const box = $("gpu-charts");
    for (const g of s.gpus) {
      if (!gpuCharts.has(g.index)) {
        const div = L.el("div", { class: "chart", id: `chart-gpu-${g.index}` });
        box.appendChild(div);
        const title = `GPU ${g.index}: resident instances' quotas against the budget`;
        gpuCharts.set(g.index, new L.Chart(div, title, L.bytes, g.budget_bytes));
      }
      const names = [...g.resident, ...g.swapped, ...g.stopped].map((p) => p.name).sort();
      gpuCharts.get(g.index).update(history, stacked(g.index, names));
    }
    charts.swaps.update(history, [
      { key: "swaps:in", label: "in", color: "#1a7f37" },
      { key: "swaps:out", label: "out", color: "#b42318" },
    ]);
    const names = s.models.map((m) => m.name);
    charts.requests.update(history, names.map((n) => ({ key: "req:" + n, label: n, color: L.stroke(n) })));
    charts.latency.update(history, [
      ...names.map((n) => ({ key: "p50:" + n, label: n + " p50", color: L.stroke(n) })),
      ...names.map((n) => ({ key: "p99:" + n, label: n + " p99", color: L.stroke(n), dash: [5, 4] })),
    ]);
    charts.queue.update(history, [
      ...names.map((n) => ({ key: "queue:" + n, label: n, color: L.stroke(n) })),
      ...s.gpus.map((g) => ({ key: `swapwait:gpu ${g.index}`, label: `swap-in, GPU ${g.index}`, dash: [5, 4] })),
    ]);
  }

  L.connect("/v1/dashboard/events", onSnapshot, $("status"));
})();
