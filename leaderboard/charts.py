"""Plotly figures for the drafter and compare pages, built with plotly.graph_objects from
the selectors' plain dicts and rendered in the browser by the local plotly.min.js
(static/leaderboard/charts.js). Aggregates over cells come from selectors.aggregate_cells,
that is from summed counts through worker.metrics."""
from __future__ import annotations

import html

import plotly.graph_objects as go

from worker.analysis import speedups
from worker.metrics import per_user_speed

from .selectors.shapes import aggregate_cells

PALETTE = ["#2563eb", "#d97706", "#059669", "#dc2626", "#7c3aed", "#0891b2", "#be185d",
           "#4d7c0f", "#9a3412", "#475569"]
ALL_TASKS = "all tasks"
BASE_LAYOUT = dict(
    template="none",
    font=dict(family="system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif", size=12,
              color="#1f2937"),
    margin=dict(l=56, r=16, t=44, b=56), height=360,
    paper_bgcolor="#ffffff", plot_bgcolor="#ffffff",
    legend=dict(orientation="h", y=-0.2, yanchor="top", x=0),
    hovermode="closest",
)
AXIS = dict(gridcolor="#e5e7eb", zerolinecolor="#d1d5db", linecolor="#9ca3af", showline=True)


def to_json(fig: go.Figure) -> str:
    """The figure's JSON, safe inside <script type="application/json">: <, > and & only
    occur inside JSON strings, where their \\u escapes mean the same."""
    return (fig.to_json().replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("&", "\\u0026"))


def plain(value):
    """A string from the data (a drafter's name, a task) as plotly shows it: plotly renders
    a subset of HTML (links, <b>, <br>) in names, labels and text, so markup is escaped into
    entities, which it shows as the characters they stand for. Other values pass through."""
    return html.escape(value, quote=False) if isinstance(value, str) else value


def _plain_trace(trace):
    """Every text a trace takes from the data, escaped (legend name, point text, category
    labels); the templates (hovertemplate, texttemplate) are ours and keep their markup."""
    updates = {}
    for attr in ("name", "text", "hovertext", "x", "y"):
        value = getattr(trace, attr, None)
        if isinstance(value, str):
            updates[attr] = plain(value)
        elif isinstance(value, (list, tuple)) and any(isinstance(v, (str, list, tuple))
                                                      for v in value):
            updates[attr] = [[plain(v) for v in row] if isinstance(row, (list, tuple))
                             else plain(row) for row in value]
    if updates:
        trace.update(**updates)


def _figure(traces, title, x_title, y_title, **layout) -> str:
    xaxis = dict(AXIS, title=dict(text=x_title, standoff=6), **layout.pop("xaxis", {}))
    yaxis = dict(AXIS, title=dict(text=y_title), **layout.pop("yaxis", {}))
    fig = go.Figure(data=traces, layout=go.Layout(**{
        **BASE_LAYOUT, "title": dict(text=title, x=0, xanchor="left", font=dict(size=14)),
        "xaxis": xaxis, "yaxis": yaxis, **layout}))
    fig.for_each_trace(_plain_trace)
    return to_json(fig)


def _color(i):
    return PALETTE[i % len(PALETTE)]


def _one_line(y=1.0, label="baseline = 1.0"):
    return dict(shapes=[dict(type="line", xref="paper", x0=0, x1=1, yref="y", y0=y, y1=y,
                             line=dict(color="#6b7280", width=1.5, dash="dash"))],
                annotations=[dict(xref="paper", x=1, y=y, yref="y", text=label,
                                  showarrow=False, xanchor="right", yanchor="bottom",
                                  font=dict(size=11, color="#6b7280"))])


def _batch_axis(batch_sizes):
    return dict(type="log", tickvals=list(batch_sizes), ticktext=[str(b) for b in batch_sizes])


def _line(name, xs, ys, i, dash=None, group=None, width=2, error=None):
    return go.Scatter(x=list(xs), y=list(ys), name=name, mode="lines+markers",
                      line=dict(color=_color(i), dash=dash, width=width),
                      legendgroup=group or name, connectgaps=False, error_y=error)


