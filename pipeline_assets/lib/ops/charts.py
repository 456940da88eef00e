"""Pictures for Dagster metadata and MLflow: where people would rather look than read."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def slice_bars_png(
    slices: list[str],
    candidate: list[float],
    champion: list[float] | None,
    path: Path,
    title: str,
    ylabel: str = "loss (nats/token)",
) -> Path:
    """A measure per slice (loss by default), the candidate's bar beside the champion's."""
    plt = _pyplot()
    width = 0.4 if champion else 0.6
    figure, axis = plt.subplots(figsize=(max(6, 0.9 * len(slices) + 2), 4.5), dpi=110)
    positions = list(range(len(slices)))
    axis.bar(
        [p - (width / 2 if champion else 0) for p in positions], candidate, width, label="candidate"
    )
    if champion:
        axis.bar([p + width / 2 for p in positions], champion, width, label="champion")
    axis.set_xticks(positions, slices, rotation=30, ha="right")
    axis.set(ylabel=ylabel, title=title)
    axis.grid(axis="y", alpha=0.3)
    axis.legend()
    return _saved(plt, figure, path)


def loss_curve_png(
    history: list[dict], path: Path, title: str, unit: str = "nats/token"
) -> Path | None:
    """Training loss per log step, with validation loss where it was measured; ``unit``: what the
    loss is a mean over."""
    train = [row for row in history if "loss" in row]
    validation = [row for row in history if "validation_loss" in row]
    if not train:
        return None
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 4), dpi=110)
    axis.plot(
        [r["step"] for r in train], [r["loss"] for r in train], label="training loss", linewidth=1.5
    )
    if validation:
        axis.plot(
            [r["step"] for r in validation],
            [r["validation_loss"] for r in validation],
            "o-",
            label="validation loss",
            linewidth=1.5,
        )
    axis.set(xlabel="step", ylabel=f"loss ({unit})", title=title)
    axis.grid(alpha=0.3)
    axis.legend()
    return _saved(plt, figure, path)


def time_breakdown_png(
    stages: list[str], wall_seconds: list[float], cost_usd: list[float], path: Path, title: str
) -> Path:
    """Two stacked bars: each stage's share of the wall time, and of the cost."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(8, 3.6), dpi=110)
    totals = {"wall time": sum(wall_seconds) or 1.0, "cost": sum(cost_usd) or 1.0}
    left = {"wall time": 0.0, "cost": 0.0}
    for stage, seconds, dollars in zip(stages, wall_seconds, cost_usd, strict=True):
        shares = {"wall time": seconds / totals["wall time"], "cost": dollars / totals["cost"]}
        axis.barh(list(shares), list(shares.values()), left=[left[k] for k in shares], label=stage)
        for key in shares:
            left[key] += shares[key]
    axis.set(
        xlabel=f"share (wall {totals['wall time']:,.0f} s, cost ${totals['cost']:.4f})",
        title=title,
        xlim=(0, 1),
    )
    axis.legend(
        loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=min(len(stages), 6), fontsize=8
    )
    return _saved(plt, figure, path)


def reward_curve_png(history: list[dict], path: Path, title: str) -> Path | None:
    """An RL run's mean reward per policy version, with held-out accuracy where it was measured."""
    if not history:
        return None
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 4), dpi=110)
    axis.plot(
        [r["policy_version"] for r in history],
        [r["reward_mean"] for r in history],
        label="mean reward",
        linewidth=1.5,
    )
    held_out = [r for r in history if "held_out_accuracy" in r]
    if held_out:
        axis.plot(
            [r["policy_version"] for r in held_out],
            [r["held_out_accuracy"] for r in held_out],
            "o-",
            label="held-out accuracy (greedy)",
            linewidth=1.5,
        )
    axis.set(xlabel="policy version", ylabel="reward / accuracy", title=title, ylim=(-0.02, 1.02))
    axis.grid(alpha=0.3)
    axis.legend()
    return _saved(plt, figure, path)


def _saved(plt, figure, path: Path) -> Path:
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path
