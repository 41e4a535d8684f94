"""A step's cost across hosts, on paper: fitted to the emulated hosts' measurements.

    python benchmarks/emulated_hosts_cost.py [--plot-dir docs/img]

No processes, no hosts: it reads what ``emulated_hosts_allreduce.py`` and
``emulated_hosts_train.py`` wrote to ``benchmarks/results/`` (their rank 0's
tables and ``RESULT`` lines) and fits, per peer (kd, mpi, gloo), a ring
allreduce's cost over H hosts of one rank each::

    T(n, H) = alpha * 2(H-1) + beta * n * 2(H-1)/H

(``alpha`` a ring step's latency, ``beta`` seconds per byte on the wire: 1 /
``beta`` over the measured link is the fraction of the link the peer
reaches), least squares on relative error over every size and host count
measured with one rank per host. A training step is then::

    step(H) = compute + g * n + T(n, H)

``compute`` the model's step alone (measured), ``n`` the gradient bytes
(float32; half with fp16 compression), ``g`` seconds per gradient byte outside
the wire (copies, the host call; negative where the exchange overlaps the
backward pass, as DDP's buckets do), fitted per configuration to the measured
steps at 2 and 4 hosts. Printed: the fitted constants, measured beside fitted
for every point, and predicted steps at 16, 64 and 256 hosts at 10 and 100
Gbit/s for the CNN and for a 100 M-parameter model (its compute scaled from
the MLP's by parameter count: a dense model on this CPU), with the link taken
at the fitted fraction of its rate (``--link-efficiency`` to override). What
the fit cannot know: the latencies were measured on a loaded 2-core machine
(milliseconds, where a quiet cluster's are tens of microseconds), so alpha is
pessimistic; and 10 and 100 Gbit/s were never measured here (this machine's
CPUs carry about 280 MB/s between namespaces when busy).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
PEERS_OF = {"keras_dist": "kd", "keras_dist-fp16": "kd", "DDP": "gloo"}


def allreduce_points(paths: list[Path]) -> dict[str, list[tuple[int, int, float, float]]]:
    """Per peer: (hosts, bytes, seconds, link bytes/s) of every row with one rank per
    host, from runs with MPICH's and UCX's defaults (not those that set ``MPIR_CVAR_*``
    or ``UCX_*`` variables on their command line, which probed other settings)."""
    points: dict[str, list] = {}
    for path in paths:
        hosts = ranks = 0
        link = 0.0
        peers: list[str] = []
        probe = False
        for line in path.read_text().splitlines():
            if re.match(r"^# \d{4}-\d\d-\d\d \d\d:\d\d UTC;", line):
                probe = "MPIR_CVAR" in line or "UCX_" in line
            if probe:
                continue
            layout = re.match(r"## (\d+) hosts x (\d+) rank", line)
            if layout:
                hosts, ranks = int(layout.group(1)), int(layout.group(2))
            found = re.search(r"link ([0-9.]+) MB/s \(one TCP stream\)", line)
            if found:
                link = float(found.group(1)) * 1e6
            if " time(us)" in line:
                peers = re.findall(r"(\w+) time\(us\)", line)
            row = re.match(r"^\[0\]\s+(\d+)\s+\d+\s+float\s+sum\s+\|(.*)$", line)
            if row and ranks == 1 and peers:
                cells = row.group(2).split("|")
                for peer, cell in zip(peers, cells):
                    points.setdefault(peer, []).append(
                        (hosts, int(row.group(1)), float(cell.split()[0]) / 1e6, link))
    return points


#: How a collective's latency term grows with the hosts: the issue's form (a
#: constant), a tree's or recursive doubling's (log2 H), a ring's (2(H-1) steps).
LATENCY = {"constant": lambda hosts: np.ones_like(hosts), "log2": np.log2,
           "ring": lambda hosts: 2 * (hosts - 1)}


def ring_terms(nbytes, hosts, form: str):
    nbytes, hosts = np.broadcast_arrays(np.asarray(nbytes, float), np.asarray(hosts, float))
    return np.stack([LATENCY[form](hosts), nbytes * 2 * (hosts - 1) / hosts], axis=-1)


def fit_ring(points, form: str) -> tuple[float, float, str]:
    """(alpha, beta, form) minimising the relative error of T over ``points``."""
    hosts, nbytes, seconds, _ = (np.asarray(v, float) for v in zip(*points))
    terms = ring_terms(nbytes, hosts, form) / seconds[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(terms, np.ones_like(seconds), rcond=None)
    return float(alpha), float(beta), form


def ring_seconds(fit: tuple[float, float, str], nbytes, hosts):
    alpha, beta, form = fit
    return ring_terms(nbytes, hosts, form) @ np.array([alpha, beta])


def relative_error(fit, points) -> float:
    """Root mean square of fitted / measured - 1."""
    hosts, nbytes, seconds, _ = (np.asarray(v, float) for v in zip(*points))
    return float(np.sqrt(np.mean((ring_seconds(fit, nbytes, hosts) / seconds - 1) ** 2)))


def train_points(paths: list[Path]) -> list[dict]:
    return [json.loads(line.split("RESULT ", 1)[1]) for path in paths
            for line in path.read_text().splitlines() if "RESULT " in line]


def gradient_bytes(parameters: float) -> float:
    """What crosses the wire per step: float32 gradients. keras_dist's fp16
    compression too: float16 has no MPI datatype, so ``MpiTransport`` sends
    it as float32; its conversions show up in the fitted overhead."""
    return 4.0 * parameters


def fit_overhead(rows: list[dict], fits: dict) -> tuple[float, float]:
    """(c, g): seconds per step and per gradient byte outside the wire, for one
    configuration, least squares over its measured steps."""
    peer = PEERS_OF[rows[0]["config"]]
    n = np.array([gradient_bytes(r["parameters"]) for r in rows])
    rest = np.array([(r["step_ms"] - r["alone_ms"]) / 1e3 for r in rows]) - ring_seconds(
        fits[peer], n, [r["hosts"] for r in rows])
    (c, g), *_ = np.linalg.lstsq(np.stack([np.ones_like(n), n], axis=-1), rest, rcond=None)
    return float(c), float(g)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allreduce", nargs="*", type=Path,
                        default=sorted(RESULTS.glob("emulated_hosts_allreduce_1gbit_*.txt")))
    parser.add_argument("--train", nargs="*", type=Path,
                        default=sorted(RESULTS.glob("emulated_hosts_train_*.txt")))
    parser.add_argument("--link-efficiency", type=float, default=None,
                        help="fraction of 10 / 100 Gbit/s reached (default: each peer's fitted "
                        "fraction of the measured 1 Gbit/s link)")
    parser.add_argument("--alpha-ms", type=float, default=None,
                        help="the latency term's alpha in the predictions (default: each "
                        "peer's fitted alpha, measured on a loaded machine)")
    parser.add_argument("--latency", choices=sorted(LATENCY), default=None,
                        help="how the latency term grows with the hosts (default: the form "
                        "that fits the allreduce points best)")
    parser.add_argument("--plot-dir", type=Path, default=None,
                        help="write emulated_hosts_allreduce_fit.png and "
                        "emulated_hosts_step_hosts.png there (matplotlib)")
    args = parser.parse_args(argv)

    points = {peer: rows for peer, rows in allreduce_points(args.allreduce).items()
              if peer in ("kd", "mpi", "gloo")}
    links = {peer: float(np.median([p[3] for p in rows])) for peer, rows in points.items()}
    print("# allreduce T = alpha*L(H) + beta*n*2(H-1)/H over H hosts of one rank, 1 Gbit/s; "
          "rms of fitted/measured - 1 per latency form L:")
    errors = {form: {peer: relative_error(fit_ring(rows, form), rows)
                     for peer, rows in points.items()} for form in LATENCY}
    for form, by_peer in errors.items():
        print(f"  L(H) = {form:<8} " + "  ".join(f"{peer} {e:.2f}" for peer, e in by_peer.items()))
    form = args.latency or min(errors, key=lambda f: sum(errors[f].values()))
    fits = {peer: fit_ring(rows, form) for peer, rows in points.items()}
    print(f"# used: L(H) = {form}")
    for peer, (alpha, beta, _) in fits.items():
        print(f"{peer:>5}: alpha {alpha * 1e3:7.3f} ms, 1/beta {1 / beta / 1e6:6.1f} MB/s "
              f"({1 / beta / links[peer]:.2f} of the link, {links[peer] / 1e6:.1f} MB/s)")
    print(f"\n{'peer':>5} {'hosts':>5} {'bytes':>10} {'measured ms':>12} {'fitted ms':>10} "
          f"{'fit/meas':>8}")
    for peer, rows in points.items():
        for hosts, nbytes, seconds, _ in sorted(rows):
            fitted = float(ring_seconds(fits[peer], nbytes, hosts))
            print(f"{peer:>5} {hosts:>5} {nbytes:>10} {seconds * 1e3:>12.2f} "
                  f"{fitted * 1e3:>10.2f} {fitted / seconds:>8.2f}")

    rows = train_points(args.train)
    configs = sorted({r["config"] for r in rows})
    overhead = {c: fit_overhead([r for r in rows if r["config"] == c], fits) for c in configs}
    print("\n# step = compute alone + c + g*n + T(n, H), n the float32 gradient bytes; "
          "c, g per configuration: " + ", ".join(
              f"{c} {overhead[c][0] * 1e3:.1f} ms + {overhead[c][1] * 1e9:.1f} ns/byte"
              for c in configs))
    print(f"{'model':>5} {'config':>16} {'hosts':>5} {'measured ms':>12} {'fitted ms':>10} "
          f"{'alone ms':>9}")
    for r in sorted(rows, key=lambda r: (r["model"], r["config"], r["hosts"])):
        n = gradient_bytes(r["parameters"])
        c, g = overhead[r["config"]]
        fitted = r["alone_ms"] + 1e3 * (c + g * n + float(
            ring_seconds(fits[PEERS_OF[r["config"]]], n, r["hosts"])))
        print(f"{r['model']:>5} {r['config']:>16} {r['hosts']:>5} {r['step_ms']:>12.2f} "
              f"{fitted:>10.2f} {r['alone_ms']:>9.2f}")

    # Predictions: the CNN as measured, a 100 M-parameter dense model scaled from the MLP.
    def alone(model: str, config: str) -> float:
        """The model's step alone (s), mean over the runs that measured it."""
        return float(np.mean([r["alone_ms"] for r in rows
                              if r["model"] == model and r["config"] == config])) / 1e3

    def parameters_of(model: str) -> int:
        return next(r["parameters"] for r in rows if r["model"] == model)

    models = {}
    if any(r["model"] == "cnn" for r in rows):
        models["cnn"] = (parameters_of("cnn"), {c: alone("cnn", c) for c in configs})
    if any(r["model"] == "mlp" for r in rows):
        models["100M"] = (100e6, {c: alone("mlp", c) * 100e6 / parameters_of("mlp")
                                  for c in configs})

    def predict(model: str, config: str, gbit: float, hosts: int) -> tuple[float, float]:
        """(step, wire) seconds."""
        parameters, compute = models[model]
        peer = PEERS_OF[config]
        alpha, beta, _ = fits[peer]
        alpha = alpha if args.alpha_ms is None else args.alpha_ms / 1e3
        efficiency = args.link_efficiency or 1 / beta / links[peer]
        n = gradient_bytes(parameters)
        wire = float(ring_seconds((alpha, 1 / (efficiency * gbit * 1e9 / 8), form), n, hosts))
        c, g = overhead[config]
        return compute[config] + max(0.0, c + g * n) + wire, wire

    print("\n# predicted step in ms = compute + c + g*n (where > 0) + allreduce; "
          "(the allreduce's share of it)")
    print(f"{'model':>5} {'config':>16} {'Gbit/s':>6} " + " ".join(
        f"{f'H={h}':>16}" for h in (16, 64, 256)))
    for model in models:
        for config in configs:
            for gbit in (10, 100):
                cells = []
                for hosts in (16, 64, 256):
                    step, wire = predict(model, config, gbit, hosts)
                    cells.append(f"{step * 1e3:>9.1f} ({wire / step:4.2f})")
                print(f"{model:>5} {config:>16} {gbit:>6} " + " ".join(cells))
    if args.plot_dir:
        _plots(args.plot_dir, points, fits, rows, models, configs, predict)
    return 0


