"""argparse that names the closest known flag when it meets an unknown one.

    specray serve --max-model-length 512
    specray: error: unrecognized arguments: --max-model-length 512 (did you mean --max-model-len?)

Python 3.14's ``suggest_on_error`` does the same for choices; this covers flags on the
Pythons specray supports. Subcommands' parsers inherit the class (argparse builds them with
their parent's), so ``specray serve``'s flags are the ones searched after ``serve``.
"""

from __future__ import annotations

import argparse
import difflib


class SuggestingParser(argparse.ArgumentParser):
    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unknown_arguments_message(extras, known_flags(self, namespace)))
        return namespace


def known_flags(parser: argparse.ArgumentParser, namespace: argparse.Namespace | None = None) -> list[str]:
    """The parser's option strings, and those of the subcommand ``namespace`` chose."""
    flags = list(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and namespace is not None:
            chosen = action.choices.get(getattr(namespace, action.dest, None) or "")
            if chosen is not None:
                flags += known_flags(chosen, namespace)
    return flags


def unknown_arguments_message(extras: list[str], flags: list[str]) -> str:
    """argparse's message for ``extras``, with the closest flag for each unknown one."""
    hints = []
    for arg in extras:
        if arg.startswith("--"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1, cutoff=0.6)
            if close:
                hints.append((arg.split("=", 1)[0], close[0]))
    if len(hints) == 1:
        return f"unrecognized arguments: {' '.join(extras)} (did you mean {hints[0][1]}?)"
    said = "; ".join(f"{flag}: did you mean {close}?" for flag, close in hints)
    return f"unrecognized arguments: {' '.join(extras)}" + (f" ({said})" if hints else "")