def _error_bars(rows, prefix):
    """Plotly error_y (array above, arrayminus below) of 95% intervals; None when no row
    has one (rows without an interval get 0)."""
    ups, downs, any_ = [], [], False
    for r in rows:
        v, lo, hi = (r or {}).get(prefix), (r or {}).get(f"{prefix}_low"), (r or {}).get(f"{prefix}_high")
        if v is None or lo is None or hi is None:
            ups.append(0)
            downs.append(0)
        else:
            any_ = True
            ups.append(hi - v)
            downs.append(v - lo)
    return dict(type="data", symmetric=False, array=ups, arrayminus=downs,
                visible=True) if any_ else None


def _pooled_by(cells, base, key):
    """{key value: speedups.pooled over those cells} against the pinned baseline cells."""
    pinned = speedups.by_key(base)
    groups = {}
    for c in cells:
        groups.setdefault(c[key], []).append(c)
    return {v: speedups.pooled(cs, pinned) for v, cs in sorted(groups.items())}


def _tasks(cells):
    return list(dict.fromkeys(c["task"] for c in cells))


def _fmt(x, digits=2):
    return "n/a" if x is None else f"{x:.{digits}f}"


# ---- building blocks on cell dicts -----------------------------------------------------

def best_k(cells, baseline_cells, ks):
    """The speculation budget with the highest mean speedup over batch sizes (all tasks)."""
    best, best_value = None, None
    for k in ks:
        sp = speedups.speedup_by_batch([c for c in cells if c["k"] == k],
                                       speedups.by_key(baseline_cells))
        sp = [v for v in sp.values() if v is not None]
        value = sum(sp) / len(sp) if sp else None
        if value is not None and (best_value is None or value > best_value):
            best, best_value = k, value
    return best if best is not None else (ks[0] if ks else None)


# ---- drafter page -----------------------------------------------------------------------

