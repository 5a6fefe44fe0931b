"""The eval report: Markdown for people and MLflow, a PNG of the same content for the UI.

It holds the metrics table (this version beside the current champion, on the same reference set and
task files only, and beside each score how many of its set's items overlap the model's training data), the gate
decision with both numbers, the harness scores, a sample generation and the training loss curve.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Report:
    model: str
    version: int
    decision: str
    rows: list[tuple[str, str, str, str]]  # metric, this version, champion ("" when not comparable), overlap
    sample: dict | None = None
    losses: list = field(default_factory=list)  # [[step, loss], …] of training
    notes: list[str] = field(default_factory=list)


def _fmt(v) -> str:
    return "" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)


OVERLAP = "eval items in training data"


def overlap_of(metric: str, contamination: dict[str, str]) -> str:
    """The contamination of the set a metric is measured on (``harness.<task>.*`` → task, ``reference_bpb`` →
    reference; the held-out split is the run's own data)."""
    if metric == "reference_bpb":
        return contamination.get("reference", "")
    if metric.startswith("harness."):
        return contamination.get(metric.split(".")[1], "")
    return ""


def rows(metrics: dict, champion: dict, comparable: set[str], contamination: dict[str, str] | None = None
         ) -> list[tuple[str, str, str, str]]:
    """One row per metric; the champion's column only where the two numbers score the same thing; the last column
    says how many items of the metric's set overlap the training data (``3/500``; ``unchecked`` when unknown)."""
    con = contamination or {}
    return [(k, _fmt(v), _fmt(champion.get(k)) if k in comparable else "", overlap_of(k, con))
            for k, v in metrics.items()]


def markdown(r: Report) -> str:
    out = [f"# Eval report: {r.model} v{r.version}", "", f"**Gate:** {r.decision}", "",
           f"| metric | this version | champion (same set) | {OVERLAP} |", "|---|---:|---:|---:|"]
    out += [f"| {m} | {a} | {b} | {c} |" for m, a, b, c in r.rows]
    if r.sample:
        out += ["", "## Sample generation", "", f"prompt: `{r.sample['prompt']}`", "", "> " +
                r.sample["text"].replace("\n", "\n> ")]
    out += ["", "## Notes", ""] + [f"- {n}" for n in r.notes] if r.notes else []
    out += ["", "![report](report.png)", ""]
    return "\n".join(out)


def png(r: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(14, 0.35 * len(r.rows) + 3.2),
                                     gridspec_kw={"width_ratios": [1.25, 1]})
    ax_t.axis("off")
    ax_t.set_title(f"{r.model} v{r.version}\n{r.decision}", fontsize=9, loc="left", wrap=True)
    if r.rows:
        tbl = ax_t.table(cellText=[list(x) for x in r.rows],
                         colLabels=["metric", "this version", "champion (same set)", OVERLAP],
                         loc="upper left", cellLoc="left", colWidths=[0.42, 0.17, 0.2, 0.21])
        tbl.auto_set_font_size(False)
        tbl.set_fontsize(8)
        tbl.scale(1, 1.25)
    if r.sample:
        ax_t.text(0, -0.02, f"sample: {r.sample['prompt']!r} → {r.sample['text'][:160]!r}", fontsize=7,
                  transform=ax_t.transAxes, va="top", wrap=True)
    if r.losses:
        steps, loss = zip(*[(s, l) for s, l in r.losses])
        ax_l.plot(steps, loss)
    ax_l.set_xlabel("step")
    ax_l.set_ylabel("training loss (nats/token)")
    ax_l.set_title("training loss")
    ax_l.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(r: Report, out_dir: Path) -> tuple[Path, Path]:
    md, img = out_dir / "report.md", out_dir / "report.png"
    md.write_text(markdown(r))
    png(r, img)
    return md, img
