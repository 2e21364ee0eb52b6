"""report.html: report.md in one self-contained page, plus the per-query view.

Everything is inline (the plots as base64 PNG, the rank-change histogram as SVG, the styles,
the script and the per-query data as JSON), so the file opens from disk with no network and
no request leaves the page. The script is plain JavaScript: the query table sorts (click a
header) and filters (better, worse, same, top hits to review, a text search), and a click on
a query shows its detail: its metrics, its relevant documents with each model's rank and
score, and the two models' top hits side by side, with the texts. A print style sheet drops
the controls and prints the whole table.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
from pathlib import Path

from densefit.comparison import RANK_BUCKETS, QueryComparison

__all__ = ["markdown_to_html", "rank_change_svg", "write_html"]

TEXT_WIDTH = 600  # characters of a document kept in the page (the corpus has the rest)


def write_html(
    path: str | os.PathLike,
    markdown: str,
    comparison: QueryComparison | None,
    *,
    folder: str | os.PathLike,
) -> Path:
    """Write report.html: ``markdown`` (report.md, its images read from ``folder`` and
    inlined) with the per-query view after its "Per query" section."""
    path, folder = Path(path), Path(folder)
    body = markdown_to_html(markdown, folder)
    title = html.escape(markdown.splitlines()[0].lstrip("# ").strip() if markdown else "report")
    if comparison is not None:
        view = _per_query_view(comparison)
        marker = '<h2 id="training">'
        body = body.replace(marker, view + marker, 1) if marker in body else body + view
    data = "" if comparison is None else _data_script(comparison)
    page = _PAGE.format(title=title, style=_STYLE, body=body, data=data, script=_SCRIPT)
    path.write_text(page, encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- markdown


def markdown_to_html(markdown: str, folder: str | os.PathLike | None = None) -> str:
    """The markdown report.md is written in (headings, tables, paragraphs, images, code
    blocks, ``**bold**`` and ``code``) as HTML; an image under ``folder`` is inlined.

    >>> markdown_to_html("## Results\\n\\n| a | b |\\n|---|---|\\n| `x` | **1** |")
    '<h2 id="results">Results</h2>\\n<table><thead><tr><th>a</th><th>b</th></tr></thead><tbody><tr><td><code>x</code></td><td><strong>1</strong></td></tr></tbody></table>'
    """  # noqa: E501
    out: list[str] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif line.startswith("```"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            end = len(lines) if end is None else end
            out.append(f"<pre><code>{html.escape(chr(10).join(lines[i + 1 : end]))}</code></pre>")
            i = end + 1
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            text = line[level:].strip()
            slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
            out.append(f'<h{level} id="{slug}">{_inline(text)}</h{level}>')
            i += 1
        elif line.startswith("|"):
            end = i
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            out.append(_table(lines[i:end]))
            i = end
        elif (image := re.fullmatch(r"!\[([^\]]*)\]\(([^)]+)\)", line.strip())) is not None:
            out.append(_image(image.group(1), image.group(2), folder))
            i += 1
        else:
            end = i
            while end < len(lines) and lines[end].strip() and lines[end][0] not in "#|`!":
                end += 1
            end = max(end, i + 1)
            out.append(f"<p>{_inline(' '.join(lines[i:end]))}</p>")
            i = end
    return "\n".join(out)


def _inline(text: str) -> str:
    """Escape ``text``; then ``code`` and **bold**."""
    parts = re.split(r"(`[^`]*`)", text)
    out = []
    for part in parts:
        if len(part) >= 2 and part.startswith("`") and part.endswith("`"):
            out.append(f"<code>{html.escape(part[1:-1])}</code>")
        else:
            escaped = html.escape(part).replace("\\|", "|")
            out.append(re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", escaped))
    return "".join(out)


def _cells(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip())
    return [c.strip() for c in cells[1:-1]]


def _table(lines: list[str]) -> str:
    head, rows = _cells(lines[0]), [_cells(line) for line in lines[2:]]
    th = "".join(f"<th>{_inline(c)}</th>" for c in head)
    body = "".join(
        "<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _image(alt: str, src: str, folder: str | os.PathLike | None) -> str:
    file = Path(folder) / src if folder is not None else None
    if file is None or not file.is_file():
        return f"<p class='missing'>[{html.escape(alt)}: {html.escape(src)} not found]</p>"
    encoded = base64.b64encode(file.read_bytes()).decode("ascii")
    return (
        f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{encoded}">'
        f"<figcaption>{html.escape(alt)}</figcaption></figure>"
    )


# ----------------------------------------------------------------------------- per query


def rank_change_svg(counts: dict[str, int], width: int = 720, height: int = 230) -> str:
    """The rank-change distribution (:data:`~densefit.comparison.RANK_BUCKETS`) as an inline
    SVG bar chart: losses red, no change grey, wins green."""
    top, bottom, left = 18, 48, 8
    n = len(RANK_BUCKETS)
    slot = (width - 2 * left) / n
    peak = max(max(counts.values(), default=0), 1)
    parts = [
        f'<svg id="rank-changes" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} '
        f'{height}" role="img" aria-label="rank changes of the best relevant document">'
    ]
    for i, bucket in enumerate(RANK_BUCKETS):
        count = counts.get(bucket, 0)
        h = (height - top - bottom) * count / peak
        x = left + i * slot + slot * 0.12
        y = height - bottom - h
        kind = "loss" if bucket.startswith(("down", "left")) else "win"
        if bucket in ("same rank", "in neither top k"):
            kind = "same"
        parts.append(
            f'<rect class="bar {kind}" x="{x:.1f}" y="{y:.1f}" width="{slot * 0.76:.1f}" '
            f'height="{h:.1f}"><title>{bucket}: {count}</title></rect>'
            f'<text class="count" x="{x + slot * 0.38:.1f}" y="{y - 4:.1f}">{count}</text>'
        )
        words = bucket.split(" ")
        half = (len(words) + 1) // 2
        for line, label in enumerate((" ".join(words[:half]), " ".join(words[half:]))):
            parts.append(
                f'<text class="label" x="{x + slot * 0.38:.1f}" '
                f'y="{height - bottom + 16 + 13 * line}">{html.escape(label)}</text>'
            )
    parts.append("</svg>")
    return "".join(parts)


def _per_query_view(comparison: QueryComparison) -> str:
    s = comparison.summary
    base, new = (html.escape(n) for n in comparison.names)
    metric = html.escape(comparison.metric)
    columns = [
        ("query_id", "query", "text"),
        ("query", "text", "text"),
        ("base", f"{metric} {base}", "number"),
        ("new", f"{metric} {new}", "number"),
        ("delta", "delta", "number"),
        ("base_best_rank", f"best rank {base}", "number"),
        ("new_best_rank", f"best rank {new}", "number"),
        ("rank_change", "rank change", "number"),
    ]
    headers = "".join(
        f'<th data-key="{key}" data-type="{kind}" tabindex="0" aria-sort="none">{label}</th>'
        for key, label, kind in columns
    )
    filters = [
        ("all", f"all ({s['queries']})"),
        ("better", f"wins ({s['better']})"),
        ("worse", f"losses ({s['worse']})"),
        ("same", f"same ({s['same']})"),
        ("review", f"to review ({len(s['possible_missing_labels'])})"),
    ]
    buttons = "".join(
        f'<button type="button" data-filter="{key}"'
        f"{' class=active aria-pressed=true' if key == 'all' else ' aria-pressed=false'}>"
        f"{label}</button>"
        for key, label in filters
    )
    return f"""