def drafter_charts(page: dict, k: int, temperature: float) -> dict[str, str]:
    """The drafter page's figures (JSON strings) for one k and temperature."""
    cells_t = [c for c in page["cells"] if c["temperature"] == temperature]
    cells = [c for c in cells_t if c["k"] == k]
    base = [c for c in page["baseline_cells"] if c["temperature"] == temperature]
    protocol = page["protocol"] or {}
    batch_sizes = protocol.get("batch_sizes") or sorted({c["batch_size"] for c in cells})
    tasks = _tasks(page["cells"])
    cond = f"k = {k}, temperature {temperature:g}"
    figs = {}

    # speedup vs batch size, per task and over all tasks, with the 1.0 line
    traces = []
    for i, task in enumerate(tasks):
        rows = sorted((c for c in cells if c["task"] == task), key=lambda c: c["batch_size"])
        traces.append(_line(task, [c["batch_size"] for c in rows], [c["speedup"] for c in rows], i,
                            error=_error_bars(rows, "speedup")))
    overall = speedups.speedup_by_batch(cells, speedups.by_key(base))
    traces.append(_line(ALL_TASKS, list(overall), list(overall.values()), len(tasks), width=3,
                        dash="dot"))
    figs["speedup"] = _figure(traces, f"Speedup vs batch size ({cond})", "batch size",
                              "speedup (x baseline)", xaxis=_batch_axis(batch_sizes),
                              **_one_line())

    # per-position acceptance per task (summed over batch sizes)
    per_task = aggregate_cells(cells, ("task",))
    traces = []
    for i, task in enumerate(tasks):
        alphas = per_task.get((task,), {}).get("per_position_acceptance") or []
        traces.append(_line(task, list(range(1, len(alphas) + 1)), alphas, i))
    all_alpha = aggregate_cells(cells, ()).get((), {}).get("per_position_acceptance") or []
    traces.append(_line(ALL_TASKS, list(range(1, len(all_alpha) + 1)), all_alpha, len(tasks),
                        dash="dot", width=3))
    figs["positions"] = _figure(traces, f"Per-position acceptance alpha_i ({cond}, all batch sizes)",
                                "draft position i", "alpha_i = accepted_at[i] / drafts",
                                xaxis=dict(dtick=1), yaxis=dict(range=[0, 1.02]))

    # acceptance length per task, one bar per k
    by_task_k = aggregate_cells(cells_t, ("task", "k"))
    traces = []
    for i, kk in enumerate(protocol.get("ks") or sorted({c["k"] for c in cells_t})):
        traces.append(go.Bar(name=f"k = {kk}", x=tasks,
                             y=[by_task_k.get((t, kk), {}).get("acceptance_length") for t in tasks],
                             marker_color=_color(i)))
    figs["acceptance_length"] = _figure(
        traces, f"Acceptance length per task (temperature {temperature:g}, all batch sizes)",
        "task", "AL = 1 + accepted / drafts", barmode="group")

    # throughput and TPOT vs batch size, drafter (solid) and baseline (dashed)
    traces = []
    for i, task in enumerate(tasks):
        rows = sorted((c for c in cells if c["task"] == task), key=lambda c: c["batch_size"])
        brows = sorted((c for c in base if c["task"] == task), key=lambda c: c["batch_size"])
        xs, bxs = [c["batch_size"] for c in rows], [c["batch_size"] for c in brows]
        traces += [
            _line(task, xs, [c["output_throughput"] for c in rows], i, group=task),
            _line(f"{task} baseline", bxs, [c["output_throughput"] for c in brows], i,
                  dash="dash", group=task, width=1.5),
        ]
        tpot = [_line(task, xs, [_ms(c["tpot_mean"]) for c in rows], i, group=task),
                _line(f"{task} baseline", bxs, [_ms(c["tpot_mean"]) for c in brows], i,
                      dash="dash", group=task, width=1.5)]
        for t in tpot:
            t.update(xaxis="x2", yaxis="y2", showlegend=False)
        traces += tpot
    axis_b = dict(AXIS, **_batch_axis(batch_sizes))
    figs["throughput"] = _figure(
        traces, f"Output throughput and TPOT vs batch size ({cond}); dashed: baseline",
        "batch size", "output tokens / s",
        xaxis=dict(domain=[0, 0.46], **_batch_axis(batch_sizes)),
        xaxis2=dict(axis_b, domain=[0.56, 1], anchor="y2", title=dict(text="batch size")),
        yaxis2=dict(AXIS, anchor="x2", title=dict(text="TPOT mean (ms)")),
        height=380)

    # claimed vs remeasured
    d = page["drafter"]
    b0 = min(batch_sizes) if batch_sizes else None
    at_b0 = aggregate_cells([c for c in cells if c["batch_size"] == b0], ()).get((), {})
    measured_speedup = speedups.speedup_by_batch(
        [c for c in cells if c["batch_size"] == b0], speedups.by_key(base)).get(b0)
    names = ["acceptance length", "speedup"]
    traces = [
        go.Bar(name="claimed", x=names, marker_color="#9ca3af",
               y=[d["claimed_acceptance_length"], d["claimed_speedup"]]),
        go.Bar(name=f"remeasured (all tasks, batch {b0}, {cond})", x=names,
               marker_color=_color(0), y=[at_b0.get("acceptance_length"), measured_speedup]),
    ]
    figs["claimed"] = _figure(traces, "Claimed vs remeasured", "", "value", barmode="group",
                              **_one_line(label="1.0"))
    operating = drafter_operating_chart(page, k, temperature)
    if operating:
        figs["operating"] = operating
    return figs


def _ms(seconds):
    return None if seconds is None else seconds * 1000.0


# ---- compare page -----------------------------------------------------------------------

