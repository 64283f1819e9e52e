"""A progress bar over a benchmark sweep, shown by rank 0 only (every rank runs the same
sweep, and W bars on one terminal garble each other). It writes to stderr, so the table
on stdout stays clean for files and grep."""

from __future__ import annotations

import sys


def progress(items, *, rank: int = 0, label=str, plain: bool = False, stream=None):
    """Yield items, showing the sweep's progress on rank 0: a tqdm bar whose postfix is
    label(item), or, without tqdm or with plain=True (log files, where a redrawn bar is
    noise), one line `[i/n] label(item)` per item as it starts."""
    items = list(items)
    stream = sys.stderr if stream is None else stream
    if rank != 0:
        yield from items
        return
    bar_type = None if plain else _tqdm()
    if bar_type is None:
        for i, item in enumerate(items, 1):
            print(f"[{i}/{len(items)}] {label(item)}", file=stream, flush=True)
            yield item
        return
    with bar_type(items, file=stream, dynamic_ncols=True) as bar:
        for item in bar:
            bar.set_postfix_str(label(item))
            yield item


def _tqdm():
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm
