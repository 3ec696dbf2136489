// The edge's dashboard: each tenant's share of what is served, its queue and its sheds;
// each node's health, round trip and load. From /v1/dashboard/events (one snapshot a
// second; counts cumulative, turned into rates here).
"use strict";

(() => {
  const L = window.Live;
  const $ = (id) => document.getElementById(id);
  const history = new L.History();
  const rates = new L.Rates();
  const charts = {
    tokens: new L.Chart($("chart-tokens"), "Tokens served per second, by tenant", L.num),
    queued: new L.Chart($("chart-queued"), "Queued, by tenant", L.num),
    shed: new L.Chart($("chart-shed"), "Shed per second, by tenant", L.num),
    rtt: new L.Chart($("chart-rtt"), "Round trip, by node", L.seconds, 0.001),
    inflight: new L.Chart($("chart-inflight"), "In flight, by node", L.num),
  };
  const now = new Map(); // latest rates, for the tables

  const total = (obj) => Object.values(obj || {}).reduce((a, b) => a + b, 0);

  function onSnapshot(s) {
    const t = s.at;
    const v = {};
    for (const tn of s.tenants) {
      const req = rates.rate("req:" + tn.name, t, tn.requests);
      const tok = rates.rate("tok:" + tn.name, t, tn.served_tokens);
      const shed = rates.rate("shed:" + tn.name, t, total(tn.shed));
      now.set("req:" + tn.name, req);
      now.set("tok:" + tn.name, tok);
      v["tok:" + tn.name] = tok;
      v["queued:" + tn.name] = tn.queued;
      v["shed:" + tn.name] = shed;
    }
    for (const n of s.nodes) {
      v["rtt:" + n.url] = n.latency_ms / 1000;
      v["inflight:" + n.url] = n.in_flight_total;
    }
    history.push(t, v);
    header(s);
    tables(s);
    plots(s);
  }

  function header(s) {
    const healthy = s.nodes.filter((n) => n.healthy).length;
    $("edge-meta").textContent =
      `${s.tenants.length} tenant${s.tenants.length === 1 ? "" : "s"} · ` +
      `${healthy}/${s.nodes.length} nodes healthy · ${s.queueing} queueing`;
  }

  function tables(s) {
    const served = s.tenants.reduce((a, tn) => a + (now.get("tok:" + tn.name) || 0), 0);
    const servedAll = s.tenants.reduce((a, tn) => a + tn.served_tokens, 0);
    L.table(document.querySelector("#tenants tbody"), s.tenants, [
      ["name", (tn) => tn.name],
      ["weight", (tn) => (tn.weight == null ? null : String(tn.weight))],
      ["requests", (tn) => tn.requests],
      ["rate", (tn) => L.rate(now.get("req:" + tn.name))],
      ["errors", (tn) => ({ text: String(tn.errors), cls: tn.errors ? "bad" : "" })],
      ["tokens", (tn) => L.rate(now.get("tok:" + tn.name))],
      [
        "share",
        (tn) => {
          // of the tokens served now, or (when idle) since the edge started
          const mine = served > 0 ? now.get("tok:" + tn.name) || 0 : tn.served_tokens;
          const all = served > 0 ? served : servedAll;
          return all > 0 ? ((100 * mine) / all).toFixed(1) + "%" : null;
        },
      ],
      ["held", (tn) => tn.held],
      ["queued", (tn) => tn.queued],
      [
        "shed",
        (tn) => ({
          text: String(total(tn.shed)),
          cls: total(tn.shed) ? "bad" : "",
          title: Object.entries(tn.shed).map(([r, n]) => `${r}: ${n}`).join(", "),
        }),
      ],
      ["wait_p50", (tn) => L.seconds(tn.queue_wait.p50_s)],
      ["wait_p99", (tn) => L.seconds(tn.queue_wait.p99_s)],
    ]);
    $("no-nodes").hidden = s.nodes.length > 0;
    const nodes = s.nodes.map((n) => ({ ...n, name: n.url }));
    L.table(document.querySelector("#nodes tbody"), nodes, [
      ["name", (n) => n.url],
      ["health", (n) => (n.healthy ? { text: "up", cls: "ok" } : { text: "ejected", cls: "bad" })],
      ["rtt", (n) => L.seconds(n.latency_ms / 1000)],
      ["in_flight", (n) => n.in_flight_total],
      ["models", (n) => Object.entries(n.models).map(([m, p]) => `${m} (${p})`).join(", ") || null],
      ["failures", (n) => n.failures],
      ["ejections", (n) => n.ejections],
      ["up_p50", (n) => L.seconds(n.upstream.p50_s)],
      ["up_p99", (n) => L.seconds(n.upstream.p99_s)],
    ]);
    L.table(document.querySelector("#models tbody"), s.models, [
      ["name", (m) => m.name],
      ["nodes", (m) => m.nodes],
      ["permits", (m) => m.permits],
      ["in_use", (m) => m.in_use],
      ["queued", (m) => m.queued],
      [
        "shed",
        (m) => ({
          text: String(total(m.shed)),
          title: Object.entries(m.shed).map(([r, n]) => `${r}: ${n}`).join(", "),
        }),
      ],
    ]);
  }

  function plots(s) {
    const tenants = s.tenants.map((tn) => tn.name);
    const nodes = s.nodes.map((n) => n.url);
    const by = (prefix, names) => names.map((n) => ({ key: prefix + n, label: n, color: L.stroke(n) }));
    charts.tokens.update(history, by("tok:", tenants));
    charts.queued.update(history, by("queued:", tenants));
    charts.shed.update(history, by("shed:", tenants));
    charts.rtt.update(history, by("rtt:", nodes));
    charts.inflight.update(history, by("inflight:", nodes));
  }

  L.connect("/v1/dashboard/events", onSnapshot, $("status"));
})();
