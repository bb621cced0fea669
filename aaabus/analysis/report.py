"""The report of ``aaabus analyze``: PNG plots (matplotlib, Agg) and ``report.md``.

Everything here works on the small results the Spark job hands to the driver: one dict per
measured point, per series fit and per flat/domained pair. Nothing here touches Spark.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]

TEST_ORDER = ["local", "remote", "broadcast", "stream"]
_COLOURS = {"flat": "black", "bus": "tab:blue", "star": "tab:orange", "tree": "tab:green"}
_OTHER_COLOURS = ["tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"]
_STYLE = {"full": ("-", "o"), "delta": ("--", "s")}
_METRIC_TITLES = {
    "rtt_mean_ms": "mean round trip (ms)",
    "rtt_p50_ms": "median round trip (ms)",
    "stamp_bytes_mean": "stamp bytes per send",
    "clock_bytes_per_msg": "clock bytes persisted per message",
    "clock_cpu_us_per_msg": "clock CPU per message (µs)",
}


def _tests(rows: Iterable[Row]) -> list[str]:
    found = {r["test"] for r in rows}
    return [t for t in TEST_ORDER if t in found] + sorted(found - set(TEST_ORDER))


def _topologies(rows: Iterable[Row]) -> list[str]:
    found = {r["topology"] for r in rows}
    return sorted(found, key=lambda t: (t != "flat", t))


def _colour(topology: str, order: Sequence[str]) -> str:
    if topology in _COLOURS:
        return _COLOURS[topology]
    extra = [t for t in order if t not in _COLOURS]
    return _OTHER_COLOURS[extra.index(topology) % len(_OTHER_COLOURS)]


def _style(clock_mode: str) -> tuple[str, str]:
    return _STYLE.get(clock_mode, (":", "^"))


def _series(
    rows: Iterable[Row], ykey: str
) -> dict[tuple[str, str, str], list[tuple[float, float]]]:
    """(topology, clock_mode, test) -> sorted (servers, y) pairs, rows without y left out."""
    out: dict[tuple[str, str, str], list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        y = r.get(ykey)
        if y is not None and not (isinstance(y, float) and math.isnan(y)):
            out[(r["topology"], r["clock_mode"], r["test"])].append((r["servers"], y))
    return {k: sorted(v) for k, v in out.items()}


def model_value(fit: Row, n: float) -> float | None:
    """The value of the model the fit's verdict chose, at ``n`` servers."""
    verdict = fit.get("verdict")
    if verdict == "quadratic" and fit.get("quad_a") is not None:
        return float(fit["quad_a"] * n * n + fit["quad_b"] * n + fit["quad_c"])
    if verdict in ("linear", "decreasing") and fit.get("lin_slope") is not None:
        return float(fit["lin_slope"] * n + fit["lin_intercept"])
    if verdict == "constant":
        return float(fit["y_mean"])
    return None


# --------------------------------------------------------------------------------------------
# Plots.


