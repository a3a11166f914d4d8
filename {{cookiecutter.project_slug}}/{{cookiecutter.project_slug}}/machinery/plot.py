"""Draw a run's loss curves from its metrics file to a PNG.

    python -m {{ cookiecutter.project_slug }}.machinery.plot                                  # logs/metrics.jsonl -> logs/loss.png
    python -m {{ cookiecutter.project_slug }}.machinery.plot --metrics-file runs/a/metrics.jsonl --out a.png

The metrics file is what train.py writes on rank 0 (`--metrics-file`): one JSON object per logged step, with
"step" and the metrics of that step ("loss", "lr", "val_loss", "val_<name>", ...). Drawing needs matplotlib
(`pip install matplotlib`, or the project's `plot` extra); reading the file does not.
"""

import argparse
import json
import logging
import math
import sys
from pathlib import Path

log = logging.getLogger(__name__)
DEFAULT_METRICS = "logs/metrics.jsonl"
DEFAULT_OUT = "logs/loss.png"
CURVES = (("loss", "train loss"), ("val_loss", "validation loss"))


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics file in step order, one per step (a step logged twice, as the steps a resumed run
    redoes after its last snapshot, keeps its newest record); lines that are no records are counted in one warning."""
    records, skipped = records_in(Path(path).read_bytes())
    if skipped:
        log.warning("%s: skipped %d line(s) that are not metrics records", path, skipped)
    by_step = {record["step"]: record for record, _ in records}
    return [by_step[step] for step in sorted(by_step)]


def records_in(content: bytes) -> tuple[list[tuple[dict, bytes]], int]:
    """The records in a metrics file's bytes, each with its line, and the number of other lines (not counting a
    partial last line: what a crash leaves). A record is a JSON object with an integer step."""
    lines = content.split(b"\n")
    records, skipped = [], 0
    for number, line in enumerate(lines):
        try:
            record = json.loads(line.decode("utf-8"))
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            record = None
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and not isinstance(step, bool):
            records.append((record, line + b"\n"))  # a last line complete but for its newline too
        elif line.strip() and number < len(lines) - 1:
            skipped += 1
    return records, skipped


def curves(records: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """{metric: (steps, values)} for each loss curve present in the records; non-finite values left out."""
    found = {}
    for name, _ in CURVES:
        points = [(r["step"], value) for r in records if (value := _number(r.get(name))) is not None]
        if points:
            found[name] = ([step for step, _ in points], [value for _, value in points])
    return found


def _number(value) -> float | None:
    """A finite JSON number as a float; None for anything else (null, text, a bool, an integer too large)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def draw(lines: dict[str, tuple[list[int], list[float]]], out: str | Path, title: str = "") -> Path:
    """Write the curves to a PNG at `out` (folders created); a log-scale loss axis when every value is > 0."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, on a cluster node either
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=100)
    labels = dict(CURVES)
    for name, (steps, values) in lines.items():
        style = {"marker": "o", "linewidth": 1.5} if name.startswith("val_") else {"marker": None, "linewidth": 1.0}
        axes.plot(steps, values, label=labels[name], markersize=4, **style)
    if all(value > 0 for _, values in lines.values() for value in values):
        axes.set_yscale("log")
        plain = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")  # 0.3, not 3x10^-1
        axes.yaxis.set_major_formatter(plain)
        axes.yaxis.set_minor_formatter(plain)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss")
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    plt.close(figure)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Draw the train and validation loss of a run to a PNG.")
    parser.add_argument("--metrics-file", default=DEFAULT_METRICS, help="what train.py wrote (default: %(default)s)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="the PNG to write (default: %(default)s)")
    args = parser.parse_args(argv)

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plotting needs matplotlib, which is not installed: pip install matplotlib", file=sys.stderr)
        return 1
    path = Path(args.metrics_file)
    if not path.is_file():
        print(f"no metrics file at {path}: train first (train.py writes it, --metrics-file {path})", file=sys.stderr)
        return 1
    lines = curves(read_metrics(path))
    if not lines:
        print(f"{path} holds no loss values yet: nothing to draw", file=sys.stderr)
        return 1
    out = draw(lines, args.out, title=str(path))
    counts = ", ".join(f"{len(steps)} {name} points" for name, (steps, _) in lines.items())
    print(f"wrote {out} ({counts})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
