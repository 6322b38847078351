// ftkit studio's own script: live fragments, charts drawn on canvas, the chat stream. No outside assets.
"use strict";

const POLL_MS = 1000;
const GROUPS = [
  ["loss", ["loss", "eval_loss"]],
  ["learning rate", ["lr"]],
  ["tokens/s", ["tokens_per_s"]],
  ["memory (MB)", ["peak_mem_mb", "peak_reserved_mb"]],
];
// Numbers every run logs that are no curve worth a chart of their own.
const NOT_CHARTED = new Set(["tokens_seen", "skipped_steps", "tokens_per_s_per_device", "step_time_s",
  "data_wait_frac", "eval_ppl", "eval_tokens", "outside_allocator_mb"]);
const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];

function poll(el) {
  const refresh = async () => {
    try {
      const response = await fetch(el.dataset.poll, {cache: "no-store"});
      if (response.ok) {
        const checked = new Set([...el.querySelectorAll("input:checked")].map((i) => i.value));
        const open = new Set([...el.querySelectorAll("details[open] summary")].map((s) => s.textContent));
        el.innerHTML = await response.text();
        el.querySelectorAll("input[type=checkbox]").forEach((i) => { i.checked = checked.has(i.value); });
        el.querySelectorAll("details").forEach((d) => {
          if (open.size) d.open = open.has(d.querySelector("summary").textContent);
        });
      }
    } finally {
      setTimeout(refresh, POLL_MS);
    }
  };
  refresh();
}

function chartGroups(keys) {
  const groups = GROUPS.map(([title, members]) => [title, members.filter((k) => keys.has(k))]);
  const grouped = new Set(GROUPS.flatMap(([, members]) => members));
  for (const key of [...keys].sort()) {
    if (!grouped.has(key) && !NOT_CHARTED.has(key)) groups.push([key, [key]]);
  }
  return groups.filter(([, members]) => members.length);
}

function draw(canvas, title, lines) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = {l: 56, r: 10, t: 22, b: 22};
  ctx.clearRect(0, 0, w, h);
  const all = lines.flatMap((line) => line.points);
  ctx.fillStyle = "#111"; ctx.font = "13px sans-serif"; ctx.fillText(title, pad.l, 15);
  if (!all.length) return;
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y1 += Math.abs(y1) * 0.05 || 1; y0 -= Math.abs(y0) * 0.05 || 1; }
  const X = (x) => pad.l + (x - x0) / (x1 - x0) * (w - pad.l - pad.r);
  const Y = (y) => h - pad.b - (y - y0) / (y1 - y0) * (h - pad.t - pad.b);
  ctx.strokeStyle = "#ccc"; ctx.lineWidth = 1; ctx.beginPath();
  ctx.moveTo(pad.l, pad.t); ctx.lineTo(pad.l, h - pad.b); ctx.lineTo(w - pad.r, h - pad.b); ctx.stroke();
  ctx.fillStyle = "#555"; ctx.font = "11px sans-serif";
  for (const v of [y0, (y0 + y1) / 2, y1]) ctx.fillText(Number(v.toPrecision(3)).toString(), 4, Y(v) + 4);
  ctx.fillText(String(x0), pad.l, h - 6); ctx.fillText(String(x1), w - pad.r - 30, h - 6);
  lines.forEach((line, i) => {
    ctx.strokeStyle = ctx.fillStyle = line.color; ctx.lineWidth = 1.5; ctx.setLineDash(line.dash);
    ctx.beginPath();
    line.points.forEach(([x, y], j) => (j ? ctx.lineTo(X(x), Y(y)) : ctx.moveTo(X(x), Y(y))));
    ctx.stroke();
    ctx.setLineDash([]);
    if (line.points.length < 3) line.points.forEach(([x, y]) => ctx.fillRect(X(x) - 2, Y(y) - 2, 4, 4));
    ctx.fillText(line.label, w - pad.r - 190, pad.t + 12 * (i + 1));
  });
}

function charts(section) {
  const names = section.dataset.runs.split(",").filter(Boolean);
  const update = async () => {
    try {
      const results = await Promise.all(names.map(async (name) => {
        const response = await fetch(`/api/metrics/${encodeURIComponent(name)}`, {cache: "no-store"});
        return response.ok ? response.json() : {name, series: {}, records: 0};
      }));
      const keys = new Set(results.flatMap((r) => Object.keys(r.series)));
      for (const [title, members] of chartGroups(keys)) {
        const id = "chart-" + title.replace(/[^a-z0-9]+/gi, "-");
        let canvas = section.querySelector("#" + id);
        if (!canvas) {
          canvas = Object.assign(document.createElement("canvas"), {id, width: 460, height: 230});
          canvas.setAttribute("aria-label", title);
          section.appendChild(canvas);
        }
        // Several runs: a colour per run, the group's second metric dashed; one run: a colour per metric.
        const lines = results.flatMap((r, i) => members.filter((k) => r.series[k]).map((k) => ({
          label: names.length > 1 ? `${r.name}: ${k}` : k, points: r.series[k],
          color: COLORS[(names.length > 1 ? i : members.indexOf(k)) % COLORS.length],
          dash: names.length > 1 && members.indexOf(k) > 0 ? [5, 3] : []})));
        canvas.dataset.points = lines.length ? lines[0].points.length : 0;
        canvas.dataset.lines = lines.length;
        draw(canvas, title, lines);
      }
    } finally {
      setTimeout(update, POLL_MS);
    }
  };
  update();
}

function showAnswer(el, text) {
  el.replaceChildren();
  const parts = text.split(/(<tool_call>[\s\S]*?(?:<\/tool_call>|$))/);
  for (const part of parts) {
    if (!part) continue;
    const call = part.startsWith("<tool_call>");
    const span = document.createElement(call ? "code" : "span");
    if (call) span.className = "tool-call";
    span.textContent = call ? "tool call: " + part.replace(/<\/?tool_call>/g, "").trim() : part;
    el.appendChild(span);
  }
}

async function ask(form, side) {
  const model = form.elements[side].value;
  const out = document.getElementById("answer-" + side);
  if (!model) return;
  out.classList.add("streaming");
  const body = new FormData();
  body.set("model", model);
  body.set("prompt", form.elements.prompt.value);
  body.set("max_new_tokens", form.elements.max_new_tokens.value);
  const response = await fetch("/api/chat", {method: "POST", body});
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let text = response.ok ? "" : `[error] `;
  for (;;) {
    const {done, value} = await reader.read();
    if (done) break;
    text += decoder.decode(value, {stream: true});
    showAnswer(out, text);
  }
  showAnswer(out, text);
  out.classList.remove("streaming");
  out.dataset.done = "1";
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("[data-poll]").forEach(poll);
  document.querySelectorAll("section.charts[data-runs]").forEach(charts);
  document.querySelectorAll("form.delete").forEach((form) => form.addEventListener("submit", (event) => {
    const typed = window.prompt(`Delete ${form.dataset.confirm} and everything in its folder? Type its name:`);
    if (typed === null) { event.preventDefault(); return; }
    form.elements.confirm.value = typed;
  }));
  const chat = document.getElementById("chat");
  if (chat) chat.addEventListener("submit", (event) => {
    event.preventDefault();
    for (const side of ["left", "right"]) {
      const out = document.getElementById("answer-" + side);
      out.textContent = ""; delete out.dataset.done;
    }
    ask(chat, "left"); ask(chat, "right");
  });
});
