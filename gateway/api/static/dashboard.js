// The toolkv dashboard: polls /v1/dashboard/stats and renders the totals, the TTFT chart, the
// tool-group table and the pinned groups with their budget (on a Ray Serve ingress, also one row
// per replica, and the totals are the fleet's); the playground streams /v1/chat/completions with
// and without the cache.
// No dependencies, no build step: served as is from the gateway package.
(() => {
  "use strict";

  const POLL_MS = 2000;
  const SVG_NS = "http://www.w3.org/2000/svg";
  const BYPASS_HEADER = "X-Toolkv-Cache";
  const $ = (id) => document.getElementById(id);

  const EXAMPLE_TOOLS = [
    {type: "function", function: {
      name: "get_weather", description: "Get the current weather for a city.",
      parameters: {type: "object", properties: {
        city: {type: "string", description: "City name, e.g. Paris"},
        unit: {type: "string", enum: ["celsius", "fahrenheit"]}}, required: ["city"]}}},
    {type: "function", function: {
      name: "search_flights", description: "Search one-way flights between two airports on a date.",
      parameters: {type: "object", properties: {
        origin: {type: "string", description: "IATA code of the departure airport"},
        destination: {type: "string", description: "IATA code of the arrival airport"},
        date: {type: "string", description: "Departure date, YYYY-MM-DD"}},
        required: ["origin", "destination", "date"]}}},
    {type: "function", function: {
      name: "create_calendar_event", description: "Create an event in the user's calendar.",
      parameters: {type: "object", properties: {
        title: {type: "string"}, start: {type: "string", description: "ISO 8601 start time"},
        duration_minutes: {type: "integer", minimum: 1}}, required: ["title", "start"]}}},
  ];

  // ---- formatting ------------------------------------------------------------------------------

  const fmt = {
    pct: (x) => (x == null ? "—" : `${(100 * x).toFixed(1)}%`),
    int: (x) => (x == null ? "—" : Math.round(x).toLocaleString("en-US")),
    mean: (x) => (x == null ? "—" : x.toFixed(1)),
    ms(x) {
      if (x == null || !isFinite(x)) return "—";
      if (x === 0) return "0 ms";
      if (x >= 100000) return `${Math.round(x / 1000)} s`;
      if (x >= 1000) return `${(x / 1000).toFixed(x >= 10000 ? 1 : 2)} s`;
      return x < 10 ? `${x.toFixed(1)} ms` : `${Math.round(x)} ms`;
    },
    bytes(n) {
      const units = ["B", "KiB", "MiB", "GiB", "TiB"];
      let i = 0;
      while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
      return `${i ? n.toFixed(1) : Math.round(n)} ${units[i]}`;
    },
    ago(t) {
      const s = Math.max(0, Date.now() / 1000 - t);
      if (s < 60) return `${Math.round(s)} s ago`;
      return s < 3600 ? `${Math.round(s / 60)} min ago` : `${(s / 3600).toFixed(1)} h ago`;
    },
    clock: (t) => new Date(t * 1000).toLocaleTimeString("en-GB"),
  };

  const plural = (n, one, many = `${one}s`) => `${fmt.int(n)} ${n === 1 ? one : many}`;
  const sum = (obj) => Object.values(obj || {}).reduce((a, b) => a + b, 0);

  // ---- polling ---------------------------------------------------------------------------------

  let inFlight = null;
  let timer = null;

  class Locked extends Error {}

  function authHeaders() {
    const key = $("api-key").value.trim();
    return key ? {Authorization: `Bearer ${key}`} : {};
  }

  async function fetchStats() {
    const resp = await fetch("/v1/dashboard/stats", {cache: "no-store", headers: authHeaders()});
    if (resp.status === 401 || resp.status === 403) throw new Locked(await errorMessage(resp));
    if (!resp.ok) throw new Error(`stats: HTTP ${resp.status}`);
    return resp.json();
  }

  function poll() {
    if (inFlight) return inFlight;
    clearTimeout(timer);
    inFlight = fetchStats()
      .then(render, (err) => setStatus(err instanceof Locked ? "locked" : "unreachable"))
      .finally(() => { inFlight = null; timer = setTimeout(poll, POLL_MS); });
    return inFlight;
  }

  async function refresh() {  // fresh numbers now, not those of a poll already under way
    if (inFlight) await inFlight;
    return poll();
  }

  function setStatus(status) {
    const pill = $("status");
    pill.dataset.status = status;
    pill.textContent = {ok: "ready", loading: "model loading…", degraded: "some replicas are down",
      locked: "enter the admin key to see the numbers"}[status] || status;
  }

  function render(stats) {
    setStatus(stats.status);
    $("model").textContent = `model: ${stats.model || "…"}`;
    $("updated").textContent = `updated ${fmt.clock(Date.now() / 1000)}`;
    renderTotals(stats.totals);
    renderReplicas(stats.replicas);
    renderEngine(stats.engine);
    renderLatestTtft(stats.ttft_windows);
    renderChart(stats.ttft_windows, stats.window_s, stats.ttft_ceiling_ms);
    renderGroups(stats.groups);
    renderPins(stats.pins);
  }

  function renderTotals(t) {
    const hits = t.lookups.hit || 0;
    const misses = t.lookups.miss || 0;
    $("hit-rate").textContent = fmt.pct(t.hit_rate);
    $("hit-detail").textContent = hits + misses
      ? `${plural(hits, "hit")}, ${plural(misses, "miss", "misses")}, ${fmt.int(t.lookups.bypass || 0)} bypassed`
      : "no lookups yet";
    $("cached-share").textContent = fmt.pct(t.cached_share);
    $("cached-detail").textContent = `${fmt.int(t.cached_tokens)} of ${fmt.int(t.prompt_tokens)} tokens`;
    $("requests-total").textContent = fmt.int(t.requests);
    $("requests-detail").textContent =
      `${fmt.int(t.errors)} errors, ${fmt.int(t.generated_tokens)} tokens generated`;
    $("cache-bytes").textContent = fmt.bytes(t.cache_bytes.ram || 0);
    $("cache-entries").textContent = plural(t.cache_entries.ram || 0, "entry", "entries");
  }

  function renderLatestTtft(windows) {
    for (const label of ["hit", "miss"]) {
      const latest = windows.filter((w) => w[label]).pop();
      $(`ttft-${label}`).textContent = latest ? fmt.ms(latest[label].p50_ms) : "—";
    }
  }

  // ---- replicas (Ray Serve ingress only) ---------------------------------------------------------

  function renderReplicas(replicas) {
    const fleet = Array.isArray(replicas);
    $("replicas").hidden = !fleet;
    $("groups-replica").hidden = !fleet;
    $("pinned-replica").hidden = !fleet;
    $("title-engine").textContent = fleet ? "Engines (all replicas)" : "Engine";
    if (!fleet) return;
    const up = replicas.filter((r) => r.status === "ok").length;
    $("replicas-summary").textContent = `${up} of ${plural(replicas.length, "replica")} serving`;
    $("replica-table").tBodies[0].replaceChildren(...replicas.map(replicaRow));
  }

  function replicaRow(r) {
    const row = document.createElement("tr");
    row.dataset.replica = r.name;
    const cells = [
      [r.name, "mono", "name"], [r.status === "ok" ? "up" : `down (${r.status})`, `replica-${r.status}`, "status"],
      [fmt.int(r.in_flight), "num", "in-flight"], [fmt.int(r.requests), "num", "requests"],
      [fmt.int(r.lookups.hit || 0), "num", "hits"], [fmt.int(r.lookups.miss || 0), "num", "misses"],
      [fmt.pct(r.hit_rate), "num", "hit-rate"], [fmt.int(r.cache_entries.ram || 0), "num", "ram-entries"],
      [fmt.int(r.cache_entries.disk || 0), "num", "disk-entries"],
    ];
    for (const [text, cls, name] of cells) {
      const cell = document.createElement("td");
      cell.textContent = text;
      cell.className = cls;
      cell.dataset.field = name;
      row.append(cell);
    }
    return row;
  }

  // ---- engine ----------------------------------------------------------------------------------

  function renderEngine(e) {
    const set = (id, text) => { $(id).textContent = text; };
    if (!e) return;  // no engine before the model has loaded: the page's dashes stay
    set("engine-running", fmt.int(e.running));
    set("engine-waiting", fmt.int(e.waiting));
    set("engine-steps", fmt.int(e.steps));
    set("engine-batch-last", fmt.int(e.batch_size.last));
    set("engine-batch-mean", fmt.mean(e.batch_size.mean));
    set("engine-tokens-last", fmt.int(e.tokens_per_step.last));
    set("engine-tokens-mean", fmt.mean(e.tokens_per_step.mean));
    set("engine-preemptions", fmt.int(e.preemptions));
    const prefix = e.prefix_cache;
    set("engine-prefix-rate", fmt.pct(prefix.hit_rate));
    set("engine-prefix-detail", prefix.queries_tokens
      ? `${fmt.int(prefix.hits_tokens)} of ${fmt.int(prefix.queries_tokens)} tokens` : "no tokens looked up yet");
    const kv = e.kv_blocks;
    set("engine-kv-used", fmt.int(kv.used));
    set("engine-kv-cached", fmt.int(kv.cached));
    set("engine-kv-free", fmt.int(kv.free));
    set("engine-kv-total", fmt.int(kv.total));
    set("engine-kv-block-tokens", kv.block_tokens ? ` × ${plural(kv.block_tokens, "token")}` : "");
    set("engine-kv-usage", kv.used > 0 && e.kv_usage < 0.001 ? "<0.1%" : fmt.pct(kv.total ? e.kv_usage : null));
    renderKvBar(kv.total ? kv : null);
  }

  // Sequences' blocks, then cached prefixes' blocks; the rest of the bar is free. A share too small
  // for a pixel (a few blocks of a large pool) still shows, 2px wide.
  function renderKvBar(kv) {
    const share = (n) => (kv && n > 0 ? `max(2px, ${(100 * Math.min(n / kv.total, 1)).toFixed(2)}%)` : "0px");
    $("engine-kv-bar-seq").style.width = share(kv ? kv.used - kv.cached : 0);
    $("engine-kv-bar-cached").style.width = share(kv ? kv.cached : 0);
    $("engine-kv-bar").dataset.usage = kv ? String(kv.used / kv.total) : "";
    $("engine-kv-bar").title = kv
      ? `${fmt.int(kv.used - kv.cached)} blocks held by sequences, ${fmt.int(kv.cached)} by cached prefixes, ` +
        `${fmt.int(kv.free)} free` : "no KV block pool reported";
  }

  // ---- chart -----------------------------------------------------------------------------------

  const CHART = {width: 800, height: 240, left: 64, right: 12, top: 12, bottom: 26};
  const SERIES = [["hit", "p50_ms"], ["hit", "p95_ms"], ["miss", "p50_ms"], ["miss", "p95_ms"]];

  function svg(name, attrs, text) {
    const node = document.createElementNS(SVG_NS, name);
    for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
    if (text != null) node.textContent = text;
    return node;
  }

  // `ceiling` (the server's ttft_ceiling_ms) is the highest point that is not an outlier: the axis
  // stops there, and a point above it is drawn at the top, marked with its value, instead of
  // squashing every other point against the axis. Without it the axis reaches the highest point.
  function renderChart(windows, windowS, ceiling) {
    const chart = $("ttft-chart");
    const points = windows.filter((w) => w.hit || w.miss);
    chart.replaceChildren();
    chart.dataset.points = String(points.length);
    let note = `One point per ${windowS} s window; p50/p95 from the TTFT histogram.`;
    if (!points.length) {
      chart.dataset.clipped = "0";
      $("chart-note").textContent = note;
      chart.append(svg("text", {x: CHART.width / 2, y: CHART.height / 2, "text-anchor": "middle",
        class: "empty"}, "No hits or misses yet: send a request from the playground."));
      return;
    }
    const scale = chartScale(points, windowS, ceiling);
    drawAxes(chart, scale);
    let clipped = 0;
    for (const [label, field] of SERIES) clipped += drawSeries(chart, scale, points, label, field, windowS);
    chart.dataset.clipped = String(clipped);
    if (clipped) note += ` ${plural(clipped, "point")} above the axis, drawn at its top (▲, hover for the value).`;
    $("chart-note").textContent = note;
  }

  function chartScale(points, windowS, ceiling) {
    const now = Date.now() / 1000;
    const tMax = Math.max(now, points[points.length - 1].t + windowS);
    const tMin = Math.min(points[0].t, tMax - 300);
    const peak = Math.max(...points.flatMap((w) => ["hit", "miss"].map((l) => (w[l] ? w[l].p95_ms : 0))));
    const top = ceiling != null && isFinite(ceiling) ? Math.min(ceiling, peak) : peak;
    const yMax = niceCeil(top * 1.1 || 1);
    const {width, height, left, right, bottom} = CHART;
    return {
      tMin, tMax, yMax,
      x: (t) => left + ((t - tMin) / (tMax - tMin)) * (width - left - right),
      y: (v) => height - bottom - (Math.min(v, yMax) / yMax) * (height - CHART.top - bottom),
    };
  }

  function niceCeil(v) {
    const step = 10 ** Math.floor(Math.log10(v));
    return [1, 2, 2.5, 5, 10].map((m) => m * step).find((c) => c >= v);
  }

  function drawAxes(chart, s) {
    for (let i = 0; i <= 4; i += 1) {
      const v = (s.yMax * i) / 4;
      chart.append(svg("line", {x1: CHART.left, x2: CHART.width - CHART.right, y1: s.y(v), y2: s.y(v),
        class: "grid"}));
      chart.append(svg("text", {x: CHART.left - 6, y: s.y(v) + 4, "text-anchor": "end", class: "axis"},
        fmt.ms(v)));
    }
    const ticks = [[s.tMin, "start"], [(s.tMin + s.tMax) / 2, "middle"], [s.tMax, "end"]];
    for (const [t, anchor] of ticks) {
      chart.append(svg("text", {x: s.x(t), y: CHART.height - 6, "text-anchor": anchor, class: "axis"},
        fmt.clock(t)));
    }
  }

  // Returns how many of its points were above the axis (drawn at the top as a marked triangle).
  function drawSeries(chart, s, points, label, field, windowS) {
    const own = points.filter((w) => w[label]);
    if (!own.length) return 0;
    const xy = own.map((w) => [s.x(w.t + windowS / 2), s.y(w[label][field])]);
    const kind = field.slice(0, 3);
    chart.append(svg("polyline", {points: xy.map((p) => p.join(",")).join(" "),
      class: `series ${label} ${kind}`}));
    let clipped = 0;
    own.forEach((w, i) => {
      const value = w[label][field];
      const title = svg("title", {}, `${fmt.clock(w.t)} ${label} ${kind}: ${fmt.ms(value)}` +
        ` (${w[label].count} requests)` + (value > s.yMax ? ", above the axis" : ""));
      const [x, y] = xy[i];
      if (value > s.yMax) {
        clipped += 1;
        // coloured by class (dashboard.css): the page's CSP (style-src 'self') refuses style attributes
        const mark = svg("polygon", {points: `${x - 5},${y + 6} ${x + 5},${y + 6} ${x},${y - 3}`,
          class: `${label} clipped`});
        mark.append(title);
        chart.append(mark);
        chart.append(svg("text", {x: x + 7, y: y + 8, class: `axis clipped ${label}`}, fmt.ms(value)));
        return;
      }
      const dot = svg("circle", {cx: x, cy: y, r: 3, class: label});
      dot.append(title);
      chart.append(dot);
    });
    return clipped;
  }

  // ---- tool groups -----------------------------------------------------------------------------

  function renderGroups(groups) {
    const body = $("groups").tBodies[0];
    body.replaceChildren(...groups.map(groupRow));
    $("groups-empty").hidden = groups.length > 0;
  }

  // The first eight names, and how many more.
  const toolList = (names) => names.slice(0, 8).join(", ") + (names.length > 8 ? ` +${names.length - 8} more` : "");

  function groupRow(g) {
    const cells = [
      [g.group_id.slice(0, 12), "mono", g.group_id], [toolList(g.tool_names), "tools", g.tool_names.join(", ")],
      [fmt.int(g.num_tokens), "num"], [fmt.bytes(g.num_bytes), "num"], [fmt.int(g.hits), "num"],
      [g.pinned ? `${g.tier}, pinned` : g.tier, g.pinned ? "pinned" : ""],
      ...(g.replica === undefined ? [] : [[g.replica, "mono"]]), [fmt.ago(g.last_used_at), ""],
    ];
    return tableRow(cells);
  }

  function tableRow(cells) {
    const row = document.createElement("tr");
    for (const [text, cls, title] of cells) {
      const cell = document.createElement("td");
      cell.textContent = text;
      if (cls) cell.className = cls;
      if (title) cell.title = title;
      row.append(cell);
    }
    return row;
  }

  // ---- pinned groups ---------------------------------------------------------------------------

  // `pins` is null before the model has loaded: the dashes stay.
  function renderPins(pins) {
    if (!pins) return;
    $("pinned-bytes").textContent = fmt.bytes(pins.pinned_bytes);
    $("pinned-detail").textContent =
      `of ${fmt.bytes(pins.pinned_budget_bytes)} budget, ${plural(pins.groups.length, "group")}`;
    $("pinned-groups").tBodies[0].replaceChildren(...pins.groups.map(pinnedRow));
    $("pinned-empty").hidden = pins.groups.length > 0;
  }

  // A group removed since it was pinned has only its entry id.
  function pinnedRow(p) {
    return tableRow([
      [(p.group_id || p.id).slice(0, 12), "mono", p.group_id || p.id],
      [toolList(p.tool_names) || "—", "tools", p.tool_names.join(", ")], [fmt.int(p.num_tokens), "num"],
      [fmt.bytes(p.num_bytes), "num"], [p.tier || "gone", ""],
      ...(p.replica === undefined ? [] : [[p.replica, "mono"]]),
    ]);
  }

  // ---- playground: requests --------------------------------------------------------------------

  function readTools() {
    const raw = $("play-tools").value.trim();
    if (!raw) return [];
    let parsed;
    try { parsed = JSON.parse(raw); } catch (err) { throw new Error(`Tools are not valid JSON: ${err.message}`); }
    if (parsed && !Array.isArray(parsed) && Array.isArray(parsed.tools)) parsed = parsed.tools;
    if (!Array.isArray(parsed)) throw new Error("Tools must be a JSON array of tools (or {\"tools\": [...]}).");
    return parsed.map((t) => (t && t.type ? t : {type: "function", function: t}));
  }

  function requestBody() {
    const message = $("play-message").value.trim();
    if (!message) throw new Error("Write a message to send.");
    const tools = readTools();
    const body = {messages: [{role: "user", content: message}], temperature: 0, stream: true,
      stream_options: {include_usage: true}, max_tokens: Number($("play-max-tokens").value) || 64};
    if (tools.length) body.tools = tools;
    return body;
  }

  async function* sseEvents(resp) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) return;
      buffer = (buffer + decoder.decode(value, {stream: true})).replace(/\r\n/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const lines = buffer.slice(0, cut).split("\n").filter((l) => l.startsWith("data:"));
        buffer = buffer.slice(cut + 2);
        const data = lines.map((l) => l.slice(5).trimStart()).join("\n");
        if (data === "[DONE]") return;
        if (data) yield JSON.parse(data);
      }
    }
  }

  async function errorMessage(resp) {
    try {
      const body = await resp.json();
      return `HTTP ${resp.status}: ${body.error ? body.error.message : JSON.stringify(body)}`;
    } catch {
      return `HTTP ${resp.status}`;
    }
  }

  async function streamCompletion(body, bypass, onUpdate) {
    const headers = {"Content-Type": "application/json", ...authHeaders()};
    if (bypass) headers[BYPASS_HEADER] = "bypass";
    const started = performance.now();
    const resp = await fetch("/v1/chat/completions", {method: "POST", headers, body: JSON.stringify(body)});
    if (!resp.ok) throw new Error(await errorMessage(resp));
    const out = {ttftMs: null, totalMs: null, usage: null, content: "", calls: []};
    for await (const chunk of sseEvents(resp)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) out.usage = chunk.usage;
      for (const choice of chunk.choices || []) applyDelta(out, choice.delta || {}, started);
      onUpdate(out);
    }
    out.totalMs = performance.now() - started;
    if (out.ttftMs == null) out.ttftMs = out.totalMs;
    return out;
  }

  function applyDelta(out, delta, started) {
    const calls = delta.tool_calls || [];
    if (out.ttftMs == null && (delta.content || calls.length)) out.ttftMs = performance.now() - started;
    if (delta.content) out.content += delta.content;
    for (const call of calls) {
      const slot = out.calls[call.index] || (out.calls[call.index] = {name: "", arguments: ""});
      if (call.function && call.function.name) slot.name = call.function.name;
      if (call.function && call.function.arguments) slot.arguments += call.function.arguments;
    }
  }

  const answerText = (out) =>
    [out.content, ...out.calls.filter(Boolean).map((c) => `→ ${c.name}(${c.arguments})`)].filter(Boolean).join("\n");

  // ---- playground: panels ----------------------------------------------------------------------

  const field = (panel, name) => panel.querySelector(`[data-field="${name}"]`);

  function resetPanel(panel, state) {
    panel.dataset.state = state;
    for (const dd of panel.querySelectorAll("dd")) dd.textContent = "—";
    field(panel, "answer").textContent = "";
    const badge = field(panel, "result");
    if (badge) { badge.textContent = ""; delete badge.dataset.result; }
  }

  function fillPanel(panel, out) {
    const usage = out.usage || {};
    const details = usage.prompt_tokens_details || {};
    field(panel, "ttft").textContent = fmt.ms(out.ttftMs);
    field(panel, "cached").textContent = fmt.int(details.cached_tokens ?? 0);
    field(panel, "prompt").textContent = fmt.int(usage.prompt_tokens);
    field(panel, "completion").textContent = fmt.int(usage.completion_tokens);
    field(panel, "total").textContent = fmt.ms(out.totalMs);
    field(panel, "answer").textContent = answerText(out) || "(empty answer)";
  }

  async function lookupCounts() {
    try { return (await fetchStats()).totals.lookups; } catch { return null; }
  }

  // The one lookup result that grew by one during the run, if the server saw no other traffic.
  function lookupResult(before, after) {
    if (!before || !after) return null;
    const grown = Object.keys(after).filter((k) => (after[k] || 0) > (before[k] || 0));
    const total = sum(after) - sum(before);
    return grown.length === 1 && total === 1 ? grown[0] : null;
  }

  async function runPanel(panel, body, bypass) {
    resetPanel(panel, "running");
    const before = bypass ? null : await lookupCounts();
    try {
      const out = await streamCompletion(body, bypass, (partial) => {
        field(panel, "answer").textContent = answerText(partial);
      });
      fillPanel(panel, out);
      if (!bypass) showResult(panel, lookupResult(before, await lookupCounts()));
      panel.dataset.state = "done";
      return out;
    } catch (err) {
      field(panel, "answer").textContent = err.message;
      panel.dataset.state = "error";
      return null;
    }
  }

  function showResult(panel, result) {
    if (!result) return;
    const badge = field(panel, "result");
    badge.dataset.result = result;
    badge.textContent = {hit: "cache hit", miss: "miss: prefix compiled and stored",
      skip: "prefix too short to cache"}[result] || result;
  }

  async function onSend(event) {
    event.preventDefault();
    const error = $("play-error");
    error.textContent = "";
    let body;
    try { body = requestBody(); } catch (err) { error.textContent = err.message; return; }
    const button = $("play-send");
    button.disabled = true;
    $("play-compare-note").textContent = "";
    try {
      const cached = await runPanel($("run-cache"), body, false);
      const compare = $("play-compare").checked;
      if (!compare) resetPanel($("run-bypass"), "skipped");
      const plain = compare ? await runPanel($("run-bypass"), body, true) : null;
      if (cached && plain) {
        $("play-compare-note").textContent = answerText(cached) === answerText(plain)
          ? "Same answer with and without the cache (greedy decoding)."
          : "The answers differ.";
      }
    } finally {
      button.disabled = false;
      await refresh();
    }
  }

  // ---- start -----------------------------------------------------------------------------------

  $("play-tools").value = JSON.stringify(EXAMPLE_TOOLS, null, 2);
  $("play-form").addEventListener("submit", onSend);
  $("api-key").addEventListener("change", refresh);
  poll();
})();
