"""`python -m gyre.report RUN_DIR`: a run's metrics and role timeline as figures and one static
HTML page, for a finished run or one still running.

    RUN_DIR/report/metrics.png        reward (each execution, the step mean, and the fitted trend
                                      when summary.json has it), loss, clip fraction, staleness,
                                      step time, gradient norm, one panel each, against the step
    RUN_DIR/report/role_timeline.png  the run's own (written at its end); for a running run, one
                                      drawn from metrics.jsonl's per-step time per role per cell
                                      (the order of the states inside a step is not recorded there,
                                      so each step's slice is drawn in state order: approximate)
    RUN_DIR/report/report.html        the status, the summary, a table of the steps, the config
                                      (run.json) and both figures, embedded: no JS, no CSS files,
                                      the page can be mailed alone

Reads only files: run.json, metrics.jsonl (a torn last line of a running run is skipped),
summary.json and role_timeline.png when present. Does not import torch.
"""

from __future__ import annotations

import base64
import html
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import tyro

from gyre.runtime.cell import CellState
from gyre.runtime.outputs import plot_role_timeline

# The panels of metrics.png after the reward: (metrics.jsonl field, title).
PANELS = (("loss", "loss"), ("clip_frac", "clip fraction"), ("staleness_mean", "staleness d (mean)"),
          ("step_time_s", "step time (s)"), ("grad_norm", "gradient norm"))
# The per-step table's columns.
COLUMNS = ("step", "version", "reward_mean", "reward_count", "loss", "clip_frac", "staleness_mean", "cells_in_step",
           "step_time_s", "time_s")


@dataclass(kw_only=True)
class ReportArgs:
    """Render a Gyre run directory (finished or still running) as figures and a static HTML page."""

    run_dir: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="RUN_DIR")]
    """The run's directory (it holds run.json and metrics.jsonl), e.g. runs/cpu-demo/latest."""
    out: str = ""
    """Where to write metrics.png, role_timeline.png and report.html (empty: RUN_DIR/report/)."""


class NoRunError(ValueError):
    """The directory holds no run; the message names what is missing."""


@dataclass
class RunFiles:
    """What a run directory holds so far."""

    path: Path
    manifest: dict[str, Any] | None  # run.json: written when the run starts
    rows: list[dict[str, Any]]  # metrics.jsonl: a line per optimizer step
    summary: dict[str, Any] | None  # summary.json: written at the end
    timeline_png: Path | None  # role_timeline.png: written at the end

    @property
    def finished(self) -> bool:
        return self.summary is not None


