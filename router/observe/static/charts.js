// pdserve dashboard charts: number formatting and LineChart, a small canvas line chart.
// No libraries. Loaded before dashboard.js, which owns the data and the page.
"use strict";

const HISTORY_POINTS = 300; // 5 minutes at one poll per second
const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2",
  "#db2777", "#4b5563", "#65a30d", "#9333ea"];

// ---- formatting -------------------------------------------------------------------------

function fmt(value) {
  if (value === null || value === undefined || !Number.isFinite(value)) return "–";
  const a = Math.abs(value);
  if (a >= 1e6) return (value / 1e6).toFixed(1) + "M";
  if (a >= 1e4) return (value / 1e3).toFixed(1) + "k";
  if (Number.isInteger(value)) return String(value);
  if (a >= 100) return value.toFixed(0);
  if (a >= 10) return value.toFixed(1);
  if (a >= 1) return value.toFixed(2);
  if (a === 0) return "0";
  return value.toPrecision(2);
}

function fmtDuration(seconds) {
  const s = Math.floor(seconds);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
  return h > 0 ? `${h} h ${m} min` : m > 0 ? `${m} min ${s % 60} s` : `${s} s`;
}

// A "nice" step (1, 2 or 5 times a power of ten) giving about `count` ticks over `range`.
function niceStep(range, count) {
  const raw = range / Math.max(1, count);
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  const unit = raw / power;
  return (unit <= 1 ? 1 : unit <= 2 ? 2 : unit <= 5 ? 5 : 10) * power;
}

// ---- LineChart ----------------------------------------------------------------------------

class LineChart {
  // opts: title, unit (y axis label), yMax (fixed top, e.g. 100 for percent), series: fixed
  // [{name, color, dash, reference}] shown before data arrives; other names get palette
  // colours. A reference series (an SLO target line) does not count as data.
  constructor(canvas, opts) {
    this.canvas = canvas;
    this.title = opts.title;
    this.unit = opts.unit;
    this.yMax = opts.yMax ?? null;
    this.series = new Map();
    for (const s of opts.series ?? []) {
      const color = s.color ?? PALETTE[this.series.size % PALETTE.length];
      this.series.set(s.name, { ...s, color, values: [] });
    }
    this.times = [];
    this.points = 0;
  }

  // values: {seriesName: number | null}; a missing or null value leaves a gap.
  push(time, values) {
    for (const name of Object.keys(values)) {
      if (!this.series.has(name)) {
        const color = PALETTE[this.series.size % PALETTE.length];
        this.series.set(name, { name, color, values: new Array(this.times.length).fill(null) });
      }
    }
    this.times.push(time);
    for (const s of this.series.values()) {
      const v = values[s.name];
      s.values.push(v === undefined || v === null || !Number.isFinite(v) ? null : v);
    }
    if (this.times.length > HISTORY_POINTS) {
      this.times.shift();
      for (const s of this.series.values()) s.values.shift();
    }
    this.points = this.times.filter((_, i) => this.anyValueAt(i)).length;
    this.canvas.dataset.points = String(this.points);
    this.draw();
  }

  anyValueAt(i) {
    for (const s of this.series.values()) if (!s.reference && s.values[i] !== null) return true;
    return false;
  }

  yTop() {
    if (this.yMax !== null) return this.yMax;
    let top = 0;
    for (const s of this.series.values()) for (const v of s.values) if (v !== null) top = Math.max(top, v);
    if (top <= 0) return 1;
    const step = niceStep(top * 1.1, 4);
    return Math.ceil((top * 1.1) / step) * step;
  }

