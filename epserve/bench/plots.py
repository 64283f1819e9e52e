"""Plots of a run's rows: how each path scales with tokens per rank against its floor, and a
summary of the speed-ups. matplotlib is imported inside each function, with the Agg backend
(files only, no display), so that the rest of epserve.bench never needs it."""

from __future__ import annotations

import re
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _file_name(name: str) -> str:
    # Preset names may hold "/" (scaled presets) and other characters a path cannot.
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def _path_colors(rows) -> dict:
    """One color per path, the same in every figure of a run."""
    paths = sorted({row.path for row in rows})
    return {path: f"C{i % 10}" for i, path in enumerate(paths)}


def _group(items, key) -> dict:
    groups = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups


def plot_presets(rows, out_dir) -> list[Path]:
    """One PNG per preset, `<preset>.png` in out_dir: the median time (us) against tokens per
    rank, log-log, a line per path and a panel per routing. Floors are dashed, one line per
    distinct floor, labelled with the paths that share it. Returns the files written."""
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    colors = _path_colors(rows)
    ran = [row for row in rows if row.timing is not None]
    written = []
    for preset, preset_rows in _group(ran, lambda r: r.preset.name).items():
        by_routing = _group(preset_rows, lambda r: r.routing.label)
        fig, axes = plt.subplots(1, len(by_routing), figsize=(6.5 * len(by_routing), 4.8), squeeze=False)
        for ax, (routing, routing_rows) in zip(axes[0], by_routing.items()):
            floors = {}
            for path, path_rows in _group(routing_rows, lambda r: r.path).items():
                path_rows.sort(key=lambda r: r.preset.tokens_per_rank)
                tokens = [r.preset.tokens_per_rank for r in path_rows]
                ax.plot(tokens, [r.timing.median_ms * 1e3 for r in path_rows], marker="o",
                        color=colors[path], label=path)
                with_floor = [r for r in path_rows if r.floor is not None]
                if with_floor:
                    curve = tuple((r.preset.tokens_per_rank, r.floor.seconds * 1e6) for r in with_floor)
                    floors.setdefault(curve, []).append(path)
            for shade, (curve, paths) in enumerate(floors.items()):
                tokens, floor_us = zip(*curve)
                ax.plot(tokens, floor_us, linestyle="--", color=str(0.15 + 0.2 * (shade % 4)),
                        label=f"floor ({', '.join(paths)})")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens per rank")
            ax.set_ylabel("time (us, median of the slowest rank)")
            ax.set_title(f"{preset}, {routing} routing")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize="small")
        fig.tight_layout()
        target = out_dir / f"{_file_name(preset)}.png"
        fig.savefig(target, dpi=110)
        plt.close(fig)
        written.append(target)
    return written


def plot_speedups(rows, out_path) -> Path:
    """A bar chart PNG of every path's speed-up over the unfused path and over the library
    baseline, per (preset, routing), at the largest tokens per rank that has one."""
    plt = _pyplot()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    colors = _path_colors(rows)
    panels = (("speed-up vs unfused", lambda r: r.speedup_vs_unfused),
              ("speed-up vs library baseline", lambda r: r.speedup_vs_library))
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 4.8), squeeze=False)
    for ax, (title, value) in zip(axes[0], panels):
        measured = [row for row in rows if value(row) is not None]
        groups = _group(measured, lambda r: f"{r.preset.name}\n{r.routing.label}")
        if not groups:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        else:
            paths = sorted({row.path for row in measured})
            width = 0.8 / len(paths)
            labelled = set()
            for g, group_rows in enumerate(groups.values()):
                largest = max(r.preset.tokens_per_rank for r in group_rows)
                at_largest = {r.path: value(r) for r in group_rows if r.preset.tokens_per_rank == largest}
                for p, path in enumerate(paths):
                    if path in at_largest:
                        ax.bar(g + (p - (len(paths) - 1) / 2) * width, at_largest[path], width,
                               color=colors[path], label=None if path in labelled else path)
                        labelled.add(path)
            ax.set_xticks(range(len(groups)), list(groups), fontsize="small")
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.legend(fontsize="small")
        ax.set_title(f"{title} (largest tokens per rank)")
        ax.set_ylabel("x (above 1: faster)")
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path