def _figure() -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")  # no display: the report is files
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    return fig, ax


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_metric(
    points: Sequence[Row],
    fits: Sequence[Row],
    test: str,
    metric: str,
    ylabel: str,
    title: str,
    path: Path,
    log_y: bool = False,
) -> bool:
    """Data points (markers) of ``metric`` for one test and, as lines, the model each verdict chose.

    Returns False (and writes nothing) when no series has data for it.
    """
    data = {k: v for k, v in _series(points, metric).items() if k[2] == test}
    if not data:
        return False
    fit_of = {(f["topology"], f["clock_mode"], f["test"]): f for f in fits if f["metric"] == metric}
    order = _topologies({"topology": k[0]} for k in data)
    fig, ax = _figure()
    for key in sorted(data, key=lambda k: (order.index(k[0]), k[1])):
        topology, mode, _ = key
        xs, ys = zip(*data[key], strict=True)
        colour, (line, marker) = _colour(topology, order), _style(mode)
        fit = fit_of.get(key)
        label = f"{topology} / {mode}"
        if fit is not None:
            label += f": {fit['verdict']}"
            if fit.get("exponent") is not None:
                label += f", n^{_exponent(fit['exponent'])}"
        ax.plot(xs, ys, linestyle="none", marker=marker, color=colour, markersize=5)
        ax.plot([], [], linestyle=line, marker=marker, color=colour, label=label)  # legend only
        if fit is not None:
            grid = [xs[0] + (xs[-1] - xs[0]) * i / 60 for i in range(61)]
            model = [model_value(fit, n) for n in grid]
            if all(v is not None for v in model):
                ax.plot(grid, model, linestyle=line, color=colour, linewidth=1.2, alpha=0.8)
        else:
            ax.plot(xs, ys, linestyle=line, color=colour, linewidth=1.0, alpha=0.6)
    ax.set_xlabel("servers (n)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log_y:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, title="markers: measured; lines: fitted law", title_fontsize=8)
    _save(fig, path)
    return True


def plot_ratios(ratios: Sequence[Row], test: str, path: Path) -> bool:
    """Domained mean rtt over flat mean rtt at the same servers count and clock mode."""
    data = {k: v for k, v in _series(ratios, "ratio_mean").items() if k[2] == test}
    if not data:
        return False
    order = _topologies({"topology": k[0]} for k in data)
    fig, ax = _figure()
    for key in sorted(data, key=lambda k: (order.index(k[0]), k[1])):
        topology, mode, _ = key
        xs, ys = zip(*data[key], strict=True)
        line, marker = _style(mode)
        ax.plot(
            xs,
            ys,
            linestyle=line,
            marker=marker,
            color=_colour(topology, order),
            label=f"{topology} / {mode}",
            markersize=5,
        )
    ax.axhline(1.0, color="black", linewidth=0.8, label="flat (= 1)")
    ax.set_xlabel("servers (n)")
    ax.set_ylabel("mean rtt ÷ flat mean rtt (same n, same clock mode)")
    ax.set_title(f"{test}: domained versus flat (below 1: domains are faster)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)
    return True


# --------------------------------------------------------------------------------------------
# Markdown.


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, bool):
        return "yes" if value else ""
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value):
            return "∞" if value > 0 else "-∞"
        return f"{value:.{digits}g}"
    return str(value)


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return lines


def _fits_table(fits: Sequence[Row], metric: str, test: str, unit: str) -> list[str]:
    rows = [f for f in fits if f["metric"] == metric and f["test"] == test]
    rows.sort(key=lambda f: (f["topology"] != "flat", f["topology"], f["clock_mode"]))
    return _table(
        [
            "topology",
            "clock",
            "points",
            "servers",
            "**verdict**",
            "exponent (log-log)",
            f"linear slope ({unit}/server)",
            "linear R²",
            f"quadratic a ({unit}/server²)",
            "quadratic R²",
            "t of a",
        ],
        (
            [
                f["topology"],
                f["clock_mode"],
                f["m"],
                f"{f['n_min']:g}–{f['n_max']:g}",
                f"**{f['verdict']}**",
                f["exponent"],
                f["lin_slope"],
                f["lin_r2"],
                f["quad_a"],
                f["quad_r2"],
                f["quad_t"],
            ]
            for f in rows
        ),
    )


_RANK = {"decreasing": -1, "constant": 0, "linear": 1, "quadratic": 2}


def headline(fits: Sequence[Row], ratios: Sequence[Row]) -> list[str]:
    """One row per (test, clock mode): each topology's verdict on the mean round trip, the
    domained/flat ratio at the largest servers count they share, and what that adds up to."""
    rtt = {
        (f["test"], f["clock_mode"], f["topology"]): f for f in fits if f["metric"] == "rtt_mean_ms"
    }
    topologies = _topologies({"topology": k[2]} for k in rtt)
    pairs = sorted({(k[0], k[1]) for k in rtt}, key=lambda p: (_test_rank(p[0]), p[1]))
    rows = []
    for test, mode in pairs:
        cells: list[Any] = [test, mode]
        for topo in topologies:
            f = rtt.get((test, mode, topo))
            if f is None:
                cells.append(None)
            else:
                cells.append(f"{f['verdict']} (n^{_exponent(f.get('exponent'))})")
        mine = [r for r in ratios if (r["test"], r["clock_mode"]) == (test, mode)]
        mine = [r for r in mine if r.get("ratio_mean") is not None]
        reading = []
        if mine:
            top = max(r["servers"] for r in mine)
            at_top = [r["ratio_mean"] for r in mine if r["servers"] == top]
            lo, hi = min(at_top), max(at_top)
            span = f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}"
            cells.append(f"{span} at n={top}")
            if hi < 0.9:
                reading.append(f"domains faster at n={top}")
            elif lo > 1.1:
                reading.append(f"domains slower at n={top}")
            else:
                reading.append(f"comparable at n={top}")
        else:
            cells.append(None)
        flat = rtt.get((test, mode, "flat"))
        doms = [f for (t, m, topo), f in rtt.items() if (t, m) == (test, mode) and topo != "flat"]
        ranks = [_RANK.get(f["verdict"]) for f in doms]
        if flat is not None and doms and None not in ranks and flat["verdict"] in _RANK:
            worst = max(r for r in ranks if r is not None)
            if worst < _RANK[flat["verdict"]]:
                best = {f["verdict"] for f in doms if _RANK[f["verdict"]] == worst}.pop()
                reading.append(f"growth cut from {flat['verdict']} to {best} or less")
            elif worst == _RANK[flat["verdict"]]:
                reading.append(f"same growth ({flat['verdict']})")
            else:
                reading.append("domains grow faster")
        cells.append("; ".join(reading) or None)
        rows.append(cells)
    if not rows:
        return ["No round-trip fits."]
    return _table(
        ["test", "clock", *topologies, "domained ÷ flat (largest common n)", "reading"], rows
    )