def compare_charts(data: dict, temperature: float, k: int | None,
                   task: str | None = None) -> tuple[dict[str, str], list[dict]]:
    """Overlaid figures for 2-4 drafters, and one summary row per drafter. k None means
    each drafter at its best k (highest mean speedup over batch sizes)."""
    protocol = data["protocol"]
    batch_sizes, ks = protocol["batch_sizes"], protocol["ks"]
    tasks = protocol["tasks"] if not task else [task]
    sp_traces, al_traces, pos_traces, thr_traces, summary = [], [], [], [], []
    base_done = False
    for i, e in enumerate(data["entries"]):
        cells_t = [c for c in e["cells"] if c["temperature"] == temperature
                   and c["task"] in tasks]
        base = [c for c in e["baseline_cells"] if c["temperature"] == temperature
                and c["task"] in tasks]
        kk = k if k is not None else best_k(cells_t, base, ks)
        cells = [c for c in cells_t if c["k"] == kk]
        name = f"{e['drafter']['name']} (k={kk})" + (", measuring" if e["run"].get("measuring")
                                                      else "")
        sp = speedups.speedup_by_batch(cells, speedups.by_key(base))
        by_b = _pooled_by(cells, base, "batch_size")
        sp_traces.append(_line(name, list(sp), list(sp.values()), i,
                               error=_error_bars([by_b.get(b) for b in sp], "speedup")))
        per_task = aggregate_cells(cells, ("task",))
        by_task = _pooled_by(cells, base, "task")
        al_rows = [{**(by_task.get(t) or {}), "acceptance_length":
                    per_task.get((t,), {}).get("acceptance_length")} for t in tasks]
        al_traces.append(go.Bar(name=name, x=tasks, marker_color=_color(i),
                                y=[r["acceptance_length"] for r in al_rows],
                                error_y=_error_bars(al_rows, "acceptance_length")))
        overall = aggregate_cells(cells, ()).get((), {})
        alphas = overall.get("per_position_acceptance") or []
        pos_traces.append(_line(name, list(range(1, len(alphas) + 1)), alphas, i))
        thr = aggregate_cells(cells, ("batch_size",))
        thr_rows = [{**(by_b.get(b) or {}), "output_throughput": g["output_throughput"]}
                    for (b,), g in thr.items()]
        thr_traces.append(_line(name, [b for (b,) in thr], [g["output_throughput"]
                                                            for g in thr.values()], i,
                                error=_error_bars(thr_rows, "output_throughput")))
        if not base_done and base:
            bthr = aggregate_cells(base, ("batch_size",))
            thr_traces.append(_line("baseline (no drafter)", [b for (b,) in bthr],
                                    [g["output_throughput"] for g in bthr.values()], 9,
                                    dash="dash"))
            base_done = True
        summary.append({"drafter": e["drafter"], "run": e["run"], "k": kk,
                        "acceptance_length": overall.get("acceptance_length"),
                        "acceptance_rate": overall.get("acceptance_rate"),
                        "lossless_share": overall.get("lossless_share"),
                        "tokens_per_step": speedups.pooled(cells, None)["tokens_per_step"],
                        "speedup_by_batch": sp})
    scope = f"{task or 'all tasks'}, temperature {temperature:g}" + (
        f", k = {k}" if k is not None else ", each at its best k")
    figs = {
        "speedup": _figure(sp_traces, f"Speedup vs batch size ({scope})", "batch size",
                           "speedup (x baseline)", xaxis=_batch_axis(batch_sizes), **_one_line()),
        "acceptance_length": _figure(al_traces, f"Acceptance length per task ({scope})", "task",
                                     "AL = 1 + accepted / drafts", barmode="group"),
        "positions": _figure(pos_traces, f"Per-position acceptance ({scope})", "draft position i",
                             "alpha_i", xaxis=dict(dtick=1), yaxis=dict(range=[0, 1.02])),
        "throughput": _figure(thr_traces, f"Output throughput vs batch size ({scope})",
                              "batch size", "output tokens / s", xaxis=_batch_axis(batch_sizes)),
    }
    return figs, summary


# ---- when does it pay? -------------------------------------------------------------------

PHASE_LABELS = {"prefill": "prefill and waiting (TTFT)", "verification": "verification",
                "drafting_other": "drafting, rejection sampling, other",
                "drafting": "drafting", "sampling": "rejection sampling", "other": "other"}
PHASE_ORDER = ("prefill", "verification", "drafting", "sampling", "drafting_other", "other")
PHASE_COLORS = {"prefill": "#9ca3af", "verification": "#2563eb", "drafting": "#d97706",
                "sampling": "#7c3aed", "drafting_other": "#d97706", "other": "#475569"}


