"""A `Story` drawn as HTML with inline SVG: the summary line, a timeline (one row per task, one
bar per attempt coloured by how it ended, the markers), and each task's loss and steps/s over
time on the timeline's time axis.

One self-contained document: no script, no network, no external file; hovering a bar or marker
shows its details through SVG's own <title>. The fragment (`fragment`) is what a notebook shows
inline: its styles are scoped to its own class, so it leaves the notebook's page alone.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from html import escape

from distlaunch.launcher.diagnosis.progress_view import format_duration
from distlaunch.launcher.report.story import Ending, Marker, MarkerKind, Story

WIDTH = 1100  # the drawing's width in user units (it scales with the page)
LABEL_W = 150  # the task names' column
RIGHT = 20
PLOT_W = WIDTH - LABEL_W - RIGHT
AXIS_H = 26  # the time axis above the rows
CHART_H = 220
# At most this many moments are listed under the timeline (the markers all stay drawn).
MOMENTS_LISTED = 60
# Task lines of the charts get a legend up to this many tasks.
LEGEND_TASKS = 16

COLOURS = {
    Ending.SUCCEEDED: "#2e9e44",
    Ending.FAILED: "#d62728",
    Ending.PREEMPTED: "#1f77b4",
    Ending.KILLED: "#ff9f1c",
    Ending.STOPPED: "#9e9e9e",
    Ending.HUNG: "#9467bd",
    Ending.RUNNING: "#9fdcaa",
    Ending.UNKNOWN: "#d0d0d0",
}
MEANINGS = {
    Ending.SUCCEEDED: "succeeded",
    Ending.FAILED: "failed",
    Ending.PREEMPTED: "saved on a stop notice",
    Ending.KILLED: "killed for a restart",
    Ending.STOPPED: "stopped (the run ended)",
    Ending.HUNG: "hung",
    Ending.RUNNING: "running",
    Ending.UNKNOWN: "no end recorded",
}
MARKER_MEANINGS = {
    MarkerKind.RESTART: "restart",
    MarkerKind.NOTICE: "stop notice",
    MarkerKind.SAVE: "save",
    MarkerKind.HANG: "hang",
    MarkerKind.ROOT_CAUSE: "root cause",
    MarkerKind.RESIZE: "world resized",
}
# The task lines of the charts.
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip

STYLE = """
.dlr { font: 13px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222;
  max-width: 1140px; }
