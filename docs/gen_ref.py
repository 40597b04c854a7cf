"""The reference pages of the documentation, generated at build time (never typed).

``mkdocs.yml`` loads this file as a hook: ``on_files`` adds

- ``reference/configuration.md``: every key of the pydantic schema in ``fedasync/config.py``
  (its YAML path, type, default, constraints and the comment or docstring beside it in the source);
- ``reference/cli.md``: every command and sub-command of the typer app ``fedasync.cli.app`` with
  its usage, help and options (names, type, default, help);
- the figures of ``benchmarks/results/*.png`` as ``benchmarks/results/<name>.png``, so that the
  pages link the result files where they are in the repository.

``python docs/gen_ref.py OUTDIR`` writes the two pages to OUTDIR instead (to read them).
"""

from __future__ import annotations

import inspect
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[1]
CONFIG_PAGE = "reference/configuration.md"
CLI_PAGE = "reference/cli.md"

# -- configuration -------------------------------------------------------------------


def _comments(cls: type) -> dict[str, str]:
    """Field name -> the comment on its line in ``cls``'s source, after any comment lines just
    above it (a section's heading comment, such as ``# fedbuff``, counts)."""
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    out: dict[str, str] = {}
    above: list[str] = []
    for line in src.splitlines()[1:]:
        s = line.strip()
        if s.startswith("#"):
            above.append(s.lstrip("#").strip())
            continue
        m = re.match(r"\s+([A-Za-z_][A-Za-z0-9_]*)\s*:", line)
        if m and not s.startswith(("def ", "@", "return", "raise", "if ")):
            tail = line.split("  # ", 1)[1].strip() if "  # " in line else ""
            text = " ".join(p for p in (*above, tail) if p)
            if text:
                out[m.group(1)] = text
        above = []
    return out


def _class_line_comment(cls: type) -> str:
    try:
        first = inspect.getsource(cls).splitlines()[0]
    except (OSError, TypeError):
        return ""
    return first.split("  # ", 1)[1].strip() if "  # " in first else ""


def _models(ann: Any) -> list[type]:
    from pydantic import BaseModel

    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    return [m for a in typing.get_args(ann) for m in _models(a)]


def _type_name(ann: Any) -> str:
    origin = typing.get_origin(ann)
    if ann is type(None):
        return "null"
    if origin is Literal:
        return " \\| ".join(f"`{a}`" if not isinstance(a, str) else f"`{a}`" for a in typing.get_args(ann))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(ann))
    if origin is typing.Annotated:
        return _type_name(typing.get_args(ann)[0])
    if origin in (list, tuple, dict):
        args = typing.get_args(ann)
        inner = ", ".join(_type_name(a) for a in args if a is not Ellipsis)
        return f"{origin.__name__}[{inner}]" if inner else origin.__name__
    if isinstance(ann, type):
        if _models([ann]):
            return "section"
        return ann.__name__
    return str(ann).replace("typing.", "")


def _constraints(field: Any) -> str:
    names = {"gt": ">", "ge": ">=", "lt": "<", "le": "<=", "min_length": "length >=", "max_length": "length <="}
    out = []
    for meta in field.metadata:
        for attr, sym in names.items():
            v = getattr(meta, attr, None)
            if v is not None:
                out.append(f"{sym} {v}")
        if getattr(meta, "allow_inf_nan", None) is False:
            out.append("finite")
    return ", ".join(out)


def _default(field: Any) -> str:
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    d = field.default
    if d is PydanticUndefined:
        return "required"
    if isinstance(d, BaseModel):
        return "(section)"
    if d is None:
        return "`null`"
    if isinstance(d, bool):
        return f"`{str(d).lower()}`"
    return f"`{d!r}`" if not isinstance(d, str) else f"`{d}`"


def config_rows() -> list[tuple[str, str, str, str, str]]:
    """(key, type, default, constraints, description) for every key of the schema, sections first
    then their keys, depth first in the schema's order."""
    from fedasync.config import Config
    from fedasync.config_effect import applies_to

    rows: list[tuple[str, str, str, str, str]] = []

    def walk(model: type, prefix: str) -> None:
        notes = _comments(model)
        for name, field in model.model_fields.items():
            key = f"{prefix}{field.alias or name}"
            subs = _models(field.annotation)
            desc = notes.get(name, "")
            only = applies_to(key[len("server."):]) if key.startswith("server.") else None
            if only:  # fedasync/config_effect.py: set away from its default under another strategy: refused
                desc = f"{desc} *Applies to {', '.join(only)}.*".strip()
            if subs:
                sub = subs[0]
                doc = inspect.getdoc(sub) if sub.__doc__ else ""
                desc = " ".join(p for p in (desc, _class_line_comment(sub), (doc or "").split("\n\n")[0]) if p)
                is_list = typing.get_origin(field.annotation) is list
                rows.append((key, "list of sections" if is_list else "section" + (
                    " \\| null" if type(None) in typing.get_args(field.annotation) else ""),
                    _default(field), _constraints(field), desc))
                walk(sub, f"{key}[]." if is_list else f"{key}.")
            else:
                rows.append((key, _type_name(field.annotation), _default(field), _constraints(field), desc))

    walk(Config, "")
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") if "\\|" not in text else text.replace("\n", " ")