def _bounds_traces(by_batch, name, i, show_legend=True):
    xs = [r["batch_size"] for r in by_batch]
    traces = [
        _line(f"{name} measured", xs, [r["measured_speedup"] for r in by_batch], i,
              group=name),
        _line(f"{name} predicted", xs, [r["predicted_speedup"] for r in by_batch], i,
              dash="dash", group=name, width=1.5),
        _line(f"{name} oracle", xs, [r["oracle_speedup"] for r in by_batch], i, dash="dot",
              group=name, width=1.5),
    ]
    for t in traces:
        t.update(showlegend=show_legend)
    return traces


def _share_bars(labels, shares_list):
    phases = [p for p in PHASE_ORDER if any(s and s.get(p) is not None for s in shares_list)]
    return [go.Bar(name=PHASE_LABELS[p], x=labels, marker_color=PHASE_COLORS[p],
                   y=[(s or {}).get(p) for s in shares_list]) for p in phases]


def _best_curves(curves) -> dict[str, dict]:
    """{drafter slug: its curve at the k with the highest mean measured speedup}."""
    best = {}
    for c in curves:
        slug = c["drafter"]["slug"]
        if slug not in best or (c["mean_speedup"] or 0) > (best[slug]["mean_speedup"] or 0):
            best[slug] = c
    return best


DASHES = (None, "dash", "dot", "dashdot")
SYMBOLS = ("circle", "diamond", "square", "triangle-up", "x", "star", "cross", "pentagon")


def break_even_map_chart(task_map: dict, temperature: float) -> str:
    """One task's break-even map: per (batch size, k) the tokens per step a drafter of a
    given draft cost needs to pay (colour: batch size, dash: k), and each measured (drafter,
    k) cell at its draft cost and tokens per step (symbol: drafter, colour: batch size)."""
    sizes = sorted({c["batch_size"] for c in task_map["curves"]})
    ks = sorted({c["k"] for c in task_map["curves"]})
    traces = []
    for c in task_map["curves"]:
        bi, ki = sizes.index(c["batch_size"]), ks.index(c["k"])
        line = _line(f"pays above: b={c['batch_size']}, k={c['k']}",
                     [p["draft_cost"] for p in c["points"]],
                     [p["tokens_per_step"] for p in c["points"]], bi,
                     dash=DASHES[ki % len(DASHES)], width=1.5)
        line.update(mode="lines", hovertemplate="break-even b=%{meta[0]}, k=%{meta[1]}<br>"
                    "draft cost %{x:.3f} x t_fwd(b): needs %{y:.2f} tokens per step"
                    "<extra></extra>", meta=[c["batch_size"], c["k"]])
        traces.append(line)
    groups: dict[tuple, list] = {}
    for p in task_map["points"]:
        groups.setdefault((p["drafter"]["slug"], p["k"]), []).append(p)
    for i, ((_, k), pts) in enumerate(groups.items()):
        traces.append(go.Scatter(
            x=[p["draft_cost"] for p in pts], y=[p["tokens_per_step"] for p in pts],
            name=f"{pts[0]['drafter']['name']} (k={k})", mode="markers",
            hovertext=[pts[0]["drafter"]["name"]] * len(pts),
            customdata=[[p["batch_size"], p["k"], p["break_even_tokens_per_step"],
                         p["map_speedup"], p["speedup"]] for p in pts],
            hovertemplate="%{hovertext} k=%{customdata[1]} b=%{customdata[0]}<br>draft cost "
                          "%{x:.3f} x t_fwd(b), tokens per step %{y:.2f} (needs "
                          "%{customdata[2]:.2f})<br>map %{customdata[3]:.2f}x, measured "
                          "%{customdata[4]:.2f}x<extra></extra>",
            marker=dict(size=11, symbol=SYMBOLS[i % len(SYMBOLS)],
                        color=[_color(sizes.index(p["batch_size"])) if p["batch_size"] in sizes
                               else "#111827" for p in pts],
                        line=dict(color="#111827", width=1))))
    own = [p for p in task_map["points"] if not p["drafts_every_step"]]
    if own:   # where not every step drafted k tokens, the drafter's own bar is lower
        traces.append(go.Scatter(
            x=[p["draft_cost"] for p in own], y=[p["break_even_tokens_per_step"] for p in own],
            name="its own break-even (not every step drafted k)", mode="markers",
            hovertext=[p["drafter"]["name"] for p in own],
            customdata=[[p["batch_size"], p["k"], p["drafting_share"]] for p in own],
            hovertemplate="%{hovertext} k=%{customdata[1]} b=%{customdata[0]}: needs %{y:.2f} "
                          "tokens per step (%{customdata[2]:.0%} of its steps drafted)"
                          "<extra></extra>",
            marker=dict(symbol="line-ew-open", size=18, line=dict(width=3),
                        color=[_color(sizes.index(p["batch_size"])) if p["batch_size"] in sizes
                               else "#111827" for p in own])))
    return _figure(traces, f"{task_map['task']}: break-even map (temperature "
                   f"{temperature:g}; marker colour = its batch size's line)",
                   "draft cost per step / target forward t_fwd(b)",
                   "tokens per step (= AL when every step drafts)", height=440)


