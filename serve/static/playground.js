// specray playground: streams a completion with stream_options.include_speculation and
// draws every step — accepted drafts, the target's own token, rejected drafts — as it
// arrives. Plain browser JavaScript: no libraries, no build step, nothing from a CDN.
"use strict";

(() => {
  // Every URL is relative to where the app is mounted (a Serve route prefix, or "/").
  const BASE = location.pathname.replace(/\/playground\/?$/, "/");
  const KEY_STORE = "specray-api-key";
  const FADE_MS = 1600; // rejected drafts fade, then hide (hover a step to see them again)
  const SVG = "http://www.w3.org/2000/svg";
  const $ = (sel, root = document) => root.querySelector(sel);

  const state = { key: sessionStorage.getItem(KEY_STORE) || "", model: null, methods: [] };

  // -- talking to the server ------------------------------------------------------------
  let keyWaiters = [];

  function askForKey(message) {
    $("#key-message").textContent = message;
    $("#key-box").hidden = false;
    $("#api-key").focus();
    return new Promise((resolve) => keyWaiters.push(resolve));
  }

  $("#key-box").addEventListener("submit", (event) => {
    event.preventDefault();
    state.key = $("#api-key").value.trim();
    sessionStorage.setItem(KEY_STORE, state.key);
    $("#key-box").hidden = true;
    const waiting = keyWaiters;
    keyWaiters = [];
    waiting.forEach((resolve) => resolve());
  });

  async function errorMessage(response) {
    const text = await response.text();
    try {
      const err = JSON.parse(text).error;
      if (err && err.message) return `${response.status}: ${err.message}`;
    } catch (_) { /* not OpenAI's error JSON */ }
    return `${response.status} ${response.statusText} ${text.slice(0, 300)}`.trim();
  }

  // fetch with the API key; a 401 asks for the key and tries again.
  async function request(path, init = {}) {
    for (;;) {
      const headers = Object.assign({}, init.headers);
      if (state.key) headers.Authorization = `Bearer ${state.key}`;
      const response = await fetch(BASE + path, Object.assign({}, init, { headers }));
      if (response.status !== 401) return response;
      const why = await errorMessage(response);
      await askForKey(`This server needs an API key${state.key ? " (that one was refused)" : ""}. ${why}`);
    }
  }

  // Server-sent events of a streamed response: calls onData with each parsed data line.
  async function readEvents(response, onData) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      buffer += decoder.decode(value || new Uint8Array(), { stream: !done });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of block.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") return;
          onData(JSON.parse(data));
        }
      }
      if (done) return;
    }
  }

  function showError(message) {
    const box = $("#error");
    box.textContent = message;
    box.hidden = !message;
  }

  async function loadMethods() {
    const response = await request("playground/methods");
    if (!response.ok) throw new Error(await errorMessage(response));
    const data = await response.json();
    state.model = data.model;
    state.methods = data.methods;
    $("#model").textContent = `model: ${data.model}`;
    panels.forEach((panel) => panel.fillMethods());
    if (data.online_learning && !state.polling) {
      state.polling = true;
      pollLearning().catch(() => {});
    }
  }

  // -- one run: its settings, its streamed text, its counters -----------------------------
  function element(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  class Panel {
    constructor(label, preferred) {
      this.label = label;
      this.preferred = preferred; // default methods, first available wins
      this.root = $("#run-template").content.firstElementChild.cloneNode(true);
      this.root.id = `run-${label.toLowerCase()}`;
      $(".label", this.root).textContent = label;
      this.out = $(".completion", this.root);
      $(".method", this.root).addEventListener("change", () => this.syncFields());
      $("#runs").append(this.root);
      this.reset("", "completion");
    }

    field(name) { return $(`.${name}`, this.root); }

    fillMethods() {
      const select = this.field("method");
      select.innerHTML = "";
      for (const m of state.methods) {
        const option = new Option(m.available ? m.name : `${m.name} (not loaded)`, m.name);
        option.disabled = !m.available;
        option.title = m.available ? "" : `needs ${m.requirement}`;
        select.append(option);
      }
      const usable = (name) => state.methods.some((m) => m.name === name && m.available);
      select.value = this.preferred.find(usable) || "none";
      this.syncFields();
    }

    method() { return state.methods.find((m) => m.name === this.field("method").value); }

    syncFields() {
      const m = this.method();
      this.field("k-field").hidden = !(m && m.k);
      const trees = m ? m.trees : [];
      const tree = this.field("tree");
      tree.innerHTML = "";
      tree.append(new Option("default", ""));
      trees.forEach((name) => tree.append(new Option(name, name)));
      this.field("tree-field").hidden = trees.length === 0;
      // Options beyond k and the tree: the method's own, its first ones at their defaults as the example.
      const options = this.field("options");
      options.placeholder = m ? m.example : "";
      const own = m ? m.options.filter((name) => name !== "num_speculative_tokens" && name !== "tree") : [];
      options.title = own.length ? `options of ${m.name}: ${own.join(", ")}` : "";
      this.field("options-field").hidden = !m || !m.example;
    }

    speculation() {
      const m = this.method();
      const spec = { method: m.name };
      const k = this.field("k").value;
      if (m.k && k) spec.num_speculative_tokens = Number(k);
      const tree = this.field("tree").value;
      if (m.trees.length && tree) spec.tree = tree;
      const extra = this.field("options").value.trim();
      if (extra) {
        let options;
        try { options = JSON.parse(extra); } catch (e) { throw new Error(`options must be a JSON object: ${e.message}`); }
        Object.assign(spec, options);
      }
      return spec;
    }

    describe() {
      const spec = this.speculation();
      const extras = Object.entries(spec).filter(([name]) => name !== "method")
        .map(([name, value]) => `${name === "num_speculative_tokens" ? "k" : name}=${JSON.stringify(value)}`);
      return [spec.method, ...extras].join(" ");
    }

    reset(prompt, mode) {
      this.out.innerHTML = "";
      if (prompt && mode === "completion") this.out.append(element("span", "prompt", prompt));
      this.tokens = 0;
      this.steps = 0;
      this.drafts = 0;
      this.accepted = 0;
      this.lineDrafted = 0;
      this.posDrafted = [];
      this.posAccepted = [];
      this.t0 = performance.now();
      this.elapsed = 0;
      this.root.dataset.state = "idle";
      const err = $(".run-error", this.root);
      err.hidden = true;
      err.textContent = "";
      this.updateStats();
    }

    async run(prompt, mode, maxTokens) {
      this.reset(prompt, mode);
      const body = {
        model: state.model,
        max_tokens: maxTokens,
        temperature: Number(this.field("temperature").value || 0),
        stream: true,
        stream_options: { include_usage: true, include_speculation: true },
        speculation: this.speculation(),
      };
      if (mode === "chat") body.messages = [{ role: "user", content: prompt }];
      else body.prompt = prompt;
      this.root.dataset.state = "running";
      this.t0 = performance.now();
      const path = mode === "chat" ? "v1/chat/completions" : "v1/completions";
      const response = await request(path, {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      });
      if (!response.ok) throw new Error(await errorMessage(response));
      await readEvents(response, (data) => this.onData(data));
      this.elapsed = (performance.now() - this.t0) / 1000;
      this.updateStats();
      this.root.dataset.state = "done";
      return { label: this.label, setting: this.describe(), tokens: this.tokens, seconds: this.elapsed,
               tps: this.tokens / Math.max(this.elapsed, 1e-9), text: this.text() };
    }

    fail(message) {
      this.root.dataset.state = "error";
      const err = $(".run-error", this.root);
      err.textContent = message;
      err.hidden = false;
    }

    text() {
      return Array.from(this.out.querySelectorAll(".tok:not(.rejected)"), (t) => t.textContent).join("");
    }

    onData(data) {
      if (data.error) throw new Error(`${data.error.code || ""}: ${data.error.message}`);
      for (const choice of data.choices || []) {
        if (choice.speculation) {
          choice.speculation.forEach((step) => this.addStep(step));
        } else {
          const text = choice.text !== undefined ? choice.text : (choice.delta && choice.delta.content) || "";
          if (text) this.out.append(element("span", "tok target", text)); // a server without events
        }
      }
      this.elapsed = (performance.now() - this.t0) / 1000;
      this.updateStats();
    }

    addStep(step) {
      const group = element("span", "step");
      const line = step.drafted.length;
      group.title = step.num_drafted
        ? `${step.method}: ${step.num_drafted} drafted, ${step.num_accepted} of ${line} accepted` +
          (step.rejected.length ? `, rejected: ${step.rejected.map((t) => JSON.stringify(t.text)).join(" ")}` : "")
        : `${step.method || "target"}: no draft this step`;
      for (const t of step.accepted) group.append(this.token(t, "accepted"));
      if (step.rejected.length) {
        // Shown, not part of the text: line breaks and tabs as symbols, so they take no lines.
        const shown = step.rejected.map((t) => t.text).join("").replace(/\n/g, "↵").replace(/\t/g, "⇥");
        const rejected = element("span", "tok rejected", shown);
        rejected.dataset.ids = step.rejected.map((t) => t.id).join(" ");
        group.append(rejected);
        setTimeout(() => rejected.classList.add("gone"), FADE_MS);
      }
      if (step.bonus) {
        const kind = !step.num_drafted ? "plain" : step.recovered ? "recovered" : "bonus";
        group.append(this.token(step.bonus, `target ${kind}`));
      }
      this.out.append(group);
      this.out.scrollTop = this.out.scrollHeight;

      this.steps += 1;
      this.tokens += step.accepted.length + (step.bonus ? 1 : 0);
      if (step.num_drafted > 0) {
        this.drafts += 1;
        this.accepted += step.num_accepted;
        this.lineDrafted += line;
        for (let i = 0; i < line; i++) {
          this.posDrafted[i] = (this.posDrafted[i] || 0) + 1;
          this.posAccepted[i] = (this.posAccepted[i] || 0) + (i < step.num_accepted ? 1 : 0);
        }
      }
    }

    token(t, kind) {
      const span = element("span", `tok ${kind}`, t.text);
      span.dataset.id = t.id;
      return span;
    }

    updateStats() {
      const set = (name, value) => { this.field(name).textContent = value; };
      set("stat-tokens", String(this.tokens));
      set("stat-steps", String(this.steps));
      set("stat-tps", this.elapsed > 0 ? (this.tokens / this.elapsed).toFixed(1) : "–");
      set("stat-time", this.elapsed > 0 ? `${this.elapsed.toFixed(2)} s` : "–");
      // vLLM's definition: 1 + accepted draft tokens per step that drafted.
      set("stat-mal", this.drafts ? (1 + this.accepted / this.drafts).toFixed(2) : "–");
      set("stat-acceptance", this.lineDrafted ? `${Math.round((100 * this.accepted) / this.lineDrafted)}%` : "–");
      this.drawChart();
    }

    drawChart() {
      const chart = this.field("chart");
      chart.innerHTML = "";
      const n = this.posDrafted.length;
      if (!n) {
        chart.append(svg("text", { x: 130, y: 48, "text-anchor": "middle" }, "no drafts yet"));
        return;
      }
      const [width, height, top, bottom, gap] = [260, 90, 12, 13, 3];
      const barWidth = Math.min(30, (width - gap * (n + 1)) / n);
      const full = height - top - bottom;
      for (let i = 0; i < n; i++) {
        const rate = this.posAccepted[i] / this.posDrafted[i];
        const x = gap + i * (barWidth + gap);
        chart.append(svg("rect", { class: "bar-bg", x, y: top, width: barWidth, height: full }));
        const bar = svg("rect", { class: "bar", x, y: top + full * (1 - rate), width: barWidth, height: full * rate });
        bar.append(svg("title", {}, `position ${i + 1}: ${this.posAccepted[i]} of ${this.posDrafted[i]} accepted`));
        chart.append(bar);
        chart.append(svg("text", { x: x + barWidth / 2, y: height - 2, "text-anchor": "middle" }, String(i + 1)));
        chart.append(svg("text", { x: x + barWidth / 2, y: top - 3, "text-anchor": "middle" }, `${Math.round(rate * 100)}%`));
      }
    }
  }

  // -- the page ---------------------------------------------------------------------------
  const panels = [new Panel("A", ["draft", "ngram", "none"]), new Panel("B", ["none"])];
  panels[1].root.hidden = true;

  $("#compare").addEventListener("change", (e) => { panels[1].root.hidden = !e.target.checked; });
  $("#keep-rejected").addEventListener("change", (e) => { $("#runs").classList.toggle("keep-rejected", e.target.checked); });
  $("#prompt").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) runAll(); });
  $("#run").addEventListener("click", () => runAll());

  async function runAll() {
    const button = $("#run");
    if (button.disabled) return;
    button.disabled = true;
    showError("");
    $("#verdict").hidden = true;
    try {
      if (!state.model) await loadMethods();
      const prompt = $("#prompt").value;
      const mode = $("#mode").value;
      const maxTokens = Number($("#max-tokens").value || 64);
      const active = $("#compare").checked ? panels : panels.slice(0, 1);
      const results = [];
      // One after the other: two runs at once would share the server's CPU and each other's steps.
      for (const panel of active) {
        try {
          results.push(await panel.run(prompt, mode, maxTokens));
        } catch (e) {
          panel.fail(e.message);
          showError(`${panel.label}: ${e.message}`);
          results.push(null);
        }
      }
      if (results.length === 2 && results.every(Boolean)) showVerdict(results);
    } catch (e) {
      showError(e.message);
    } finally {
      button.disabled = false;
    }
  }

  function showVerdict([a, b]) {
    const [fast, slow] = a.tps >= b.tps ? [a, b] : [b, a];
    const ratio = fast.tps / Math.max(slow.tps, 1e-9);
    const same = a.text === b.text ? "identical text" : "different text";
    $("#verdict").textContent =
      `${a.label} (${a.setting}): ${a.tps.toFixed(1)} tokens/s · ${b.label} (${b.setting}): ${b.tps.toFixed(1)} tokens/s` +
      ` — ${fast.label} is ${ratio.toFixed(2)}× faster; ${same} (run one after the other).`;
    $("#verdict").dataset.ratio = ratio.toFixed(3);
    $("#verdict").hidden = false;
  }

  // -- online learning: accepted length of served requests over time, as versions change ----
  const VERSION_COLORS = ["#888", "#2a7", "#37c", "#c73", "#a4c", "#c44", "#4aa"];

  function drawLearning(data) {
    $("#learning").hidden = false;
    const serving = Object.entries(data.serving || {}).map(([m, v]) => `${m}: ${v}`).join(", ");
    const trainer = (data.trainer && data.trainer.state) || "–";
    const last = (data.rounds || []).slice(-1)[0];
    const round = !last ? "no round yet" : last.error ? `last round of ${last.method} failed`
      : `last round of ${last.method}: ${last.version ? "published " + last.version : "kept " + last.kept}` +
        ` (candidate ${last.candidate.mean_accepted_length.toFixed(2)}, serving ${last.serving.mean_accepted_length.toFixed(2)})`;
    $("#learning-state").textContent =
      `learning ${data.learning} · serving ${serving || "–"} · trainer: ${trainer} · ${round}`;
    const points = data.served || [];
    const chart = $("#learning-chart");
    chart.replaceChildren();
    const versions = [...new Set(points.map((p) => p.version))];
    const color = (v) => VERSION_COLORS[versions.indexOf(v) % VERSION_COLORS.length];
    if (points.length) {
      const t0 = points[0].time, t1 = Math.max(points[points.length - 1].time, t0 + 1);
      const top = Math.max(2, ...points.map((p) => p.accepted_length));
      const x = (t) => 30 + (520 * (t - t0)) / (t1 - t0);
      const y = (a) => 145 - (130 * (a - 1)) / (top - 1);
      chart.append(svg("line", { x1: 30, y1: 145, x2: 550, y2: 145, stroke: "#bbb" }));
      chart.append(svg("text", { x: 2, y: y(top) + 4, "font-size": 10 }, top.toFixed(1)));
      chart.append(svg("text", { x: 2, y: 149, "font-size": 10 }, "1.0"));
      for (const p of points) {
        const dot = svg("circle", { cx: x(p.time), cy: y(p.accepted_length), r: 2.5, fill: color(p.version) });
        dot.append(svg("title", {}, `${p.version}: ${p.accepted_length}`));
        chart.append(dot);
      }
    }
    const list = $("#learning-versions");
    list.replaceChildren();
    for (const v of versions) {
      const tag = element("span", "version", v);
      tag.style.color = color(v);
      list.append(tag);
    }
  }

  async function pollLearning() {
    try {
      const response = await request("v1/drafters");
      if (response.ok) drawLearning(await response.json()); // else the section keeps what it showed
    } finally {
      setTimeout(() => pollLearning().catch(() => {}), 5000);
    }
  }

  loadMethods().catch((e) => showError(e.message));
})();