def _plots(folder: Path, points, fits, rows, models, configs, predict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(1, len(fits), figsize=(4.2 * len(fits), 3.6), sharey=True)
    for axis, (peer, fit) in zip(np.atleast_1d(axes), fits.items()):
        for hosts in sorted({p[0] for p in points[peer]}):
            mine = sorted((n, t) for h, n, t, _ in points[peer] if h == hosts)
            n = np.array([m[0] for m in mine], float)
            factor = n * 2 * (hosts - 1) / hosts / 1e6
            line, = axis.plot(n, factor / np.array([m[1] for m in mine]), "o", ms=3,
                              label=f"{hosts} hosts")
            axis.plot(n, factor / ring_seconds(fit, n, hosts), "-", color=line.get_color())
        axis.set(xscale="log", title=f"{peer}: measured (dots), fitted (lines)",
                 xlabel="allreduce bytes")
        axis.legend(fontsize=7)
    np.atleast_1d(axes)[0].set_ylabel("bus bandwidth of the hosts, MB/s")
    figure.tight_layout()
    figure.savefig(folder / "emulated_hosts_allreduce_fit.png", dpi=110)
    figure, axes = plt.subplots(1, len(models), figsize=(4.8 * len(models), 3.8))
    hosts = [2, 4, 16, 64, 256]
    for axis, model in zip(np.atleast_1d(axes), models):
        for index, config in enumerate(configs):
            color = f"C{index}"
            for gbit, style in ((1, "-"), (10, "--"), (100, ":")):
                axis.plot(hosts, [1e3 * predict(model, config, gbit, h)[0] for h in hosts],
                          style, color=color, label=f"{config}, {gbit} Gbit/s (model)")
            mine = sorted((r["hosts"], r["step_ms"]) for r in rows
                          if r["model"] == model and r["config"] == config)
            if mine:
                axis.plot(*zip(*mine), "o", color=color, label=f"{config}, 1 Gbit/s measured")
        axis.set(xscale="log", yscale="log", xlabel="hosts (one rank each)", ylabel="step, ms",
                 title=model if model == "cnn" else
                 f"{model} (compute scaled from the MLP)")
        axis.legend(fontsize=5)
    figure.tight_layout()
    figure.savefig(folder / "emulated_hosts_step_hosts.png", dpi=110)
    print(f"plots written to {folder}/emulated_hosts_allreduce_fit.png and "
          f"emulated_hosts_step_hosts.png")


if __name__ == "__main__":
    sys.exit(main())