.dlr h1 { font-size: 20px; margin: 0 0 4px; }
.dlr h2 { font-size: 15px; margin: 18px 0 4px; }
.dlr .summary { font-family: ui-monospace, Menlo, monospace; background: #f5f5f5;
  border-left: 4px solid #888; padding: 6px 10px; margin: 6px 0; white-space: pre-wrap; }
.dlr .state-failed .summary, .dlr .summary.state-failed { border-color: #d62728; }
.dlr .summary.state-succeeded { border-color: #2e9e44; }
.dlr .summary.state-preempted { border-color: #1f77b4; }
.dlr .live { background: #fff4d6; border: 1px solid #e8c66a; padding: 4px 10px; }
.dlr .meta { color: #555; }
.dlr .notes { color: #8a5a00; }
.dlr svg { display: block; width: 100%; height: auto; }
.dlr svg text { font: 11px system-ui, sans-serif; fill: #333; }
.dlr svg .small text, .dlr svg text.small { font-size: 9px; }
.dlr svg .marker text { paint-order: stroke; stroke: #fff; stroke-width: 3px; }
.dlr .legend { display: flex; flex-wrap: wrap; gap: 4px 14px; margin: 4px 0; }
.dlr .legend span { white-space: nowrap; }
.dlr .legend i { display: inline-block; width: 12px; height: 12px; vertical-align: -2px;
  margin-right: 4px; border-radius: 2px; }
.dlr table { border-collapse: collapse; }
.dlr td { padding: 1px 10px 1px 0; vertical-align: top; }
.dlr td { white-space: nowrap; }
.dlr td.what { white-space: normal; }
.dlr td.t { color: #555; text-align: right; font-variant-numeric: tabular-nums; }
"""


def page(story: Story, generated: float | None = None) -> str:
    """The whole report: an HTML document."""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>distlaunch run {escape(story.run_id)}</title></head>\n<body>\n"
        f"{fragment(story, generated)}\n</body></html>\n"
    )


def fragment(story: Story, generated: float | None = None) -> str:
    """The report as one <div> with its own styles: what a notebook cell shows."""
    generated = time.time() if generated is None else generated
    parts = [f'<div class="dlr"><style>{STYLE}</style>', _header(story, generated)]
    parts += ["<h2>Timeline</h2>", _legend(), _timeline(story), _moments(story)]
    parts += ["<h2>Training</h2>", _charts(story)]
    parts.append("</div>")
    return "\n".join(parts)


def _header(story: Story, generated: float) -> str:
    attempts = len({b.attempt for b in story.bars})
    meta = (
        f"state <b>{escape(story.state)}</b> · started {_utc(story.start)} · "
        f"{format_duration(story.end - story.start)} · {len(story.tasks)} tasks · "
        f"{attempts} attempts · report generated {_utc(generated)}"
    )
    out = [
        f"<h1>distlaunch run {escape(story.run_id)}</h1>",
        f'<p class="summary state-{escape(story.state)}">{escape(story.summary)}</p>',
        f'<p class="meta">{meta}</p>',
    ]
    if story.live:
        out.append('<p class="live">running: this report shows the run so far</p>')
    if story.notes:
        items = "".join(f"<li>{escape(note)}</li>" for note in story.notes)
        out.append(f'<ul class="notes">{items}</ul>')
    return "\n".join(out)


def _utc(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


def _legend() -> str:
    spans = [f'<span><i style="background:{COLOURS[e]}"></i>{MEANINGS[e]}</span>' for e in Ending]
    for kind in MarkerKind:
        icon = f'<svg width="14" height="14" style="display:inline;width:14px;vertical-align:-2px">{_marker_shape(kind, 7, 7, 12)}</svg>'
        spans.append(f"<span>{icon} {MARKER_MEANINGS[kind]}</span>")
    return f'<div class="legend">{"".join(spans)}</div>'


# One reading of a chart: time, value, attempt.
_Reading = tuple[float, float, int | None]


class _Scale:
    """Times to x positions on the plot."""

    def __init__(self, start: float, end: float) -> None:
        self.start = start
        self.span = max(end - start, 1e-3)

    def x(self, at: float) -> float:
        return LABEL_W + PLOT_W * (at - self.start) / self.span

    def ticks(self) -> list[float]:
        """Offsets (s) for about eight round ticks."""
        step = _round_step(self.span / 8)
        return [i * step for i in range(int(self.span / step) + 1)]


def _round_step(raw: float) -> float:
    """The 1, 2 or 5 times a power of ten nearest above ``raw``."""
    power = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for factor in (1, 2, 5, 10):
        if raw <= factor * power:
            return factor * power
    return 10 * power


def _row_height(count: int) -> int:
    if count <= 24:
        return 22
    return 16 if count <= 64 else 11


def _time_label(offset: float, span: float = 0.0) -> str:
    """An offset from the run's start: seconds in a short run, 1m40s style in a long one
    (``span``: the run's length, so that every tick of one axis reads alike)."""
    if max(offset, span) < 120:
        return f"{offset:g} s"
    return format_duration(offset)


def _axis(scale: _Scale, top: float, bottom: float) -> list[str]:
    out = ['<g class="axis">']
    for offset in scale.ticks():
        x = scale.x(scale.start + offset)
        out.append(
            f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke="#e4e4e4"/>'
            f'<text x="{x:.1f}" y="{top - 6}" text-anchor="middle">{_time_label(offset, scale.span)}</text>'
        )
    out.append("</g>")
    return out


def _timeline(story: Story) -> str:
    row_h = _row_height(len(story.tasks))
    bar_h = max(row_h - 6, 6)
    height = AXIS_H + row_h * len(story.tasks) + 24  # room for the notices' labels below
    scale = _Scale(story.start, story.end)
    rows = {name: i for i, name in enumerate(story.tasks)}
    small = ' class="small"' if row_h < 16 else ""
    out = [
        f'<svg class="timeline" viewBox="0 0 {WIDTH} {height}" xmlns="http://www.w3.org/2000/svg"'
        f' role="img" aria-label="timeline of run {escape(story.run_id)}">',
        *_axis(scale, AXIS_H, height - 8),
    ]
    by_task: dict[str, list] = {name: [] for name in story.tasks}
    for bar in story.bars:
        by_task.setdefault(bar.task, []).append(bar)
    for name, index in rows.items():
        y = AXIS_H + index * row_h
        out.append(f'<g class="row" data-task="{escape(name)}"{small}>')
        if index % 2:
            out.append(f'<rect x="0" y="{y}" width="{WIDTH}" height="{row_h}" fill="#fafafa"/>')
        out.append(
            f'<text x="{LABEL_W - 8}" y="{y + row_h / 2 + 4:.1f}" text-anchor="end">{escape(name)}</text>'
        )
        for bar in by_task[name]:
            x0, x1 = scale.x(bar.start), scale.x(bar.end)
            tip = (
                f"{name} attempt {bar.attempt}: {MEANINGS[bar.ending]}, "
                f"{_time_label(round(bar.start - story.start, 1))} to "
                f"{_time_label(round(bar.end - story.start, 1))}"
                + (f" ({bar.detail})" if bar.detail else "")
            )
            out.append(
                f'<rect class="bar {bar.ending.value}" data-task="{escape(name)}" '
                f'data-attempt="{bar.attempt}" '
                f'x="{x0:.1f}" y="{y + (row_h - bar_h) / 2:.1f}" width="{max(x1 - x0, 1.5):.1f}" '
                f'height="{bar_h}" rx="2" fill="{COLOURS[bar.ending]}" stroke="#fff" '
                f'stroke-width="0.5"><title>{escape(tip)}</title></rect>'
            )
        out.append("</g>")
    for marker in story.markers:
        out.append(_marker(marker, scale, rows, row_h, height))
    out.append("</svg>")
    return "\n".join(out)


def _marker(marker: Marker, scale: _Scale, rows: dict[str, int], row_h: int, height: int) -> str:
    x = scale.x(marker.time)
    tip = f"<title>{escape(_time_label(round(marker.time - scale.start, 1)))}: {escape(marker.text)}</title>"
    task = "" if marker.task is None else f' data-task="{escape(marker.task)}"'
    head = f'<g class="marker {marker.kind.value}"{task}>{tip}'
    if marker.task is None or marker.task not in rows:
        # A moment of the whole run (a notice, a gang restart): a line across every row.
        if marker.kind is MarkerKind.NOTICE:
            line = 'stroke="#1f77b4" stroke-width="2" stroke-dasharray="5 3"'
            label = (
                f'<text x="{x:.1f}" y="{height - 1}" text-anchor="middle" fill="#1f77b4">'
                "notice</text>"
            )
        elif marker.kind is MarkerKind.RESIZE:
            line = 'stroke="#2ca02c" stroke-width="2"'
            world = escape(marker.text.split(" on ")[0].split(" from ")[0].split(":")[0])
            label = (
                f'<text x="{x:.1f}" y="{height - 1}" text-anchor="middle" fill="#2ca02c">'
                f"{world}</text>"
            )
        else:
            line, label = 'stroke="#333" stroke-width="1.2" stroke-dasharray="2 2"', ""
        return (
            f'{head}<line x1="{x:.1f}" y1="{AXIS_H - 4}" x2="{x:.1f}" y2="{height - 12}" '
            f"{line}/>{_marker_shape(marker.kind, x, AXIS_H - 4, 8)}{label}</g>"
        )
    y = AXIS_H + rows[marker.task] * row_h + row_h / 2
    size = min(row_h, 14)
    label = ""
    if marker.kind is MarkerKind.ROOT_CAUSE:
        # Beside the disc, on the side with room for it.
        left = x > WIDTH - RIGHT - 80
        anchor = "end" if left else "start"
        at = x - size if left else x + size
        label = (
            f'<text x="{at:.1f}" y="{y + 4:.1f}" text-anchor="{anchor}" fill="#d62728" '
            'font-weight="bold">root cause</text>'
        )
    return f"{head}{_marker_shape(marker.kind, x, y, size)}{label}</g>"


def _marker_shape(kind: MarkerKind, x: float, y: float, size: float) -> str:
    """The marker's symbol centred on (x, y)."""
    h = size / 2
    if kind is MarkerKind.RESTART:  # a triangle pointing at the new attempt's start
        return (
            f'<polygon points="{x - h:.1f},{y - h:.1f} {x + h:.1f},{y - h:.1f} {x:.1f},{y + h:.1f}" '
            'fill="#333" stroke="#fff" stroke-width="0.8"/>'
        )
    if kind is MarkerKind.SAVE:  # a diamond
        return (
            f'<polygon points="{x:.1f},{y - h:.1f} {x + h:.1f},{y:.1f} {x:.1f},{y + h:.1f} '
            f'{x - h:.1f},{y:.1f}" fill="#1f77b4" stroke="#fff" stroke-width="1"/>'
        )
    if kind is MarkerKind.HANG:  # a square
        return (
            f'<rect x="{x - h * 0.8:.1f}" y="{y - h * 0.8:.1f}" width="{h * 1.6:.1f}" '
            f'height="{h * 1.6:.1f}" fill="#9467bd" stroke="#fff"/>'
        )
    if kind is MarkerKind.RESIZE:  # a green bar: the world changed
        return (
            f'<rect x="{x - h * 0.4:.1f}" y="{y - h:.1f}" width="{h * 0.8:.1f}" '
            f'height="{h * 2:.1f}" fill="#2ca02c" stroke="#fff"/>'
        )
    if kind is MarkerKind.NOTICE:  # a dashed line
        return (
            f'<line x1="{x:.1f}" y1="{y - h:.1f}" x2="{x:.1f}" y2="{y + h:.1f}" stroke="#1f77b4" '
            'stroke-width="2" stroke-dasharray="3 2"/>'
        )
    # The root cause: a red disc with an exclamation mark.
    return (
        f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{h:.1f}" fill="#d62728" stroke="#fff"/>'
        f'<rect x="{x - 0.9:.1f}" y="{y - h * 0.6:.1f}" width="1.8" height="{h * 0.7:.1f}" fill="#fff"/>'
        f'<rect x="{x - 0.9:.1f}" y="{y + h * 0.3:.1f}" width="1.8" height="1.8" fill="#fff"/>'
    )


def _moments(story: Story) -> str:
    """The markers as a list of moments, in time order."""
    markers = sorted(story.markers, key=lambda m: m.time)
    if not markers:
        return ""
    rows = [
        f'<tr><td class="t">{escape(_time_label(round(m.time - story.start, 1)))}</td>'
        f'<td>{MARKER_MEANINGS[m.kind]}</td><td class="what">{escape(m.text)}</td></tr>'
        for m in markers[:MOMENTS_LISTED]
    ]
    more = len(markers) - MOMENTS_LISTED
    tail = f'<p class="meta">and {more} more moments (all drawn above)</p>' if more > 0 else ""
    return f'<table class="moments">{"".join(rows)}</table>{tail}'


def _charts(story: Story) -> str:
    scale = _Scale(story.start, story.end)
    colours = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(story.tasks)}
    loss = {
        n: [(p.time, p.loss, p.attempt) for p in pts if p.loss is not None]
        for n, pts in story.series.items()
    }
    rate = {
        n: [(p.time, p.steps_per_s, p.attempt) for p in pts if p.steps_per_s is not None]
        for n, pts in story.series.items()
    }
    out = [
        _chart("loss", "loss", loss, scale, colours),
        _chart("steps/s", "steps-per-s", rate, scale, colours, from_zero=True),
    ]
    shown = [n for n in story.tasks if loss.get(n) or rate.get(n)]
    if shown and len(shown) <= LEGEND_TASKS:
        spans = "".join(
            f'<span><i style="background:{colours[n]}"></i>{escape(n)}</span>' for n in shown
        )
        out.append(f'<div class="legend">{spans}</div>')
    elif shown:
        out.append(f'<p class="meta">one line per task ({len(shown)} tasks)</p>')
    return "\n".join(out)


def _chart(
    title: str,
    name: str,
    lines: dict[str, list[_Reading]],
    scale: _Scale,
    colours: dict[str, str],
    from_zero: bool = False,
) -> str:
    """One chart: a line per task (cut between attempts) on the timeline's time axis;
    ``from_zero``: the value axis starts at 0 (a rate's noise is not blown up)."""
    top, bottom = AXIS_H, AXIS_H + CHART_H
    height = bottom + 10
    out = [
        f'<svg class="chart {name}" viewBox="0 0 {WIDTH} {height}" xmlns="http://www.w3.org/2000/svg"'
        f' role="img" aria-label="{escape(title)} over time">',
        *_axis(scale, top, bottom),
        f'<text x="8" y="{top + 12}" font-weight="bold">{escape(title)}</text>',
    ]
    values = [v for pts in lines.values() for _, v, _ in pts if math.isfinite(v)]
    if not values:
        out.append(
            f'<text x="{LABEL_W + PLOT_W / 2}" y="{(top + bottom) / 2}" text-anchor="middle" '
            f'fill="#888">no {escape(title)} recorded (heartbeats and metrics of distlaunch.worker)</text>'
        )
        out.append("</svg>")
        return "\n".join(out)
    low, high = min(values), max(values)
    if from_zero:
        low = min(low, 0.0)
    if high - low < 1e-12:
        low, high = low - 1, high + 1
    pad = (high - low) * 0.05
    low, high = low - pad, high + pad

    def y(value: float) -> float:
        return bottom - (value - low) / (high - low) * (bottom - top)

    for tick in _value_ticks(low, high):
        out.append(
            f'<line x1="{LABEL_W}" y1="{y(tick):.1f}" x2="{WIDTH - RIGHT}" y2="{y(tick):.1f}" stroke="#eee"/>'
            f'<text x="{LABEL_W - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick:.4g}</text>'
        )
    for task, pts in lines.items():
        ordered = sorted(pts, key=_time_of)
        finite = [p for p in ordered if math.isfinite(p[1])]
        if not finite:
            continue
        colour = colours.get(task, "#555")
        out.append(f'<g class="series" data-task="{escape(task)}"><title>{escape(task)}</title>')
        for segment in _segments(ordered):
            coords = " ".join(f"{scale.x(t):.1f},{y(v):.1f}" for t, v, _ in segment)
            out.append(
                f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="1.5"/>'
            )
        out += [
            f'<circle cx="{scale.x(t):.1f}" cy="{y(v):.1f}" r="2" fill="{colour}"/>'
            for t, v, _ in _few(finite)
        ]
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def _segments(points: Sequence[_Reading]) -> list[list[_Reading]]:
    """``points`` (in time order) cut where the attempt changes and where a value is NaN or
    Infinity (left out: a gap): a line never bridges a restart, a resume or a diverged loss."""
    out: list[list[_Reading]] = []
    broken = True
    for point in points:
        if not math.isfinite(point[1]):
            broken = True
            continue
        if broken or out[-1][-1][2] != point[2]:
            out.append([])
        broken = False
        out[-1].append(point)
    return out


def _time_of(point: _Reading) -> float:
    return point[0]


def _few(points: Sequence[_Reading], most: int = 40) -> Iterable[_Reading]:
    """The points to draw as dots: all of a short line, none of a long one (its line is enough)."""
    return points if len(points) <= most else ()


def _value_ticks(low: float, high: float) -> list[float]:
    step = _round_step((high - low) / 5)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 1)]
