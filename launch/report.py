"""``python -m launch.report RUN [RUN ...] --out report.html [--png DIR]``: one HTML page of
a training run's dynamics, several runs overlaid.

Reads only the run folder (``config.yaml``, ``metrics.jsonl``, ``histograms.jsonl``), so it
needs no W&B and works on a run that is still going (a partial last line is skipped). The
page is self-contained: figures are PNGs embedded as base64. ``--png DIR`` also writes them
as files (``DIR/<figure>.png``, at ``--dpi``). ``--evaluation FILE.json`` (``launch.evaluate
--json``) adds an evaluation to draw; ``launch.evaluate --log-to-run`` puts one in the run.
The figures and what to read in them: :mod:`offline.report_figures`,
:mod:`offline.evaluation_figures`.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from matplotlib.figure import Figure

from data_pipeline.json_file import read_json
from data_pipeline.store import in_store
from offline.evaluation_figures import EVALUATION_FIGURES, EVALUATION_WHEN_ABSENT
from offline.report_figures import FIGURES, WHEN_ABSENT, RunData
from trainer.errors import EXIT_STATUS, Refused
from trainer.telemetry import run_files
from trainer.telemetry.evaluation_log import flat_metrics
from trainer.yaml_file import read_mapping

ALL_FIGURES = {**FIGURES, **EVALUATION_FIGURES}
ALL_WHEN_ABSENT = {**WHEN_ABSENT, **EVALUATION_WHEN_ABSENT}


class ReportError(Refused, ValueError):
    """A folder that is not a run, or a run file that cannot be read: one line."""


def load_run(folder: str | Path, label: str | None = None) -> RunData:
    """Read one run folder (the trainer's ``output``: a path, or a URL whose run files are
    copied here first)."""
    if in_store(str(folder)):
        from data_pipeline.store import StorageError
        from trainer.run_store import fetch_run_files

        try:
            label, folder = label or str(folder), fetch_run_files(str(folder))
        except StorageError as err:
            raise ReportError(str(err)) from None
    folder = Path(folder)
    if not folder.is_dir():
        raise ReportError(f"{folder}: no such folder")
    missing = [n for n in ("config.yaml", run_files.METRICS) if not (folder / n).is_file()]
    if missing:
        raise ReportError(f"{folder}: not a run folder (no {' or '.join(missing)}; give the "
                          f"`output` folder of launch.train, e.g. runs/<name>)")
    try:
        config = read_mapping(folder / "config.yaml")
        rows = run_files.read_jsonl(folder / run_files.METRICS)
        hist = run_files.read_histograms(folder / run_files.HISTOGRAMS)
    except (run_files.RunFileError, KeyError, TypeError, ValueError) as err:
        raise ReportError(f"{folder}: {str(err).splitlines()[0]}") from None
    return RunData(
        label=label or folder.resolve().name,
        config=config if isinstance(config, dict) else {},
        train=[r for r in rows if "loss" in r],
        evals=[r for r in rows if any(k.startswith("val/") for k in r)],
        hist=hist,
    )


def load_runs(folders: Sequence[str | Path]) -> list[RunData]:
    """Every folder, labelled by its name (by its path where two names collide)."""
    names = [Path(f).resolve().name for f in folders]
    return [load_run(f, label=n if names.count(n) == 1 else str(f))
            for f, n in zip(folders, names, strict=True)]


def load_evaluation(path: str | Path) -> RunData:
    """``launch.evaluate --json``'s file as a run with one evaluation row and nothing else."""
    path = Path(path)
    results = read_json(path, "evaluation results", error=ReportError)
    if not all(isinstance(r, dict) for r in results.values()):
        raise ReportError(f"{path}: expected {{set: {{metric: value}}}} (launch.evaluate "
                          "--json)")
    return RunData(label=path.stem, config={}, train=[],
                   evals=[{"step": 0, **flat_metrics(results)}], hist=None)


