"""Building pages safely: every value is escaped unless it is `Html` (markup this package wrote),
so an experiment name, a label, a hyperparameter or a log line is shown as text, never read as
markup. Data for a page's script goes in a JSON block that cannot end its <script> element."""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Sequence
from typing import Any

from starlette.responses import HTMLResponse

from det_local.store.records import json_safe

STATIC = "/static"
VOID = ("input", "br", "meta", "link")
UPLOT = f"{STATIC}/vendor/uplot"


class Html(str):
    """Markup built here from escaped parts: inserted as it is."""


def esc(value: Any) -> Html:
    """A value as text in HTML (None is empty)."""
    if isinstance(value, Html):
        return value
    return Html(html.escape("" if value is None else str(value), quote=True))


def join(parts: Iterable[Any], sep: str = "") -> Html:
    return Html(sep.join(esc(p) for p in parts))


def tag(element: str, content: Any = "", /, **attrs: Any) -> Html:
    """<element attrs>content</element>; attribute values escaped; `class_` is `class`; an
    attribute whose value is None is left out, True is written bare."""
    out = []
    for key, value in attrs.items():
        if value is None or value is False:
            continue
        key = key.rstrip("_").replace("_", "-")
        out.append(f" {key}" if value is True else f' {key}="{esc(value)}"')
    if element in VOID:
        return Html(f"<{element}{''.join(out)}>")
    return Html(f"<{element}{''.join(out)}>{esc(content)}</{element}>")


def link(href: str, text: Any) -> Html:
    return tag("a", text, href=href)


def table(headers: Sequence[Any], rows: Iterable[Sequence[Any]], *, id_: str | None = None) -> Html:
    head = join(tag("th", h) for h in headers)
    body = join(tag("tr", join(tag("td", c) for c in row)) for row in rows)
    return tag("table", Html(f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody>"), id=id_)


def page_data(value: Any) -> Html:
    """A <script type="application/json" id="page-data"> block: JSON with <, > and & written
    as \\u escapes, so no value can close the element or open another."""
    text = json.dumps(json_safe(value), separators=(",", ":"))
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return Html(f'<script type="application/json" id="page-data">{text}</script>')


NAV = (
    ("Experiments", "/"),
    ("Queue", "/queue"),
    ("Slots", "/slots"),
    ("Cluster", "/cluster"),
    ("Commands", "/commands"),
    ("Usage", "/usage"),
    ("Models", "/models"),
)


def page(
    title: str,
    body: Html,
    *,
    status: int = 200,
    scripts: Sequence[str] = (),
    charts: bool = False,
) -> HTMLResponse:
    nav = join(link(href, name) for name, href in NAV)
    head = [
        '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        '<link rel="icon" href="data:,">',  # no /favicon.ico request
        str(tag("title", f"{title} · det-local")),
        f'<link rel="stylesheet" href="{STATIC}/dashboard.css">',
    ]
    if charts:
        head.append(f'<link rel="stylesheet" href="{UPLOT}/uPlot.min.css">')
        head.append(f'<script src="{UPLOT}/uPlot.iife.min.js"></script>')
    head += [f'<script src="{STATIC}/{s}" defer></script>' for s in scripts]
    doc = (
        '<!doctype html><html lang="en"><head>'
        + "".join(head)
        + f"</head><body><header><strong>det-local</strong><nav>{nav}</nav></header>"
        + f"<main>{tag('h1', title)}{body}</main></body></html>"
    )
    return HTMLResponse(doc, status_code=status)