def _exponent(k: float | None) -> str:
    # round first, then add 0.0: -0.001 prints as 0.00, not -0.00
    return "?" if k is None else f"{round(k, 2) + 0.0:.2f}"


def _test_rank(test: str) -> int:
    return TEST_ORDER.index(test) if test in TEST_ORDER else len(TEST_ORDER)


def _span(meta: Row) -> str:
    lo, hi = meta.get("ts_min"), meta.get("ts_max")
    if not isinstance(lo, dt.datetime) or not isinstance(hi, dt.datetime):
        return "unknown"
    elapsed = dt.timedelta(seconds=round((hi - lo).total_seconds()))
    return f"{lo:%Y-%m-%d %H:%M:%S} – {hi:%Y-%m-%d %H:%M:%S} UTC ({elapsed} elapsed)"


def write_report(
    out: Path, meta: Row, points: Sequence[Row], fits: Sequence[Row], ratios: Sequence[Row]
) -> Path:
    """Write the PNGs and ``out/report.md``; return the report's path."""
    tests = _tests(points)
    plots: dict[str, list[str]] = defaultdict(list)
    for test in tests:
        name = f"rtt_{test}.png"
        if plot_metric(
            points,
            fits,
            test,
            "rtt_mean_ms",
            "mean round trip (ms)",
            f"{test} round trip versus servers",
            out / name,
        ):
            plots["rtt"].append(name)
        name = f"clock_bytes_{test}.png"
        if plot_metric(
            points,
            fits,
            test,
            "clock_bytes_per_msg",
            "clock bytes persisted per message (bytes)",
            f"{test}: clock bytes persisted per message versus servers (log scale)",
            out / name,
            log_y=True,
        ):
            plots["clock"].append(name)
        name = f"ratio_{test}.png"
        if plot_ratios(ratios, test, out / name):
            plots["ratio"].append(name)

    lines: list[str] = ["# aaabus: timing trace analysis", ""]
    run_ids: list[str] = meta.get("run_ids") or []
    shown = ", ".join(f"`{r}`" for r in run_ids[:12])
    if len(run_ids) > 12:
        shown += f", … ({len(run_ids) - 12} more: see the run_ids column of points.csv)"
    hop_rows = meta.get("hop_rows") or 0
    lines += [
        "## Source",
        "",
        f"- Traces: `{meta['traces']}`"
        + (
            f" ({meta['rtt_files']} rtt files, {meta['hop_files']} hop files)"
            if meta.get("rtt_files") is not None
            else ""
        ),
        f"- Rows: {meta['rtt_rows']:,} round trips (rtt/), {hop_rows:,} hops (hops/)"
        + ("" if hop_rows else ": no hop traces, so the clock-cost columns are empty"),
        f"- Runs: {meta.get('runs', 0)}: {shown}",
        f"- Measured: {_span(meta)}",
        f"- Spark master: `{meta['master']}`; percentiles: {meta['percentiles']}",
        "- Growth fits on: "
        + (
            "per-point means (one value per servers count, each point weighs the same)"
            if meta["fit_on"] == "means"
            else "every raw row (points weigh by their row counts)"
        ),
        f"- Generated: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M:%S} UTC by `aaabus analyze`",
    ]
    lines += [f"- Note: {n}" for n in meta.get("notes", [])]
    mixed = [
        p
        for p in points
        if p.get("mixed_domain_size") or p.get("mixed_payload") or p.get("mixed_process_mode")
    ]
    if mixed:
        lines.append(
            f"- **Warning**: {len(mixed)} point(s) mix domain sizes, payloads or process modes "
            "(see the `mixed_*` columns of points.csv): their statistics pool unlike runs."
        )
    lines += [
        "",
        "How to read this report: see `perf/ANALYSIS.md`. The verdict says which growth law the "
        "mean round trip supports over the servers counts measured: **quadratic**, **linear**, "
        "**constant** (or **decreasing**); the exponent is the slope of log(rtt) against log(n).",
        "",
        "## Verdict: flat versus domained",
        "",
        *headline(fits, ratios),
        "",
        "## Round trip versus servers",
    ]
    for test in tests:
        lines += ["", f"### {test}", ""]
        lines += _fits_table(fits, "rtt_mean_ms", test, "ms")
        if f"rtt_{test}.png" in plots["rtt"]:
            lines += ["", f"![{test} round trip versus servers](rtt_{test}.png)"]

    lines += ["", "## Flat versus domained", ""]
    if ratios:
        lines += [
            "Mean round trip of each domained topology divided by flat's at the same servers "
            "count and clock mode (below 1: the domains are faster). First and last common "
            "servers counts:",
            "",
        ]
        by_key: dict[tuple[str, str, str], list[Row]] = defaultdict(list)
        for r in ratios:
            by_key[(r["topology"], r["clock_mode"], r["test"])].append(r)
        summary = []
        for key in sorted(by_key, key=lambda k: (_tests([{"test": k[2]}]), k)):
            rs = sorted(by_key[key], key=lambda r: r["servers"])
            first, last = rs[0], rs[-1]
            summary.append(
                [
                    key[2],
                    key[0],
                    key[1],
                    first["servers"],
                    first["ratio_mean"],
                    last["servers"],
                    last["ratio_mean"],
                ]
            )
        summary.sort(key=lambda r: (TEST_ORDER.index(r[0]) if r[0] in TEST_ORDER else 99, r[1:3]))
        lines += _table(
            ["test", "topology", "clock", "n (first)", "ratio", "n (last)", "ratio"], summary
        )
        for name in plots["ratio"]:
            lines += ["", f"![{name[6:-4]}: domained versus flat]({name})"]
    else:
        lines.append("No flat series to compare with (or no domained one): no ratios.")

    lines += ["", "## Clock costs", ""]
    if hop_rows:
        lines += [
            "Per message, from hops/: stamp bytes are averaged over sends; clock bytes "
            "persisted are each hop's share of its commit (clock_bytes ÷ group_hops); clock CPU "
            "is the time in the clock operation (stamp or test) per hop row.",
        ]
        for test in tests:
            lines += ["", f"### {test}: clock bytes persisted per message", ""]
            lines += _fits_table(fits, "clock_bytes_per_msg", test, "bytes")
            if f"clock_bytes_{test}.png" in plots["clock"]:
                lines += ["", f"![{test}: clock bytes per message](clock_bytes_{test}.png)"]
    else:
        lines.append("No hop traces (hops/ absent or empty): clock costs unknown.")

    lines += ["", "## All points", ""]
    lines += _table(
        [
            "topology",
            "clock",
            "test",
            "n",
            "count",
            "mean ms",
            "p50 ms",
            "p90 ms",
            "p99 ms",
            "hops",
            "stamp B",
            "clock B/msg",
            "clock µs/msg",
        ],
        (
            [
                p["topology"],
                p["clock_mode"],
                p["test"],
                p["servers"],
                p["count"],
                p["rtt_mean_ms"],
                p["rtt_p50_ms"],
                p["rtt_p90_ms"],
                p["rtt_p99_ms"],
                p["hops"],
                p["stamp_bytes_mean"],
                p["clock_bytes_per_msg"],
                p["clock_cpu_us_per_msg"],
            ]
            for p in sorted(
                points,
                key=lambda p: (
                    _test_rank(p["test"]),
                    p["topology"] != "flat",
                    p["topology"],
                    p["clock_mode"],
                    p["servers"],
                ),
            )
        ),
    )
    lines += [
        "",
        "## Files",
        "",
        "Tables (Parquet and CSV, same content): "
        + ", ".join(f"`{f}`" for f in meta.get("tables", [])),
        "",
        "- `points`: one row per (topology, clock_mode, test, servers)",
        "- `fits`: one row per series and metric (rtt mean and p50, stamp bytes, clock bytes "
        "and CPU per message)",
        "- `ratios`: domained ÷ flat at the same point",
        "- `spark.log`: the JVM's own output during the run",
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
