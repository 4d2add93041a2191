"""The `orchard` command tree (as Typer builds it), to check commands written in the docs."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

import typer.main
from typer.core import TyperGroup

from orchard_cli.main import app


@dataclass
class Node:
    path: str
    options: set[str] = field(default_factory=set)
    children: dict[str, Node] = field(default_factory=dict)


def _node(command: Any, path: str) -> Node:
    node = Node(path)
    for param in command.params:
        node.options.update(getattr(param, "opts", []), getattr(param, "secondary_opts", []))
    node.options.update(("--help", "-h"))
    if isinstance(command, TyperGroup):  # through the group's API: the root one is lazy
        ctx = typer.Context(command)
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            assert sub is not None, name
            node.children[name] = _node(sub, f"{path} {name}")
    return node


_SHELL_OPERATORS = frozenset({"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "2>&1"})


def tree() -> Node:
    return _node(typer.main.get_command(app), "orchard")


def leaves(node: Node) -> list[str]:
    if not node.children:
        return [node.path]
    return [path for child in node.children.values() for path in leaves(child)]


def check_command_line(root: Node, line: str) -> str | None:
    """None if ``line`` (``orchard ...`` as a user types it) names an existing command and
    only options it has; otherwise what is wrong."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError as exc:
        return f"cannot parse {line!r}: {exc}"
    node = root
    for word in words[1:]:
        if word == "--" or word in _SHELL_OPERATORS:
            break
        if word.startswith("-") and word != "-":  # a lone "-" is stdin/stdout
            option = word.split("=", 1)[0]
            if option not in node.options:
                return f"`{node.path}` has no option {option}"
        elif word in node.children:
            node = node.children[word]
        elif node.children:
            return f"`{node.path}` has no command {word!r}"
    if node.children and not any(w in ("--help", "-h", "--version") for w in words):
        return f"`{node.path}` needs a command: one of {', '.join(sorted(node.children))}"
    return None
