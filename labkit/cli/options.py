"""Click options generated from config dataclasses, so a command's help, defaults and names cannot drift.

One option per field: `--field-name` (or `metadata={"option": "--name"}`), the field's type and default,
`metadata={"choices": (...)}` as a `click.Choice`, bools as flags (`--x/--no-x` when the default is on),
fields without a default required, and the help text the field's attribute docstring (torchtitan's
JobConfig and tyro read the same docstrings). `labkit train` is built this way from
`labkit.train.config.SECTIONS`; its help lists the options section by section.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing

import click


def field_docs(cls: type) -> dict[str, str]:
    """{field name: its attribute docstring} (the string literal right under each annotated field)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for item, after in zip(body, body[1:]):
        if (isinstance(item, ast.AnnAssign) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[item.target.id] = " ".join(after.value.value.split())
    return docs


def option_name(f: dataclasses.Field) -> str:
    return f.metadata.get("option", "--" + f.name.replace("_", "-"))


def _scalar(tp) -> type:
    """int / float / str / bool of an annotation such as `int | None`."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def make_option(f: dataclasses.Field, annotation, doc: str) -> click.Option:
    """The click option of one dataclass field."""
    name = option_name(f)
    required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    default = None if required else f.default
    kind = _scalar(annotation)
    shown = not (default is None or isinstance(default, bool) or default == "")  # 0 is shown, False is not
    settings: dict = dict(default=default, required=required, help=doc, show_default=shown)
    if kind is bool:
        decls = [f"{name}/--no-{name[2:]}" if default else name]
        settings.update(is_flag=True, show_default=False)
    else:
        decls = [name]
        settings["type"] = click.Choice(f.metadata["choices"]) if "choices" in f.metadata else kind
    return click.Option([*decls, f.name], **settings)


class SectionedCommand(click.Command):
    """A command whose --help lists its options under one heading per config section."""

    def __init__(self, *args, groups: dict[str, tuple[str, list[str]]], **kwargs):
        super().__init__(*args, **kwargs)
        self.groups = groups  # heading -> (one-line summary, option names)

    def format_options(self, ctx, formatter) -> None:
        params = {p.name: p for p in self.get_params(ctx)}
        placed: set[str] = set()
        for title, (summary, names) in self.groups.items():
            rows = [params[n].get_help_record(ctx) for n in names]
            with formatter.section(title):
                formatter.write_text(summary)
                formatter.write_paragraph()
                formatter.write_dl([r for r in rows if r])
            placed.update(names)
        rest = [p.get_help_record(ctx) for n, p in params.items() if n not in placed]
        if any(rest):
            with formatter.section("Other options"):
                formatter.write_dl([r for r in rest if r])


def section_options(sections: dict[str, type]) -> tuple[list[click.Option], dict[str, tuple[str, list[str]]]]:
    """Options of every field of every section dataclass, and {help heading: (summary, option names)}."""
    options, groups = [], {}
    for section, cls in sections.items():
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        made = [make_option(f, hints[f.name], docs.get(f.name, "")) for f in dataclasses.fields(cls)]
        summary = " ".join((cls.__doc__ or "").split())
        groups[f"{section.capitalize()} options (cfg.{section})"] = (summary, [o.name for o in made])
        options += made
    return options, groups


def sectioned_command(name: str, sections: dict[str, type], **settings):
    """Decorator: a `SectionedCommand` calling the function with one keyword per field."""
    def wrap(callback):
        options, groups = section_options(sections)
        return SectionedCommand(name, callback=callback, params=options, groups=groups,
                                help=inspect.getdoc(callback), **settings)
    return wrap