<section id="per-query-view">
<h3 id="rank-change-histogram">Rank changes of the best relevant document</h3>
<p>How far the first relevant document moved from {base} to {new} (k = {s["depth"]} retrieved
per query; up is better).</p>
{rank_change_svg(s["rank_changes"])}
<h3 id="queries">Queries</h3>
<p class="hint">Click a header to sort, a query to see its documents and both models' top hits.
"To review": {new}'s top hit is unjudged and scores within {s["close"]:.0%} of the best judged
relevant document (a possible missing label).</p>
<div class="controls">{buttons}
<input id="search" type="search" placeholder="search query id or text" aria-label="search">
<span id="shown"></span></div>
<div class="table-scroll"><table id="queries-table"><thead><tr>{headers}</tr></thead>
<tbody></tbody></table></div>
<div id="detail" hidden></div>
</section>
"""


def _data_script(comparison: QueryComparison) -> str:
    texts = {
        d: t if len(t) <= TEXT_WIDTH else t[: TEXT_WIDTH - 1] + "…"
        for d, t in comparison.texts.items()
    }
    data = {
        "names": list(comparison.names),
        "metric": comparison.metric,
        "rows": comparison.rows,
        "texts": texts,
    }
    # "<" escaped: no text can close the script element
    text = json.dumps(data, ensure_ascii=False).replace("<", "\\u003c")
    return f'<script type="application/json" id="per-query-data">{text}</script>'


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src data:; \
style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>{title}</title>
<style>{style}</style>
</head>
<body>
<main>
{body}
</main>
{data}
<script>{script}</script>
</body>
</html>
"""

