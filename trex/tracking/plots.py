"""PNG plots for the tracking UIs: training loss curves and Pass@1 breakdowns (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def loss_curve(history: dict[str, list[tuple[int, float]]], path: str | Path, title: str,
               ylabel: str = "loss (nats / token)") -> Path:
    """One line per series (``loss``, ``mtp_loss`` ...; the RL stage's ``reward_mean``, ``pass_rate``) over
    optimizer steps."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    for name, points in history.items():
        if points:
            steps, values = zip(*sorted(points))
            ax.plot(steps, values, label=name, marker="." if len(points) < 40 else None)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def pass_at_1_bars(groups: dict[str, dict[str, float]], path: str | Path, title: str) -> Path:
    """One panel per grouping (benchmark, category, representation, family) with a bar per key."""
    plt = _pyplot()
    groups = {k: v for k, v in groups.items() if v}
    n = max(1, len(groups))
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n + 1, 3.6), dpi=100, squeeze=False)
    for ax, (name, values) in zip(axes[0], groups.items()):
        keys = list(values)
        ax.bar(range(len(keys)), [values[k] for k in keys], color="#3b7dd8")
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels(keys, rotation=45, ha="right", fontsize=8)
        ax.set_ylim(0, 1)
        ax.set_title(f"Pass@1 by {name}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    return _save(plt, fig, path)


def compare_bars(table: dict, path: str | Path, title: str = "Pass@1 by benchmark") -> Path:
    """Grouped bars of several models over the benchmarks of an ``eval.compare.compare`` table, with the
    Pass@1 intervals as error bars."""
    plt = _pyplot()
    benches, models = table["benchmarks"], list(table["models"])
    width = 0.8 / max(1, len(models))
    fig, ax = plt.subplots(figsize=(1.6 * len(benches) + 2.5, 3.8), dpi=100)
    for i, name in enumerate(models):
        cells = table["models"][name]["pass@1"]
        xs = [j + (i - (len(models) - 1) / 2) * width for j, b in enumerate(benches) if b in cells]
        vals = [cells[b]["value"] for b in benches if b in cells]
        err = [[cells[b]["value"] - cells[b]["low"] for b in benches if b in cells],
               [cells[b]["high"] - cells[b]["value"] for b in benches if b in cells]]
        ax.bar(xs, vals, width, yerr=err, capsize=3, label=name)
    ax.set_xticks(range(len(benches)))
    ax.set_xticklabels(benches, rotation=30, ha="right", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel(f"Pass@1 ({table['confidence']:.0%} interval)")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)
