"""Command-line words: an error the API raises, in the words the user typed. A leaf (argparse only):
``pdpfast.cli`` and ``pdpfast.fl.cli`` both use it, and neither may import the other's module."""
from __future__ import annotations

import argparse

__all__ = ["as_option_words"]


def as_option_words(parser: argparse.ArgumentParser, args, text: str) -> str:
    """An error message that opens with a Python argument name (``rounds must be an int ≥ 1``, raised
    by the API a command calls) as the user typed it: ``--rounds must be …``.

    Args:
        parser: the top-level parser; args: what it parsed (which subcommands ran); text: the message.
    Returns:
        ``text`` with its first word replaced by the option of the command that ran whose destination
        it names; unchanged when it names none.
    """
    while True:  # down to the subcommand that ran
        chosen = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not chosen or getattr(args, chosen[0].dest, None) not in chosen[0].choices:
            break
        parser = chosen[0].choices[getattr(args, chosen[0].dest)]
    name, sep, rest = text.partition(" ")
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if action.dest == name and longs and sep:
            return f"{longs[0]} {rest}"
    return text