def config_markdown() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from the pydantic schema in `fedasync/config.py` when the site is built "
        "(`docs/gen_ref.py`): every key, its type, default, constraints and the note beside it in the "
        "source. Sections nest as in YAML; `a[].b` is key `b` of each item of the list `a`. "
        "Any key can be set from the command line with `--set a.b=value`. An unknown key, a wrong type "
        "or a value outside its range stops the command before anything runs, with one line naming "
        "the key, exit code 2; so does a key marked *Applies to* set away from its default under another "
        "`server.strategy` (it would have no effect). The annotated quickstart is in "
        "[Configuration](../configuration.md).",
        "",
        "| key | type | default | constraints | description |",
        "|---|---|---|---|---|",
    ]
    for key, typ, default, cons, desc in config_rows():
        lines.append(f"| <code id=\"{key}\">{key}</code> | {typ} | {_cell(default)} | {_cell(cons)} | {_cell(desc)} |")
    return "\n".join(lines) + "\n"


# -- CLI ------------------------------------------------------------------------------


def cli_commands() -> list[tuple[str, Any]]:
    """("fedasync simulate", click command), ... for every command, groups included, in order."""
    import typer

    from fedasync.cli import app

    root = typer.main.get_command(app)
    out: list[tuple[str, Any]] = [("fedasync", root)]

    def walk(cmd: Any, path: str) -> None:
        for name, sub in getattr(cmd, "commands", {}).items():
            out.append((f"{path} {name}", sub))
            walk(sub, f"{path} {name}")

    walk(root, "fedasync")
    return out


def _param_row(p: Any) -> str:
    import click

    if isinstance(p, click.Argument):
        names = f"`{p.human_readable_name}`"
        kind = "argument" + ("" if p.required else ", optional")
    else:
        names = ", ".join(f"`{o}`" for o in [*p.opts, *p.secondary_opts])
        kind = "flag" if p.is_flag else p.type.name
        if p.multiple:
            kind += ", repeatable"
    default = p.default
    if callable(default) or default in (None, (), []) or (getattr(p, "is_flag", False) and default is False):
        d = ""
    else:
        d = f"`{default}`"
    helptext = getattr(p, "help", None) or ""
    return f"| {names} | {_cell(kind)} | {_cell(d)} | {_cell(' '.join(helptext.split()))} |"


def cli_markdown() -> str:
    import click

    lines = [
        "# CLI reference",
        "",
        "Generated from the typer app (`fedasync.cli.app`) when the site is built (`docs/gen_ref.py`): "
        "every command with its usage, help and options, as `fedasync COMMAND --help` prints them. "
        "A bad value is one line naming the flag, exit code 2.",
        "",
    ]
    ctx_root = click.Context(cli_commands()[0][1], info_name="fedasync")
    for path, cmd in cli_commands():
        depth = min(path.count(" ") + 1, 4)
        lines += [f"{'#' * (depth + 1)} `{path}`", ""]
        ctx = click.Context(cmd, info_name=path, parent=None if path == "fedasync" else ctx_root)
        usage = " ".join(cmd.collect_usage_pieces(ctx))
        lines += ["```text", f"{path} {usage}".rstrip(), "```", ""]
        if cmd.help:
            lines += [inspect.cleandoc(cmd.help).replace("\b\n", ""), ""]
        params = [p for p in cmd.params if not getattr(p, "hidden", False)]
        if params:
            lines += ["| option | type | default | help |", "|---|---|---|---|"]
            lines += [_param_row(p) for p in params]
            lines.append("")
        if getattr(cmd, "commands", None):
            lines += ["Sub-commands: " + ", ".join(f"`{path} {n}`" for n in cmd.commands), ""]
    return "\n".join(lines) + "\n"


# -- the MkDocs hook -----------------------------------------------------------------------

# pages the nav names that are being written alongside (docs/tracking.md, the tracking issue's):
# left out of the nav while the file does not exist yet, so the strict build stays green
PENDING_PAGES = {"tracking.md"}


def _drop_pending(nav: Any, docs_dir: Path) -> Any:
    if isinstance(nav, list):
        return [x for x in (_drop_pending(n, docs_dir) for n in nav) if x is not None]
    if isinstance(nav, dict):
        out = {k: _drop_pending(v, docs_dir) for k, v in nav.items()}
        return {k: v for k, v in out.items() if v is not None} or None
    if isinstance(nav, str) and nav in PENDING_PAGES and not (docs_dir / nav).is_file():
        return None
    return nav


def on_config(config: Any) -> Any:
    """Leave a pending page (:data:`PENDING_PAGES`) out of the nav while it does not exist."""
    if config.get("nav"):
        config["nav"] = _drop_pending(config["nav"], Path(config["docs_dir"]))
    return config



def on_files(files: Any, config: Any) -> Any:
    """Add the generated reference pages and the benchmark figures to the site."""
    from mkdocs.structure.files import File

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    for uri, make in ((CONFIG_PAGE, config_markdown), (CLI_PAGE, cli_markdown)):
        old = files.get_file_from_path(uri)
        if old is not None:
            files.remove(old)
        files.append(File.generated(config, uri, content=make()))
    for png in sorted((ROOT / "benchmarks" / "results").glob("*.png")):
        uri = f"benchmarks/results/{png.name}"
        if files.get_file_from_path(uri) is None:
            files.append(File.generated(config, uri, abs_src_path=str(png)))
    return files


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    (out / "reference").mkdir(parents=True, exist_ok=True)
    (out / CONFIG_PAGE).write_text(config_markdown())
    (out / CLI_PAGE).write_text(cli_markdown())
