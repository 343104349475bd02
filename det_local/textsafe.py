"""Text another user wrote, made safe to show on a terminal: the one sanitiser of the CLI.

Names, labels, descriptions, notes, command lines and event messages come from users; a
terminal acts on some characters instead of showing them: ESC starts a sequence that can write
the clipboard (OSC 52), set the window title or clear the screen, C1 controls (U+0080-009F) do
the same in one character, and bidi controls (U+202A-202E, U+2066-2069, U+200E/F, U+061C)
reorder what follows so that a line reads other than it is. Each of them is shown visibly
instead: a control character as its escape (``\\x1b``, ``\\x7f``, ``\\x9b``), a bidi control
as ``<U+202E>``. Everything else passes unchanged (one ``str.isprintable`` check in the common
case, so that a table of 1,000 rows costs nothing more).

`tables.cell_text` (every table cell and `wrap_lines` value) goes through :func:`visible`;
free text the CLI prints itself goes through it or :func:`visible_lines` (line breaks kept).
`--json` output is never sanitised: it is escaped JSON already, and a program reads it.
A trial's or a command's own output (`logs`, `run`'s stream) is passed through as written: it
is the program's output, coloured progress bars and all (see the README's security section).
"""

from __future__ import annotations

BIDI = (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))
LINE_SEPARATORS = (0x2028, 0x2029)  # a line break a terminal may honour


def _table(keep: str = "") -> dict[int, str]:
    out: dict[int, str] = {}
    for code in (*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)):
        out[code] = f"\\x{code:02x}"
    for code in (*BIDI, *LINE_SEPARATORS):
        out[code] = f"<U+{code:04X}>"
    for ch in keep:
        out.pop(ord(ch), None)
    return out


_VISIBLE = _table()
_VISIBLE_LINES = _table("\n")


def visible(text: str) -> str:
    """`text` with every control character and bidi control shown as an escape (one line:
    a line break is shown as ``\\x0a``; callers that join lines make them spaces first)."""
    if text.isprintable():
        return text
    return text.translate(_VISIBLE)


def visible_lines(text: str) -> str:
    """As :func:`visible`, line breaks kept (a multi-line description or message)."""
    if text.isprintable():
        return text
    return text.translate(_VISIBLE_LINES)


def is_visible(text: str) -> bool:
    """Whether `text` holds nothing a terminal would act on (what tests assert of output)."""
    return visible_lines(text) == text
