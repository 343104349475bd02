"""The command groups' class: Determined's short names, and one line for an unknown command.

Determined's CLI answers to `det e`, `det t`, `det c`, `det cmd` (`command`), `det j`, and to
`ls` for `list` in each group; det-local answers to the same names where they do not collide
with its own. Aliases are resolved names, not commands of their own, so `-h` lists each command
once, with its aliases beside it: `experiment (e)`.
"""

from __future__ import annotations

import difflib
from typing import Any

from typer.core import TyperCommand, TyperGroup

# group name -> {alias: command}; the top level is named "det-local"
ALIASES: dict[str, dict[str, str]] = {
    "det-local": {
        "e": "experiment",
        "t": "trial",
        "c": "checkpoint",
        "command": "cmd",
        "j": "job",
        "m": "model",
    },
    "experiment": {"ls": "list", "unpause": "activate"},
    "trial": {"ls": "list"},
    "checkpoint": {"ls": "list"},
    "job": {"ls": "list", "u": "update"},
    "cmd": {"ls": "list"},
    "model": {"ls": "list"},
}


class DetCommand(TyperCommand):
    """A command whose usage line reads `CONFIG CONTEXT`, not typer's `{CONFIG} {CONTEXT}`."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = super().collect_usage_pieces(ctx)
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in pieces]


class DetGroup(TyperGroup):
    """A typer group with aliases and a one-line "did you mean" for an unknown command; its
    commands are DetCommands."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        for cmd in self.commands.values():
            if type(cmd) is TyperCommand:  # typer builds them; the subclass adds no state
                cmd.__class__ = DetCommand

    def _aliases(self) -> dict[str, str]:
        return ALIASES.get(self.name or "", {})

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        found = super().get_command(ctx, cmd_name)
        if found is None and cmd_name in self._aliases():
            found = super().get_command(ctx, self._aliases()[cmd_name])
        return found

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        name = args[0] if args else ""
        if (
            name
            and not name.startswith("-")
            and not ctx.resilient_parsing
            and self.get_command(ctx, name) is None
        ):
            ctx.fail(self.unknown(ctx, name))
        return super().resolve_command(ctx, args)

    def unknown(self, ctx: Any, name: str) -> str:
        """ "no command 'experimnt'; did you mean 'experiment'?" (the closest visible command
        or alias; a prefix counts), or where the list is."""
        visible = [n for n in self.list_commands(ctx) if not self.commands[n].hidden]
        names = visible + list(self._aliases())
        prefixed = [n for n in visible if n.startswith(name)]
        close = prefixed or difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        if close:
            best = self._aliases().get(close[0], close[0])
            return f"no command {name!r}; did you mean {best!r}?"
        return f"no command {name!r} (`{ctx.command_path} -h` lists them)"

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is None or cmd.hidden:
                continue
            aliases = [a for a, target in self._aliases().items() if target == name]
            rows.append((f"{name} ({', '.join(aliases)})" if aliases else name, cmd))
        if not rows:
            return
        limit = formatter.width - 6 - max(len(shown) for shown, _ in rows)
        with formatter.section("Commands"):
            formatter.write_dl([(shown, cmd.get_short_help_str(limit)) for shown, cmd in rows])
