"""Plots of the benchmarks (matplotlib, the optional ``plot`` extra)."""

from __future__ import annotations

from collections.abc import Sequence


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("--plot needs matplotlib. Install it with `pip install matplotlib` "
                          "(the extra plot of keras_dist's pyproject.toml).") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def train_bars(path: str, labels: Sequence[str], values: Sequence[float], title: str) -> None:
    """Bars of img/sec per rank, one per kind of block."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    bars = ax.barh(list(labels)[::-1], list(values)[::-1], color="#4C72B0")
    ax.bar_label(bars, fmt="%.0f", padding=3)
    ax.set_xlabel("img/sec per rank (median over blocks)")
    ax.set_title(title)
    ax.margins(x=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bandwidth_lines(path: str, sizes: Sequence[int], series: dict[str, Sequence[float]],
                    title: str) -> None:
    """Bus bandwidth (GB/s) against message size (bytes, log scale), one line per series."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for label, values in series.items():
        ax.plot(list(sizes), list(values), marker="o", markersize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
