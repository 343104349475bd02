"""The one sanitiser of user strings a terminal shows (det_local/textsafe.py), and the tables
that use it (det_local/tables.py), in both layouts: every control and bidi character shown
visibly, everything else unchanged."""

from __future__ import annotations

from det_local.tables import cell_text, table, wrap_lines
from det_local.textsafe import is_visible, visible, visible_lines


def test_controls_and_bidi_are_shown_visibly() -> None:
    assert visible("plain ünïcödé 名前 ✓") == "plain ünïcödé 名前 ✓"  # untouched
    assert visible("\x1b]52;c;ZXZpbA==\x07") == "\\x1b]52;c;ZXZpbA==\\x07"  # OSC 52
    assert visible("\x1b]0;title\x1b\\") == "\\x1b]0;title\\x1b\\"  # title set, ST
    assert visible("\x1b[2J\x1b[H") == "\\x1b[2J\\x1b[H"  # clear screen
    assert visible("a\x9b31mb\x7f\x00") == "a\\x9b31mb\\x7f\\x00"  # C1 CSI, DEL, NUL
    assert visible("\u202egnp.exe") == "<U+202E>gnp.exe"
    for code in (0x202A, 0x202B, 0x202C, 0x202D, 0x2066, 0x2067, 0x2068, 0x2069):
        assert visible(chr(code)) == f"<U+{code:04X}>"
    assert visible("\u200e\u200f\u061c\u2028") == "<U+200E><U+200F><U+061C><U+2028>"
    assert visible("a\nb") == "a\\x0ab"
    assert visible_lines("a\nb\x1b") == "a\nb\\x1b"
    assert is_visible("a\nb") and not is_visible("a\x1b")


def test_every_table_cell_and_wrapped_value_goes_through_it() -> None:
    evil = "x\x1b]0;t\x07\u202ey"
    assert cell_text(evil) == "x\\x1b]0;t\\x07<U+202E>y"
    assert cell_text("a\n\tb\x1b") == "a b\\x1b"  # layout whitespace first, then escapes
    for tty in (False, True):
        out = table(["ID", "Name"], [[1, evil]], width=120, tty=tty)
        assert "\x1b" not in out and "\u202e" not in out and "<U+202E>" in out, out
    lines = wrap_lines(f"{evil}: ", evil, width=80)
    assert all(is_visible(ln) for ln in lines) and "<U+202E>" in lines[0], lines


def test_a_whole_column_is_never_cut_in_a_pipe() -> None:
    message = "m" * 300
    out = table(["Time", "Message"], [["t", message]], width=100, tty=False, whole="Message")
    assert out.splitlines()[2] == f"t    | {message}", out
    cut = table(["Time", "Message"], [["t", message]], width=100, tty=False)
    assert message not in cut and cut.splitlines()[2].endswith("..."), cut