def operating_chart(task: str, lines: list[dict], baselines: list[dict],
                    temperature: float) -> str:
    """Output throughput against per-user speed for one task: a line per drafter (through
    its batch sizes, labelled b=...) and the target alone's; error bars: the throughput's
    95% interval where the cells have one."""
    traces = []
    for i, line in enumerate(lines):
        pts = line["points"]
        trace = _line(f"{line['drafter']['name']} (k={line['k']})",
                      [p["per_user_speed"] for p in pts], [p["output_throughput"] for p in pts],
                      i, error=_error_bars(pts, "output_throughput"))
        trace.update(mode="lines+markers+text", text=[f"b={p['batch_size']}" for p in pts],
                     textposition="top center")
        traces.append(trace)
    for j, line in enumerate(baselines):
        pts = line["points"]
        name = "target alone (no drafter)" + (f", run {line['run_id']}" if len(baselines) > 1
                                              else "")
        trace = _line(name, [p["per_user_speed"] for p in pts],
                      [p["output_throughput"] for p in pts], len(PALETTE) - 1 - j, dash="dash",
                      error=_error_bars(pts, "output_throughput"))
        trace.update(mode="lines+markers+text", text=[f"b={p['batch_size']}" for p in pts],
                     textposition="bottom center")
        traces.append(trace)
    return _figure(traces, f"{task}: throughput against per-user speed (temperature "
                   f"{temperature:g})",
                   "per-user speed: tokens / s of one request (1 / mean TPOT)",
                   "output throughput (tokens / s, all requests)", height=420)


