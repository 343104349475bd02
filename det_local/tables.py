"""Text tables that fit the terminal: every table the CLI (and a run's summary) prints.

Width: COLUMNS when set, else the terminal's width when stdout is a terminal, else 100 columns.
Fitting, in this order, until the table is no wider: the wide ("flex") columns shrink to a
comfortable width (widest first), the caller's optional columns are dropped (least wanted
first), the flex columns shrink to a minimum, and as a last resort every column shrinks. Ids and
states are never flex, so they stay whole.

Rendering: on a terminal, rich (imported here, only then) draws it with a bold header and
coloured states, folding wide cells onto more lines (colour unless NO_COLOR is set or TERM is
dumb). Anywhere else it is plain text, one line per row, cells separated by " | " and a
"-+-" rule under the header, wide cells cut with an ellipsis: what grep, awk and the tests read.
rich is not used there: it takes ~0.6 ms a row, and `experiment list` of 1,000 experiments must
answer in 400 ms.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from det_local.textsafe import visible

PIPE_WIDTH = 100  # when stdout is no terminal and COLUMNS is not set
SEP = " | "  # the plain column separator; the rich layout uses the same three columns
FLEX_OVER = 20  # a column whose content is wider than this may shrink (flex="auto")
COMFORT = 24  # flex columns shrink to this before optional columns are dropped
MIN_FLEX = 10  # ... and to this after
MIN_ANY = 4  # the last resort, for every column

STATE_STYLES = {
    "COMPLETED": "green",
    "DONE": "green",
    "ACTIVE": "cyan",
    "RUNNING": "cyan",
    "SCHEDULED": "cyan",
    "RESERVED": "cyan",
    "QUEUED": "yellow",
    "PAUSED": "yellow",
    "STOPPING_COMPLETED": "yellow",
    "STOPPING_CANCELED": "yellow",
    "STOPPING_ERROR": "yellow",
    "ERROR": "red",
    "CANCELED": "magenta",
    "DELETED": "magenta",
}


@dataclass(frozen=True)
class Layout:
    """Which columns are shown (indexes into the caller's headers) and how wide each is."""

    columns: tuple[int, ...]
    widths: tuple[int, ...]


def terminal_width() -> int:
    """COLUMNS if set (and a number), else the terminal's width, else PIPE_WIDTH."""
    env = os.environ.get("COLUMNS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    if is_tty():
        try:
            return os.get_terminal_size(sys.stdout.fileno()).columns
        except (OSError, ValueError):
            pass
    return PIPE_WIDTH


def is_tty() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def use_colour() -> bool:
    """Colour only on a terminal, and not when NO_COLOR is set (no-color.org) or TERM=dumb."""
    return is_tty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


def cell_text(value: Any) -> str:
    """A cell as one line of text (None is empty; line breaks become spaces), safe for a
    terminal: control characters and bidi controls shown visibly (`textsafe.visible`)."""
    if value is None:
        return ""
    text = str(value)
    if text.isprintable():
        return text
    if "\n" in text or "\r" in text or "\t" in text:
        text = " ".join(text.split())
    return visible(text)


def fit(
    headers: Sequence[str],
    natural: Sequence[int],
    width: int,
    flex: Collection[int],
    optional: Sequence[int] = (),
) -> Layout:
    """The columns to show and their widths so that the table is at most `width` wide (see
    the module's docstring for the order things give way in)."""
    shown = list(range(len(headers)))
    widths = list(natural)

    def total() -> int:
        return sum(widths[i] for i in shown) + len(SEP) * max(len(shown) - 1, 0)

    def squeeze(cols: Collection[int], floor: int) -> None:
        chosen = [i for i in shown if i in cols]
        excess = total() - width
        if excess <= 0 or not chosen:
            return
        floors = {i: min(natural[i], floor) for i in chosen}
        _water_fill(widths, floors, excess)

    squeeze(flex, COMFORT)
    for col in optional:
        if total() <= width:
            break
        if col in shown and len(shown) > 1:
            shown.remove(col)
            for i in flex:  # room came back: the flex columns may grow again
                widths[i] = natural[i]
            squeeze(flex, COMFORT)
    squeeze(flex, MIN_FLEX)
    squeeze(range(len(headers)), MIN_ANY)
    return Layout(tuple(shown), tuple(widths[i] for i in shown))


def _water_fill(widths: list[int], floors: dict[int, int], excess: int) -> None:
    """Take `excess` columns off the widest of `floors`' columns (each down to its floor):
    the widest shrink first, to a common level."""

    def cut(level: int) -> int:
        return sum(widths[i] - max(f, min(widths[i], level)) for i, f in floors.items())

    top = max(widths[i] for i in floors)
    if cut(0) <= excess:
        level = 0
    else:  # the highest level that cuts enough
        lo, hi = 0, top  # cut(lo) >= excess > cut(hi) ... hi may cut 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if cut(mid) >= excess:
                lo = mid
            else:
                hi = mid
        level = lo
    slack = max(cut(level) - excess, 0)
    for i, f in floors.items():
        new = max(f, min(widths[i], level))
        if slack and new == level and widths[i] > level:
            new += 1  # give back what the level took beyond the excess
            slack -= 1
        widths[i] = new


def elide(text: str, width: int, mark: str = "…") -> str:
    if len(text) <= width:
        return text
    if width <= len(mark):
        return text[:width]
    return text[: width - len(mark)] + mark


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    flex: Collection[str] | None = None,
    optional: Sequence[str] = (),
    width: int | None = None,
    tty: bool | None = None,
    whole: str | None = None,
) -> str:
    """The table as text that fits `width` (default: terminal_width()).

    flex: the headers of the columns that may shrink (default: every column wider than
    FLEX_OVER). optional: headers of columns to drop, first ones first, when shrinking is not
    enough. tty: render for a terminal (rich, folding, colour) or plain (default: stdout's).
    whole: the header of the last column, free text (a message) that plain output never cuts:
    a pipe's reader gets all of it, the line as long as it needs (a terminal folds it)."""
    cells = [[cell_text(c) for c in row] for row in rows]
    natural = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row[: len(headers)]):
            natural[i] = max(natural[i], len(c))
    if flex is None:
        flex_idx = {i for i, w in enumerate(natural) if w > FLEX_OVER}
    else:
        flex_idx = {i for i, h in enumerate(headers) if h in flex}
    opt_idx = [headers.index(h) for h in optional if h in headers]
    rich = tty if tty is not None else is_tty()
    uncut = headers.index(whole) if whole in headers and not rich else None
    if uncut is not None:  # laid out at its header's width; printed whole
        natural[uncut] = len(headers[uncut])
        flex_idx.discard(uncut)
    layout = fit(headers, natural, width or terminal_width(), flex_idx, opt_idx)
    if rich:
        return _rich(headers, cells, layout, flex_idx, width or terminal_width())
    return _plain(headers, cells, layout, uncut)