_STYLE = """
:root { --win: #1a7f37; --loss: #c62828; --same: #8a8f98; --line: #d8dce2; --soft: #f5f7fa; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
  color: #1d232b; background: #fff; }
main { max-width: 1200px; margin: 0 auto; padding: 16px 24px 48px; }
h1 { font-size: 1.6em; margin: 0.4em 0; } h2 { border-bottom: 1px solid var(--line);
  padding-bottom: 4px; margin-top: 1.8em; } h3 { margin-top: 1.4em; }
table { border-collapse: collapse; margin: 8px 0; font-size: 13px; }
th, td { border: 1px solid var(--line); padding: 4px 8px; text-align: left; vertical-align: top; }
thead th { background: var(--soft); }
code { background: var(--soft); padding: 0 3px; border-radius: 3px; font-size: 0.92em; }
pre { background: var(--soft); padding: 10px; overflow: auto; font-size: 12px; }
figure { margin: 12px 0; } figure img { max-width: 100%; height: auto; }
figcaption { color: #5b6470; font-size: 12px; }
#rank-changes { width: 100%; max-width: 720px; height: auto; display: block; }
#rank-changes .bar.win { fill: var(--win); } #rank-changes .bar.loss { fill: var(--loss); }
#rank-changes .bar.same { fill: var(--same); }
#rank-changes text { font-size: 11px; text-anchor: middle; fill: #333; }
.hint { color: #5b6470; }
.controls { display: flex; flex-wrap: wrap; gap: 6px; align-items: center; margin: 8px 0; }
.controls button { border: 1px solid var(--line); background: #fff; border-radius: 14px;
  padding: 3px 12px; cursor: pointer; font: inherit; }
.controls button.active { background: #1d232b; color: #fff; border-color: #1d232b; }
.controls input { flex: 1 1 220px; max-width: 360px; padding: 4px 8px; font: inherit;
  border: 1px solid var(--line); border-radius: 4px; }
#shown { color: #5b6470; }
.table-scroll { max-height: 60vh; overflow: auto; border: 1px solid var(--line); }
#queries-table { margin: 0; width: 100%; }
#queries-table thead th { position: sticky; top: 0; cursor: pointer; user-select: none;
  white-space: nowrap; z-index: 1; }
#queries-table th[aria-sort="ascending"]::after { content: " \\25B2"; }
#queries-table th[aria-sort="descending"]::after { content: " \\25BC"; }
#queries-table tbody tr { cursor: pointer; }
#queries-table tbody tr:hover, #queries-table tbody tr.selected { background: #eef4ff; }
#queries-table td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.query-text { max-width: 420px; }
.better { color: var(--win); } .worse { color: var(--loss); }
.flag { font-size: 11px; background: #fff3cd; border: 1px solid #e6c86e; border-radius: 3px;
  padding: 0 4px; margin-left: 4px; white-space: nowrap; }
#detail { margin-top: 16px; border: 1px solid var(--line); border-radius: 6px; padding: 12px 16px; }
#detail h3 { margin-top: 0; }
.side { display: grid; grid-template-columns: 1fr 1fr; gap: 16px; }
.side ol { padding-left: 0; list-style: none; margin: 0; }
.side li { border-top: 1px solid var(--line); padding: 6px 0; }
.side li.relevant { background: #edf7ee; }
.doc-head { font-size: 12px; color: #3b434d; } .doc-text { font-size: 13px; }
.badge { font-size: 11px; border-radius: 3px; padding: 0 4px; margin-left: 4px; }
.badge.rel { background: var(--win); color: #fff; } .badge.non { background: var(--same);
  color: #fff; } .badge.unj { background: #e6c86e; }
@media (max-width: 800px) { .side { grid-template-columns: 1fr; } main { padding: 8px; } }
@media print {
  body { font-size: 10pt; } main { max-width: none; padding: 0; }
  .controls, .hint { display: none; }
  .table-scroll { max-height: none; overflow: visible; border: 0; }
  #queries-table thead th { position: static; }
  tr, li, figure { break-inside: avoid; } h2, h3 { break-after: avoid; }
  #detail[hidden] { display: none; }
}
"""