def pays_charts(data: dict) -> dict[str, str]:
    """The "When does it pay?" page's figures: speedup bounds by batch size (each drafter
    at its best k), time shares, acceptance against draft cost with the Pareto frontier,
    the best speedup per task and batch size, the break-even map per task and throughput
    against per-user speed per task (each drafter at its best k)."""
    if not data["curves"]:
        return {}
    batch_sizes = data["batch_sizes"]
    best = _best_curves(data["curves"])
    figs, traces = {}, []
    for i, c in enumerate(best.values()):
        traces += _bounds_traces(c["by_batch"], f"{c['drafter']['name']} (k={c['k']})", i)
    cond = f"temperature {data['temperature']:g}, all tasks, each drafter at its best k"
    figs["bounds"] = _figure(traces, f"Measured (solid), predicted (dashed) and oracle (dotted) "
                             f"speedup ({cond})", "batch size", "speedup (x baseline)",
                             xaxis=_batch_axis(batch_sizes), height=420, **_one_line())
    labels, shares = [], []
    for c in best.values():
        for r in c["by_batch"]:
            if r.get("shares"):
                labels.append(f"{c['drafter']['name']} k={c['k']} b={r['batch_size']}")
                shares.append(r["shares"])
    if shares:
        figs["breakdown"] = _figure(_share_bars(labels, shares),
                                    f"Where the time goes ({cond})", "", "share of time",
                                    barmode="stack", yaxis=dict(range=[0, 1.0001]), height=420)
    pts = [p for p in data["pareto"] if p["cost"] is not None and p["al"] is not None]
    if pts:
        frontier = sorted((p for p in pts if p["frontier"]), key=lambda p: p["cost"])
        scatter = go.Scatter(
            x=[p["cost"] for p in pts], y=[p["al"] for p in pts], mode="markers+text",
            text=[f"{p['drafter']['name']} k={p['k']}" for p in pts], textposition="top center",
            marker=dict(size=10, color=["#dc2626" if p["frontier"] else "#6b7280" for p in pts]),
            name="(drafter, k)")
        line = go.Scatter(x=[p["cost"] for p in frontier], y=[p["al"] for p in frontier],
                          mode="lines", line=dict(color="#dc2626", dash="dash"),
                          name="Pareto frontier")
        figs["pareto"] = _figure([scatter, line], f"Acceptance length against draft cost "
                                 f"(temperature {data['temperature']:g}, all tasks and batch sizes)",
                                 "draft cost per step / target forward t_fwd(b)",
                                 "AL = 1 + accepted / drafts")
    z, text = [], []
    for row in data["matrix"]:
        z.append([c["best_drafter_speedup"] if c else None for c in row["cells"]])
        text.append([("baseline" if c and c["drafter"] is None else
                      f"{c['drafter']['name']} k={c['k']}" if c else "")
                     for c in row["cells"]])
    figs["matrix"] = _figure([go.Heatmap(
        z=z, x=[str(b) for b in batch_sizes], y=data["tasks"], text=text,
        texttemplate="%{text}<br>%{z:.2f}x", colorscale="RdBu", zmid=1.0,
        colorbar=dict(title=dict(text="best speedup")))],
        f"Best drafter per task and batch size (temperature {data['temperature']:g})",
        "batch size", "task", xaxis=dict(type="category"))
    for i, task_map in enumerate((data.get("map") or {}).get("tasks") or []):
        figs[f"map_{i}"] = break_even_map_chart(task_map, data["temperature"])
    operating = data.get("operating") or {}
    chosen = {(c["drafter"]["slug"], c["k"]) for c in best.values()}
    for i, task in enumerate(data["tasks"]):
        lines = [x for x in operating.get("drafters") or [] if x["task"] == task
                 and (x["drafter"]["slug"], x["k"]) in chosen]
        bases = [x for x in operating.get("baselines") or [] if x["task"] == task]
        if lines:
            figs[f"operating_{i}"] = operating_chart(task, lines, bases, data["temperature"])
    return figs


def drafter_operating_chart(page: dict, k: int, temperature: float) -> str | None:
    """The drafter page's throughput against per-user speed: per task the drafter's cells
    at k (solid) and the baseline cells they divide by (dashed), through the batch sizes."""
    cells = [c for c in page["cells"] if c["temperature"] == temperature and c["k"] == k]
    base = [c for c in page["baseline_cells"] if c["temperature"] == temperature]
    traces = []
    for i, task in enumerate(_tasks(cells)):
        for rows, name, dash, width in (
                ([c for c in cells if c["task"] == task], task, None, 2),
                ([c for c in base if c["task"] == task], f"{task} baseline", "dash", 1.5)):
            rows = sorted(rows, key=lambda c: c["batch_size"])
            trace = _line(name, [per_user_speed(c["tpot_mean"]) for c in rows],
                          [c["output_throughput"] for c in rows], i, dash=dash, group=task,
                          width=width, error=_error_bars(rows, "output_throughput"))
            trace.update(mode="lines+markers+text", textposition="top center",
                         text=[f"b={c['batch_size']}" for c in rows])
            traces.append(trace)
    if not traces:
        return None
    return _figure(traces, f"Throughput against per-user speed (k = {k}, temperature "
                   f"{temperature:g}); dashed: baseline", "per-user speed: tokens / s of "
                   "one request (1 / mean TPOT)", "output throughput (tokens / s)", height=400)