def _plain(
    headers: Sequence[str], cells: list[list[str]], layout: Layout, uncut: int | None = None
) -> str:
    # ASCII: a pipe's reader (awk, cut, wc) may count bytes, and "…" is three of them; a
    # line of `width` characters is then `width` bytes too
    mark = "..."
    cols = list(zip(layout.columns, layout.widths, strict=True))

    def line(values: Sequence[str]) -> str:
        parts = []
        for i, w in cols:
            value = values[i] if i < len(values) else ""
            parts.append((value if i == uncut else elide(value, w, mark)).ljust(w))
        return SEP.join(parts).rstrip()

    rule = "-+-".join("-" * w for _, w in cols)
    return "\n".join([line(list(headers)), rule, *(line(row) for row in cells)])


def _rich(
    headers: Sequence[str],
    cells: list[list[str]],
    layout: Layout,
    flex: Collection[int],
    width: int,
) -> str:
    import io

    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    colour = use_colour()
    grid = Table(
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        header_style="bold" if colour else "",
    )
    state_cols = set()
    for i, w in zip(layout.columns, layout.widths, strict=True):
        wrap = i in flex
        grid.add_column(
            headers[i],
            width=w,
            no_wrap=not wrap,
            overflow="fold" if wrap else "ellipsis",
        )
        if headers[i].lower() == "state":
            state_cols.add(i)
    for row in cells:
        out = []
        for i in layout.columns:
            value = row[i] if i < len(row) else ""
            # "COMPLETED (archived)": coloured as its state
            state = value.split(" ", 1)[0]
            style = STATE_STYLES.get(state, "") if colour and i in state_cols else ""
            out.append(Text(value, style=style))  # Text: no markup is read from the values
        grid.add_row(*out)
    buf = io.StringIO()
    console = Console(
        file=buf,
        width=width,
        force_terminal=colour,
        color_system="standard" if colour else None,
        no_color=not colour,
        highlight=False,
    )
    console.print(grid)
    return "\n".join(ln.rstrip() for ln in buf.getvalue().splitlines())


def wrap_lines(label: str, value: str, width: int | None = None, indent: int = 2) -> list[str]:
    """`label value` as lines no wider than `width`: a long value wraps onto lines indented
    under its start (no word is lost; a long word is broken)."""
    import textwrap

    width = width or terminal_width()
    head = " " * indent + cell_text(label)
    room = max(width - len(head), 20)
    value = cell_text(value)
    if len(value) <= room:
        return [(head + value).rstrip()]
    parts = textwrap.wrap(value, room, break_long_words=True, break_on_hyphens=False) or [""]
    pad = " " * len(head)
    return [head + parts[0], *(pad + p for p in parts[1:])]


# ---------------------------------------------------------------------------- values as text
def fmt_time(ts: float | None) -> str:
    """A store timestamp as local "YYYY-MM-DD HH:MM:SS" ("" for none)."""
    if ts is None:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def fmt_value(value: Any) -> str:
    """A metric or hyperparameter value, compact (floats to 6 significant digits)."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def flatten(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested hyperparameters as dotted names (Determined nests them that way)."""
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out += flatten(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out
