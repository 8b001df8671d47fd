"""An mkdocs hook: the command-line reference, generated from the ``tnt-snapshot`` command's own
click definitions when the site is built.

A page holding :data:`MARKER` gets, in its place, one section per command: its usage, its help
and a table of its arguments and options, as ``tnt-snapshot COMMAND --help`` states them. A
command added to the group appears without an edit to the page.
"""

from __future__ import annotations

from typing import Any

#: The line a page holds where the generated reference goes.
MARKER = "<!-- cli-reference: generated from the tnt-snapshot command -->"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """mkdocs calls this for every page; only a page holding the marker changes."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())


def render() -> str:
    """The reference of every ``tnt-snapshot`` command, in markdown."""
    import click

    from tnt_snapshot_plugin.cli import cli

    sections = []
    with click.Context(cli, info_name="tnt-snapshot") as group:
        sections.append(
            "```text\ntnt-snapshot " + " ".join(cli.collect_usage_pieces(group)) + "\n```\n\n"
            + _paragraphs(cli.help or "") + "\n\n| option | meaning |\n| --- | --- |\n"
            + "\n".join(_row(param, group) for param in cli.get_params(group)) + "\n"
        )
        for name in cli.list_commands(group):
            command = cli.get_command(group, name)
            assert command is not None
            with click.Context(command, info_name=name, parent=group) as ctx:
                sections.append(_command(ctx))
    return "\n".join(sections)


def _command(ctx: Any) -> str:
    command = ctx.command
    usage = " ".join(command.collect_usage_pieces(ctx))
    lines = [
        f"## `{ctx.info_name}`",
        "",
        "```text",
        f"tnt-snapshot {ctx.info_name} {usage}",
        "```",
        "",
        _paragraphs(command.help or ""),
        "",
        "| argument or option | meaning |",
        "| --- | --- |",
    ]
    for param in command.get_params(ctx):
        lines.append(_row(param, ctx))
    lines.append("")
    return "\n".join(lines)


def _paragraphs(text: str) -> str:
    """click's help text as markdown: its paragraphs, each on one line, ``\\b`` blocks as they are."""
    import inspect

    blocks = inspect.cleandoc(text).split("\n\n")
    out = []
    for block in blocks:
        if block.startswith("\b\n"):
            out.append("```text\n" + block[2:] + "\n```")
        else:
            out.append(" ".join(line.strip() for line in block.splitlines()))
    return "\n\n".join(out)


def _row(param: Any, ctx: Any) -> str:
    import click

    if isinstance(param, click.Argument):
        return f"| `{param.make_metavar(ctx)}` | argument{'' if param.required else ' (optional)'} |"
    names, meaning = param.get_help_record(ctx)
    return f"| `{' '.join(names.split())}` | {_cell(meaning)} |"  # a pipe inside a code span stays


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")