  draw() {
    const dpr = window.devicePixelRatio || 1;
    const width = this.canvas.clientWidth || 440, height = this.canvas.clientHeight || 230;
    this.canvas.width = Math.round(width * dpr);
    this.canvas.height = Math.round(height * dpr);
    const g = this.canvas.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, width, height);
    const box = { left: 62, right: width - 12, top: 46, bottom: height - 34 };
    this.drawTitleAndLegend(g, width);
    const yTop = this.yTop();
    const span = this.timeSpan();
    this.drawAxes(g, box, yTop, span);
    for (const s of this.series.values()) this.drawSeries(g, box, s, yTop, span);
    if (this.points === 0) {
      g.fillStyle = "#8a96a3";
      g.font = "13px system-ui, sans-serif";
      g.textAlign = "center";
      g.fillText("waiting for data…", (box.left + box.right) / 2, (box.top + box.bottom) / 2);
    }
  }

  timeSpan() {
    const last = this.times.length ? this.times[this.times.length - 1] : 0;
    const first = this.times.length ? this.times[0] : 0;
    return { last, width: Math.max(30, last - first) }; // at least 30 s wide
  }

  drawTitleAndLegend(g, width) {
    g.fillStyle = "#1d2430";
    g.font = "600 14px system-ui, sans-serif";
    g.textAlign = "left";
    g.textBaseline = "alphabetic";
    g.fillText(this.title, 8, 18);
    g.font = "12px system-ui, sans-serif";
    let x = 8;
    const y = 36;
    for (const s of this.series.values()) {
      const latest = [...s.values].reverse().find((v) => v !== null);
      const label = `${s.name} ${fmt(latest)}`;
      const w = g.measureText(label).width + 26;
      if (x + w > width - 4) break; // legend full: the rest stays unlabelled
      g.fillStyle = s.color;
      g.fillRect(x, y - 9, 12, 10);
      g.fillStyle = "#3b4654";
      g.fillText(label, x + 16, y);
      x += w;
    }
  }

  drawAxes(g, box, yTop, span) {
    g.strokeStyle = "#d8dee6";
    g.fillStyle = "#5d6b7c";
    g.font = "11px system-ui, sans-serif";
    g.lineWidth = 1;
    const yStep = niceStep(yTop, 4);
    g.textAlign = "right";
    g.textBaseline = "middle";
    for (let v = 0; v <= yTop + yStep * 1e-9; v += yStep) {
      const y = box.bottom - (v / yTop) * (box.bottom - box.top);
      g.beginPath(); g.moveTo(box.left, y); g.lineTo(box.right, y); g.stroke();
      g.fillText(fmt(v), box.left - 6, y);
    }
    const xStep = niceStep(span.width, 5);
    g.textAlign = "center";
    g.textBaseline = "top";
    for (let ago = 0; ago <= span.width + 1e-9; ago += xStep) {
      const x = box.right - (ago / span.width) * (box.right - box.left);
      g.beginPath(); g.moveTo(x, box.bottom); g.lineTo(x, box.bottom + 4); g.stroke();
      g.fillText(ago === 0 ? "now" : `-${fmt(ago)}`, x, box.bottom + 6);
    }
    g.fillText("seconds ago", (box.left + box.right) / 2, box.bottom + 19);
    g.save();
    g.translate(14, (box.top + box.bottom) / 2);
    g.rotate(-Math.PI / 2);
    g.textBaseline = "middle";
    g.fillText(this.unit, 0, 0);
    g.restore();
    g.strokeStyle = "#9aa5b1";
    g.beginPath();
    g.moveTo(box.left, box.top); g.lineTo(box.left, box.bottom); g.lineTo(box.right, box.bottom);
    g.stroke();
  }

  drawSeries(g, box, s, yTop, span) {
    g.strokeStyle = s.color;
    g.fillStyle = s.color;
    g.lineWidth = 2;
    g.setLineDash(s.dash ? [6, 4] : []);
    g.beginPath();
    let pen = false, lone = null;
    for (let i = 0; i < s.values.length; i++) {
      const v = s.values[i];
      if (v === null) { pen = false; continue; }
      const x = box.right - ((span.last - this.times[i]) / span.width) * (box.right - box.left);
      const y = box.bottom - (Math.min(v, yTop) / yTop) * (box.bottom - box.top);
      if (pen) { g.lineTo(x, y); lone = null; } else { g.moveTo(x, y); lone = [x, y]; }
      pen = true;
    }
    g.stroke();
    g.setLineDash([]);
    if (lone) { g.beginPath(); g.arc(lone[0], lone[1], 2.5, 0, 2 * Math.PI); g.fill(); }
  }
}