def drafter_pays_charts(pays: dict, k: int, temperature: float) -> dict[str, str]:
    """The drafter page's "When does it pay?" figures for one k and temperature."""
    curve = next((c for c in pays["curves"] if c["k"] == k and c["temperature"] == temperature),
                 None)
    if curve is None or not any(r["predicted_speedup"] for r in curve["by_batch"]):
        return {}
    cond = f"k = {k}, temperature {temperature:g}, all tasks"
    figs = {"pays_bounds": _figure(
        _bounds_traces(curve["by_batch"], "speedup", 0),
        f"Measured, predicted and oracle speedup ({cond})", "batch size",
        "speedup (x baseline)", xaxis=_batch_axis([r["batch_size"] for r in curve["by_batch"]]),
        **_one_line())}
    rows = [r for r in curve["by_batch"] if r.get("shares")]
    if rows:
        figs["pays_breakdown"] = _figure(
            _share_bars([f"b={r['batch_size']}" for r in rows], [r["shares"] for r in rows]),
            f"Where the time goes ({cond})", "batch size", "share of time", barmode="stack",
            yaxis=dict(range=[0, 1.0001]))
    return figs


# ---- the recipe page ----------------------------------------------------------------------

def _recipe_line(recipe: dict, i: int, xs, ys, entries, figures, x_label):
    """One recipe's drafters as a line (sorted by x); a drafter whose run still measures
    gets an open marker and says so on hover."""
    pts = sorted(((x, y, e, f) for x, y, e, f in zip(xs, ys, entries, figures)
                  if x is not None and y is not None), key=lambda p: (p[0], p[1]))
    if not pts:
        return None
    trace = _line(recipe["name"], [p[0] for p in pts], [p[1] for p in pts], i,
                  error=_error_bars([p[3] for p in pts], "acceptance_length"))
    trace.update(
        marker=dict(size=9, symbol=["circle-open" if p[2]["run"]["measuring"] else "circle"
                                    for p in pts]),
        text=[p[2]["drafter"]["name"] + (" (measuring)" if p[2]["run"]["measuring"] else "")
              for p in pts],
        customdata=[[p[2]["training"]["data_answer_tokens"], p[3].get("tokens_per_step")]
                    for p in pts],
        hovertemplate="%{text}<br>" + x_label + " %{x}<br>AL %{y:.3f}<br>answer tokens %{customdata[0]}"
                      "<br>tokens / step %{customdata[1]:.3f}<extra></extra>")
    return trace


def recipe_charts(page: dict) -> dict[str, str]:
    """The recipe page's learning curves: per task, acceptance length against the training
    data's conversations (log x), one line per recipe; and acceptance length over all
    tasks against training time (log x). Error bars: the AL's 95% interval where measured."""
    if not page["entries"]:
        return {}
    k, temperature = page["k"], page["temperature"]
    scope = f"k = {k}, temperature {temperature:g}, pooled over batch sizes"
    sizes = sorted({e["training"]["data_conversations"] for e in page["entries"]
                    if e["training"]["data_conversations"]})
    figs = {}
    for t_i, task in enumerate(page["tasks"]):
        traces = []
        for i, r in enumerate(page["recipes"]):
            es = r["entries"]
            trace = _recipe_line(r, i, [e["training"]["data_conversations"] for e in es],
                                 [e["tasks"][task]["acceptance_length"] for e in es], es,
                                 [e["tasks"][task] for e in es], "conversations")
            if trace is not None:
                traces.append(trace)
        figs[f"al_task_{t_i}"] = _figure(
            traces, f"{plain(task)}: acceptance length against training data ({scope})",
            "training data: conversations (log scale)", "acceptance length (corrected)",
            xaxis=dict(type="log", tickvals=sizes, ticktext=[str(s) for s in sizes]))
    traces = []
    for i, r in enumerate(page["recipes"]):
        es = r["entries"]
        trace = _recipe_line(r, i, [e["training"]["seconds"] for e in es],
                             [e["all"]["acceptance_length"] for e in es], es, [e["all"] for e in es],
                             "training seconds")
        if trace is not None:
            traces.append(trace)
    figs["al_time"] = _figure(
        traces, f"All tasks: acceptance length against training time ({scope})",
        "training time: seconds (log scale)", "acceptance length (corrected)",
        xaxis=dict(type="log"))
    return figs