def _read_rows(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's rows; a running run's last line may be half written: skip it."""
    rows = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
    return rows


def load_run(path: str | Path) -> RunFiles:
    """Read a run directory; NoRunError when it is not one."""
    p = Path(path)
    if not p.is_dir():
        raise NoRunError(f"{p}: no such directory (give a run directory, e.g. runs/cpu-demo/latest)")
    manifest_p, metrics_p = p / "run.json", p / "metrics.jsonl"
    if not manifest_p.exists() and not metrics_p.exists():
        raise NoRunError(f"{p} holds no Gyre run: neither run.json (written when a run starts) nor metrics.jsonl "
                         f"(a line per optimizer step) is there")
    summary_p, png = p / "summary.json", p / "role_timeline.png"
    return RunFiles(path=p,
                    manifest=json.loads(manifest_p.read_text()) if manifest_p.exists() else None,
                    rows=_read_rows(metrics_p) if metrics_p.exists() else [],
                    summary=json.loads(summary_p.read_text()) if summary_p.exists() else None,
                    timeline_png=png if png.exists() else None)


# ----------------------------------------------------------------------------- figures
def trend_line(rows: list[dict[str, Any]], trend: dict[str, Any]) -> tuple[list[float], list[float]] | None:
    """The fitted reward trend of `outputs.reward_trend` as two points (first and last step).

    reward_trend gives the rise (slope × (n − 1)) over the row index, fitted with every execution
    weighted alike; a least-squares line passes through the weighted means, here the mean row
    index and the mean reward over all executions. None without the rise or the rewards."""
    pts = [(i, float(r)) for i, row in enumerate(rows) for r in row.get("rewards") or [] if r is not None]
    if "fitted_rise" not in trend or not pts or len(rows) < 2:
        return None
    slope = trend["fitted_rise"] / (len(rows) - 1)
    xm = sum(i for i, _ in pts) / len(pts)
    ym = sum(r for _, r in pts) / len(pts)
    ends = [0, len(rows) - 1]
    return [rows[i]["step"] for i in ends], [ym + slope * (i - xm) for i in ends]


def plot_metrics(rows: list[dict[str, Any]], summary: dict[str, Any] | None, path: Path) -> None:
    """metrics.png: the reward panel, then one panel per PANELS field, against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    axes = axes.ravel()
    steps = [r["step"] for r in rows]
    ax = axes[0]
    xs = [r["step"] for r in rows for x in r.get("rewards") or [] if x is not None]
    ys = [x for r in rows for x in r.get("rewards") or [] if x is not None]
    ax.scatter(xs, ys, s=8, alpha=0.3, color="#4c9be8", label="executions")
    mean = [(r["step"], r["reward_mean"]) for r in rows if r.get("reward_mean") is not None]
    if mean:
        ax.plot(*zip(*mean), marker="o", color="#d1495b", label="step mean")
    trend = (summary or {}).get("reward_trend")
    line = trend_line(rows, trend) if trend else None
    if line:
        ax.plot(*line, "--", color="black", label=f"fitted rise {trend['fitted_rise']:.2f} "
                f"[{trend['fitted_rise_ci95_low']:.2f}, {trend['fitted_rise_ci95_high']:.2f}]")
    ax.set_title("reward")
    if rows:
        ax.legend(fontsize=8)
    for ax, (key, title) in zip(axes[1:], PANELS):
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if pts:
            ax.plot(*zip(*pts), marker="o")
        else:
            ax.text(0.5, 0.5, f"no {key} yet", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_title(title)
    from matplotlib.ticker import MaxNLocator

    for ax in axes:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if steps:
            ax.set_xlim(min(steps) - 0.5, max(steps) + 0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def intervals_from_rows(rows: list[dict[str, Any]]) -> dict[int, list[tuple[CellState, float, float]]]:
    """cell → [(state, start, end)] from metrics.jsonl's cumulative `cell_time_s`, for a run that
    has not written its timeline yet. Each step's slice [previous row's time_s, time_s] holds
    the seconds per state spent in it, laid out in CellState order (the order inside the slice
    is not in the rows). A resumed run's clock restarts: its rows continue after the last slice."""
    out: dict[int, list[tuple[CellState, float, float]]] = {}
    prev: dict[str, dict[str, float]] = {}
    prev_t, offset = 0.0, 0.0
    for row in rows:
        times, t = row.get("cell_time_s") or {}, row.get("time_s")
        if t is None:
            continue
        if t < prev_t:  # a resumed run: its ledger started again
            offset, prev, prev_t = offset + prev_t, {}, 0.0
        for cell, per_state in times.items():
            a = offset + prev_t
            for s in CellState:
                d = per_state.get(s.value, 0.0) - prev.get(cell, {}).get(s.value, 0.0)
                if d > 0:
                    out.setdefault(int(cell), []).append((s, a, a + d))
                    a += d
        prev, prev_t = times, t
    return out


# ----------------------------------------------------------------------------- the page
def _flat(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(d, dict) and d:
        return [kv for k, v in d.items() for kv in _flat(v, f"{prefix}{k}.")]
    return [(prefix[:-1], d)]


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if v is None:
        return "–"
    return html.escape(v if isinstance(v, str) else json.dumps(v, default=str))


def _table(pairs: list[tuple[str, Any]]) -> str:
    return "<table>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{_cell(v)}</td></tr>" for k, v in pairs) + "</table>"


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"><figcaption>{html.escape(alt)} ' \
           f'({html.escape(path.name)} beside this page)</figcaption></figure>'


STYLE = ("body{font-family:sans-serif;margin:2em;max-width:1400px} table{border-collapse:collapse;font-size:90%}"
         "th,td{border:1px solid #ccc;padding:2px 6px;text-align:left} th{background:#f4f4f4} img{max-width:100%}")


def launches(manifest: dict[str, Any] | None) -> list[dict[str, Any]]:
    """run.json's launches, each with `what` ("run", "attempt 1", ...): its `attempts` (written
    since runs were resumable), or the top-level fields of an older run.json.

    >>> [a["what"] for a in launches({"attempts": [{"attempt": 0}, {"attempt": 1}]})]
    ['run', 'attempt 1']
    """
    if not manifest:
        return []
    attempts = manifest.get("attempts") or ([manifest] if "started" in manifest else [])
    return [{**a, "what": "run" if a.get("attempt", 0) == 0 else f"attempt {a['attempt']}"} for a in attempts]


def evaluations(run_dir: Path) -> list[dict[str, Any]]:
    """`python -m gyre.eval`'s results in RUN/eval/ (the base model first, then by step)."""
    found = []
    for path in sorted((Path(run_dir) / "eval").glob("*.json")):
        try:
            e = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if {"checkpoint", "passed", "executions", "pass_rate"} <= set(e):
            found.append(e)
    return sorted(found, key=lambda e: (str(e.get("split")), Path(e["checkpoint"]).name.startswith("step_"),
                                        Path(e["checkpoint"]).name))


def render_html(run: RunFiles, figures: list[tuple[Path, str]]) -> str:
    """The page: status, summary, steps, figures, config."""
    cfg = (run.manifest or {}).get("config", {})
    if run.finished:
        err = run.summary.get("error")
        status = f"finished: {run.summary.get('steps')} steps in {run.summary.get('wall_s', 0):.0f} s" + \
                 (f" — stopped with an error: {err}" if err else "")
    else:
        status = f"running (or stopped before its end): {len(run.rows)} steps so far, no summary.json yet"
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>Gyre run {html.escape(str(run.path))}</title>",
             f"<style>{STYLE}</style></head><body>",
             f"<h1>Gyre run <code>{html.escape(str(run.path))}</code></h1>",
             f"<p><b>status</b>: {html.escape(status)}</p>"]
    trend = (run.summary or {}).get("reward_trend")
    if trend and "fitted_rise" in trend:  # what a reader comes for first: did the reward rise?
        from gyre.runtime.summary import trend_line

        parts.append(f"<p><b>{html.escape(trend_line(trend, run.summary.get('steps', '?')))}</b></p>")
    for a in launches(run.manifest):
        ended = a.get("ended") or {}
        end = f", ended {ended.get('at')} after {ended.get('steps')} steps" if ended else ", no end recorded"
        parts.append(f"<p><b>{html.escape(a['what'])}</b> started {html.escape(str(a.get('started')))} on "
                     f"{a.get('world_size')} ranks{html.escape(end)}: "
                     f"<code>{html.escape(' '.join(map(str, a.get('argv', []))))}</code></p>")
    parts.append("<h2>Figures</h2>" + "".join(_img(p, alt) for p, alt in figures))
    evals = evaluations(run.path)
    if evals:  # before / after: python -m gyre.eval's results beside the run
        rows = "".join(f"<tr><td>{html.escape(str(e.get('split')))}</td><td>{html.escape(Path(e['checkpoint']).name)}</td>"
                       f"<td>{e['passed']}/{e['executions']}</td><td>{e['pass_rate']:.3f}</td>"
                       f"<td>[{e['pass_ci95_low']:.3f}, {e['pass_ci95_high']:.3f}]</td></tr>" for e in evals)
        parts.append("<h2>Evaluations (python -m gyre.eval)</h2><table><tr><th>split</th><th>checkpoint</th>"
                     f"<th>passed</th><th>pass rate</th><th>95% interval</th></tr>{rows}</table>")
    if run.summary is not None:
        lead = {k: run.summary[k] for k in ("reward_trend", "steps", "execution_outcomes") if k in run.summary}
        parts.append("<h2>Summary (summary.json)</h2>" + _table(_flat({**lead, **run.summary})))
    head = "".join(f"<th>{c}</th>" for c in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{_cell(r.get(c))}</td>" for c in COLUMNS) + "</tr>" for r in run.rows)
    parts.append(f"<h2>Steps (metrics.jsonl: {len(run.rows)})</h2><table><tr>{head}</tr>{body}</table>")
    parts.append("<h2>Config (run.json)</h2>" + (_table(_flat(cfg)) if cfg else "<p>no run.json</p>"))
    parts.append("</body></html>")
    return "\n".join(parts)


def render(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the figures and report.html into `out` (default RUN_DIR/report/); returns the page."""
    run = load_run(run_dir)
    out_dir = Path(out) if out else run.path / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_metrics(run.rows, run.summary, out_dir / "metrics.png")
    figures = [(out_dir / "metrics.png", "metrics per step")]
    timeline = out_dir / "role_timeline.png"
    if run.timeline_png is not None:
        shutil.copyfile(run.timeline_png, timeline)
        figures.append((timeline, "role timeline"))
    else:
        ivs = intervals_from_rows(run.rows)
        if ivs:
            plot_role_timeline(ivs, str(timeline), title="Gyre role timeline (from metrics.jsonl, approximate)")
            figures.append((timeline, "role timeline so far (approximate: from metrics.jsonl)"))
    page = out_dir / "report.html"
    page.write_text(render_html(run, figures), encoding="utf-8")
    return page


def main(argv: list[str] | None = None) -> int:
    args = tyro.cli(ReportArgs, args=argv, prog="python -m gyre.report", description=__doc__)
    try:
        page = render(args.run_dir, args.out or None)
    except NoRunError as e:
        print(f"gyre.report: {e}", file=sys.stderr)
        return 2
    print(f"gyre.report: wrote {page} (and its figures beside it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
