"""Command-line words: an error the API raises, in the words the user typed. A leaf (argparse only):
``pdpfast.cli`` and ``pdpfast.fl.cli`` both use it, and neither may import the other's module."""
from __future__ import annotations

import argparse
import contextlib
import re
import sys
import warnings

__all__ = ["as_option_words", "method_words", "warnings_as_lines"]


def as_option_words(parser: argparse.ArgumentParser, args, text: str) -> str:
    """An error message in the words the user typed: a Python argument name raised by the API a
    command calls becomes the option of the command that ran (``rounds must be an int ≥ 1`` →
    ``--rounds must be …``; ``… or a larger dirichlet_alpha`` → ``… or a larger --dirichlet-alpha``).

    Args:
        parser: the top-level parser; args: what it parsed (which subcommands ran); text: the message.
    Returns:
        ``text`` with its first word replaced where it is an option's destination, and so is every
        other word with an underscore (a name no sentence uses otherwise); unchanged where none is.
    """
    while True:  # down to the subcommand that ran
        chosen = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not chosen or getattr(args, chosen[0].dest, None) not in chosen[0].choices:
            break
        parser = chosen[0].choices[getattr(args, chosen[0].dest)]
    options = {}
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs:
            options.setdefault(action.dest, longs[0])
    name, sep, rest = text.partition(" ")
    if sep and name in options:
        text = f"{options[name]} {rest}"
    return re.sub(r"(?<![\w./-])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![\w./-])",
                  lambda m: options.get(m.group(0), m.group(0)), text)


def method_words(values, known) -> list:
    """Names given to a list option such as ``--methods`` (``nargs="+"``), the way a user types them:
    separate words, comma-separated (``sample,scale``) or both, each spelled with or without its
    hyphen or underscore (``non-private``, ``nonprivate``), in any case.

    Args:
        values: the strings argparse collected (None: not given); known: the names the command uses.
    Returns:
        None when not given; else the names in the given order, each known one in its ``known``
        spelling and the others as typed (for the caller's check to refuse by name).
    """
    if values is None:
        return None
    spelling = {_bare(name): name for name in known}
    words = [word.strip() for value in values for word in value.split(",") if word.strip()]
    return [spelling.get(_bare(word), word) for word in words]


def _bare(name: str) -> str:
    return name.replace("-", "").replace("_", "").lower()


@contextlib.contextmanager
def warnings_as_lines(parser: argparse.ArgumentParser, args, prefix: str, shown: bool = True):
    """Warnings the API raises while the block runs, printed as they come, one line each
    (``<prefix>: warning: ...``, in the options' words) rather than as Python's file:line report.

    Args:
        parser: the top-level parser; args: what it parsed; prefix: the command, e.g. "pdpfast train".
        shown: False drops them (ranks other than 0 of ``train --nproc``, whose rank 0 warns the same).
    Yields:
        None.
    """
    def show(message, category, filename, lineno, file=None, line=None):
        if shown:
            text = as_option_words(parser, args, " ".join(str(message).split()))
            print(f"{prefix}: warning: {text}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():     # restores showwarning on leaving
        warnings.showwarning = show
        yield