def build_figures(runs: list[RunData]) -> dict[str, Figure]:
    """The report's figures in order; those no run has data for are left out."""
    out = {}
    for slug, (build, _) in ALL_FIGURES.items():
        fig = build(runs)
        if fig is not None:
            out[slug] = fig
    return out


def png_bytes(fig: Figure, dpi: int = 90) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def _run_table(runs: list[RunData]) -> str:
    head = ("run", "margin", "s", "C", "sample rate", "steps logged", "last loss", "evaluations")
    lines = ["<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for run in runs:
        cfg = run.config
        margin = cfg.get("margin") or {}
        kind = margin.get("type", "?") + (f" ({margin['adacos']})" if margin.get("adacos") else "")
        scale = "AdaCos" if margin.get("type") == "adacos" else margin.get("s", "?")
        losses = [r["loss"] for r in run.train if r.get("loss") is not None]
        cells = (run.label, kind, scale, run.num_classes or "?",
                 (cfg.get("head") or {}).get("sample_rate", "?"),
                 run.train[-1]["step"] if run.train else "none yet",
                 f"{losses[-1]:.4f}" if losses else "-", len(run.evals))
        lines.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return "\n".join(lines + ["</table>"])


def render_html(runs: list[RunData], figures: dict[str, Figure], dpi: int = 90) -> str:
    """The self-contained page."""
    parts = []
    for slug, fig in figures.items():
        data = base64.b64encode(png_bytes(fig, dpi)).decode("ascii")
        caption = html.escape(ALL_FIGURES[slug][1])
        parts.append(f'<figure id="{slug}"><img alt="{slug}" src="data:image/png;base64,{data}">'
                     f"<figcaption>{caption}</figcaption></figure>")
    absent = [ALL_WHEN_ABSENT[slug] for slug in ALL_FIGURES if slug not in figures]
    note = (f"<p class=note>Not drawn, as these runs did not record it: "
            f"{html.escape('; '.join(absent))}.</p>" if absent else "")
    title = "partial-fc report: " + ", ".join(r.label for r in runs)
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:1em auto}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 8px}}
figure{{margin:1.5em 0}}img{{max-width:100%}}figcaption,.note{{color:#555}}</style></head>
<body><h1>{html.escape(title)}</h1><p>Generated {when} by <code>python -m launch.report</code>.</p>
{_run_table(runs)}
{note}
{"".join(parts)}
</body></html>
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m launch.report",
        description="Plot one or more training runs (loss, lr, s, B_avg, theta_med, angle "
        "histograms, throughput, verification, IJB's TAR-FAR curve, RFW's groups) into one "
        "self-contained HTML page.",
        epilog=EXIT_STATUS,
    )
    parser.add_argument("runs", nargs="*", metavar="RUN",
                        help="run folders (launch.train's output)")
    parser.add_argument("--evaluation", nargs="+", default=[], metavar="JSON",
                        help="launch.evaluate --json files: IJB's TAR-FAR curve, RFW's groups")
    parser.add_argument("--out", default="report.html", help="HTML file (default: report.html)")
    parser.add_argument("--png", metavar="DIR", help="also write each figure as DIR/<name>.png")
    parser.add_argument("--dpi", type=int, default=90, help="PNG resolution (default: 90)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (args.runs or args.evaluation):
        print("report: give run folders and/or --evaluation files", file=sys.stderr)
        return 2
    try:
        runs = load_runs(args.runs) + [load_evaluation(p) for p in args.evaluation]
    except ReportError as err:
        print(f"report: {err}", file=sys.stderr)
        return err.exit_code
    figures = build_figures(runs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(runs, figures, args.dpi))
    if args.png:
        folder = Path(args.png)
        folder.mkdir(parents=True, exist_ok=True)
        for slug, fig in figures.items():
            (folder / f"{slug}.png").write_bytes(png_bytes(fig, args.dpi))
    print(f"report: {len(figures)} figures of {len(runs)} run(s) -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
