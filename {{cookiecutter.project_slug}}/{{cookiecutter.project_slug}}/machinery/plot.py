"""Draw a run's loss curves from its metrics file to a PNG.

    python -m {{ cookiecutter.project_slug }}.machinery.plot                                  # logs/metrics.jsonl -> logs/loss.png
    python -m {{ cookiecutter.project_slug }}.machinery.plot --metrics-file runs/a/metrics.jsonl --out a.png

The metrics file is what train.py writes on rank 0 (`--metrics-file`): one JSON object per logged step, with
"step" and the metrics of that step ("loss", "lr", "val_loss", "val_<name>", ...). Drawing needs matplotlib
(`pip install matplotlib`, or the project's `plot` extra); reading the file does not.
"""

import argparse
import json
import math
import sys
from pathlib import Path

DEFAULT_METRICS = "logs/metrics.jsonl"
DEFAULT_OUT = "logs/loss.png"
CURVES = (("loss", "train loss"), ("val_loss", "validation loss"))


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics file in step order, one per step.

    Lines that do not parse are skipped: a job killed mid-write leaves a partial last line. A step logged twice
    (the steps a resumed run redoes after its last snapshot) keeps its newest record.
    """
    by_step: dict[int, dict] = {}
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]


def curves(records: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """{metric: (steps, values)} for each loss curve present in the records; non-finite values left out."""
    found = {}
    for name, _ in CURVES:
        points = [
            (r["step"], float(r[name]))
            for r in records
            if isinstance(r.get(name), (int, float)) and math.isfinite(r[name])
        ]
        if points:
            found[name] = ([step for step, _ in points], [value for _, value in points])
    return found


def draw(lines: dict[str, tuple[list[int], list[float]]], out: str | Path, title: str = "") -> Path:
    """Write the curves to a PNG at `out` (folders created); a log-scale loss axis when every value is > 0."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, on a cluster node either
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=100)
    labels = dict(CURVES)
    for name, (steps, values) in lines.items():
        validation = name.startswith("val_")
        axes.plot(
            steps,
            values,
            label=labels[name],
            marker="o" if validation else None,
            markersize=4,
            linewidth=1.5 if validation else 1.0,
        )
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