_SCRIPT = r"""
(function () {
  "use strict";
  var source = document.getElementById("per-query-data");
  if (!source) return;
  var data = JSON.parse(source.textContent);
  var names = data.names, texts = data.texts;
  var table = document.getElementById("queries-table");
  var tbody = table.querySelector("tbody");
  var state = { filter: "all", search: "", key: "delta", dir: -1, selected: null };

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) {
      if (k === "text") node.textContent = attrs[k]; else node.setAttribute(k, attrs[k]);
    });
    (children || []).forEach(function (c) { if (c) node.appendChild(c); });
    return node;
  }
  function num(v, digits) { return v === null || v === undefined ? "-" : v.toFixed(digits); }
  function rank(v) { return v === null || v === undefined ? "-" : String(v); }
  function signed(v) { return (v > 0 ? "+" : "") + v.toFixed(4); }

  function shown() {
    var q = state.search.toLowerCase();
    var rows = data.rows.filter(function (r) {
      if (state.filter === "review" && !r.possible_missing_label) return false;
      if (["better", "worse", "same"].indexOf(state.filter) >= 0 && r.change !== state.filter)
        return false;
      return !q || r.query_id.toLowerCase().indexOf(q) >= 0 ||
        (r.query || "").toLowerCase().indexOf(q) >= 0;
    });
    var key = state.key, dir = state.dir;
    rows.sort(function (a, b) {
      var x = a[key], y = b[key];
      if (x === null || x === undefined) return (y === null || y === undefined) ? 0 : 1;
      if (y === null || y === undefined) return -1;
      if (typeof x === "string") return dir * x.localeCompare(y, undefined, { numeric: true });
      return dir * (x - y) || a.query_id.localeCompare(b.query_id, undefined, { numeric: true });
    });
    return rows;
  }

  function render() {
    var rows = shown();
    tbody.textContent = "";
    rows.forEach(function (r) {
      var tr = el("tr", { "data-query": r.query_id, tabindex: "0" }, [
        el("td", { text: r.query_id }),
        el("td", { "class": "query-text", text: r.query || "" }, [
          r.possible_missing_label ? el("span", { "class": "flag", text: "to review" }) : null
        ]),
        el("td", { "class": "num", text: num(r.base, 4) }),
        el("td", { "class": "num", text: num(r.new, 4) }),
        el("td", { "class": "num " + r.change, text: signed(r.delta) }),
        el("td", { "class": "num", text: rank(r.base_best_rank) }),
        el("td", { "class": "num", text: rank(r.new_best_rank) }),
        el("td", { "class": "num", text: r.rank_change === null ? "-" :
          (r.rank_change > 0 ? "+" : "") + r.rank_change })
      ]);
      if (r.query_id === state.selected) tr.className = "selected";
      tbody.appendChild(tr);
    });
    document.getElementById("shown").textContent =
      rows.length + " of " + data.rows.length + " queries";
    table.querySelectorAll("th").forEach(function (th) {
      th.setAttribute("aria-sort", th.dataset.key !== state.key ? "none" :
        (state.dir > 0 ? "ascending" : "descending"));
    });
  }

  function judgment(hit) {
    if (hit.relevance === null || hit.relevance === undefined)
      return el("span", { "class": "badge unj", text: "unjudged" });
    if (hit.relevance > 0)
      return el("span", { "class": "badge rel", text: "relevant " + hit.relevance });
    return el("span", { "class": "badge non", text: "judged 0" });
  }

  function hitList(hits) {
    return el("ol", {}, hits.map(function (h, i) {
      var kind = h.relevance > 0 ? "relevant" : (h.relevance === null ? "unjudged" : "");
      return el("li", { "class": kind, "data-doc": h.id }, [
        el("div", { "class": "doc-head" }, [
          el("span", { text: "#" + (i + 1) + "  " }), el("code", { text: h.id }),
          el("span", { text: "  score " + num(h.score, 4) }), judgment(h)
        ]),
        el("div", { "class": "doc-text", text: texts[h.id] || "" })
      ]);
    }));
  }

  function showDetail(id) {
    var r = data.rows.find(function (x) { return x.query_id === id; });
    var box = document.getElementById("detail");
    if (!r) { box.hidden = true; return; }
    state.selected = id;
    box.textContent = "";
    box.appendChild(el("h3", { text: "Query " + r.query_id + (r.query ? ": " + r.query : "") }));
    var metrics = Object.keys(r.base_metrics);
    box.appendChild(el("table", { "class": "metrics" }, [
      el("thead", {}, [el("tr", {}, [el("th", { text: "metric" }),
        el("th", { text: names[0] }), el("th", { text: names[1] })])]),
      el("tbody", {}, metrics.map(function (m) {
        return el("tr", {}, [el("td", { text: m }),
          el("td", { "class": "num", text: num(r.base_metrics[m], 4) }),
          el("td", { "class": "num", text: num(r.new_metrics[m], 4) })]);
      }))
    ]));
    box.appendChild(el("h4", { text: "Relevant documents" }));
    box.appendChild(el("table", { "class": "relevant" }, [
      el("thead", {}, [el("tr", {}, ["document", "relevance", "rank " + names[0],
        "score " + names[0], "rank " + names[1], "score " + names[1], "text"].map(
        function (t) { return el("th", { text: t }); }))]),
      el("tbody", {}, r.relevant.map(function (d) {
        return el("tr", { "data-doc": d.id }, [el("td", {}, [el("code", { text: d.id })]),
          el("td", { text: String(d.relevance) }),
          el("td", { "class": "num", text: rank(d.base_rank) }),
          el("td", { "class": "num", text: num(d.base_score, 4) }),
          el("td", { "class": "num", text: rank(d.new_rank) }),
          el("td", { "class": "num", text: num(d.new_score, 4) }),
          el("td", { "class": "doc-text", text: texts[d.id] || "" })]);
      }))
    ]));
    box.appendChild(el("div", { "class": "side" }, [
      el("div", { "class": "hits", "data-model": names[0] },
        [el("h4", { text: names[0] + ": top hits" }), hitList(r.base_hits)]),
      el("div", { "class": "hits", "data-model": names[1] },
        [el("h4", { text: names[1] + ": top hits" }), hitList(r.new_hits)])
    ]));
    box.hidden = false;
    render();
    box.scrollIntoView({ block: "start" });
    if (history.replaceState) history.replaceState(null, "", "#q=" + encodeURIComponent(id));
  }

  table.querySelectorAll("th").forEach(function (th) {
    function sort() {
      if (state.key === th.dataset.key) state.dir = -state.dir;
      else { state.key = th.dataset.key; state.dir = th.dataset.type === "text" ? 1 : -1; }
      render();
    }
    th.addEventListener("click", sort);
    th.addEventListener("keydown", function (e) { if (e.key === "Enter") sort(); });
  });
  document.querySelectorAll(".controls button").forEach(function (b) {
    b.addEventListener("click", function () {
      state.filter = b.dataset.filter;
      document.querySelectorAll(".controls button").forEach(function (o) {
        o.classList.toggle("active", o === b);
        o.setAttribute("aria-pressed", String(o === b));
      });
      render();
    });
  });
  document.getElementById("search").addEventListener("input", function (e) {
    state.search = e.target.value; render();
  });
  tbody.addEventListener("click", function (e) {
    var tr = e.target.closest("tr"); if (tr) showDetail(tr.dataset.query);
  });
  tbody.addEventListener("keydown", function (e) {
    var tr = e.target.closest("tr"); if (tr && e.key === "Enter") showDetail(tr.dataset.query);
  });
  render();
  var m = /^#q=(.*)$/.exec(location.hash);
  if (m) showDetail(decodeURIComponent(m[1]));
})();
"""
