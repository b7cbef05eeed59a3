"""MkDocs hooks (mkdocs.yml ``hooks:``): the reference pages, generated at build time from the code.

- ``reference/configuration.md`` from the JSON Schema ``workflow/schemas/config.schema.yaml``;
- ``reference/outputs.md`` from :class:`workflow.paths.RunLayout` and the ``*Files`` classes;
- ``reference/cli.md`` from :func:`workflow.cli.build_parser`;
- in any page, a line ``<!-- stage: NAME -->`` becomes what ``workflow.stages.STAGES`` declares for
  that stage (unit, upstream, outputs, keys read, tuning keys).

Each generator is a plain function of the code, so tests/test_docs.py reads the same text.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
from pathlib import Path

import yaml
from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parent.parent
SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"
GENERATED = {"reference/configuration.md": "configuration_page", "reference/outputs.md": "outputs_page",
             "reference/cli.md": "cli_page"}


# --- configuration ------------------------------------------------------------------------------

def schema_keys(node: dict, prefix: str = "") -> list[tuple[str, dict]]:
    """Every key of the schema as (dotted name, its schema), depth first in the file's order."""
    keys = []
    for name, child in node.get("properties", {}).items():
        dotted = f"{prefix}{name}"
        keys.append((dotted, child))
        keys += schema_keys(child, dotted + ".")
    return keys


def key_anchor(dotted: str) -> str:
    """The HTML id of a key's row in the configuration reference."""
    return "key-" + dotted.replace(".", "-").replace("_", "-").lower()


def _inline(value) -> str:
    return "`" + json.dumps(value) + "`"


def _type(node: dict) -> str:
    kind = node.get("type", "")
    kinds = kind if isinstance(kind, list) else [kind] if kind else []
    if "items" in node:
        items = node["items"]
        inner = "|".join(map(str, items.get("enum", []))) if "enum" in items else items.get("type", "")
        kinds = [f"array of {inner}" if k == "array" else k for k in kinds] or [f"array of {inner}"]
    return ", ".join(kinds) or ("enum" if "enum" in node else "")


def _bounds(node: dict) -> list[str]:
    parts = []
    for word, sign in (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"),
                       ("exclusiveMaximum", "<"), ("minLength", "length ≥"), ("minItems", "items ≥"),
                       ("maxItems", "items ≤")):
        if word in node:
            parts.append(f"{sign} {node[word]}")
    if "enum" in node:
        parts.append("one of " + ", ".join(_inline(v) for v in node["enum"]))
    if "pattern" in node:
        parts.append(f"matches `{node['pattern']}`")
    if node.get("uniqueItems"):
        parts.append("unique items")
    if "not" in node and "const" in node["not"]:
        parts.append(f"not {_inline(node['not']['const'])}")
    return parts


def _allowed(node: dict) -> str:
    parts = _bounds(node)
    if isinstance(node.get("items"), dict):
        inner = _bounds(node["items"])
        parts += [f"each {p}" for p in inner]
    return "; ".join(parts).replace("|", "\\|")


def _cell(text: str) -> str:
    """One table cell: one line, reStructuredText roles and literals as Markdown code."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", " ".join(str(text).split())).replace("``", "`")
    return text.replace("|", "\\|")


def configuration_page() -> str:
    """The configuration reference: one table per section, a row per key."""
    schema = yaml.safe_load(SCHEMA.read_text())
    lines = ["# Configuration reference", "",
             "Generated from `workflow/schemas/config.schema.yaml`, the schema that the Snakefile and "
             "every `cosmoflow` command validate a configuration against (the [configuration "
             "design](../configuration.md) says how; the cross-key rules are there too). A key's "
             "default is the tiny run of `config/config.yaml`.", "",
             _cell(schema.get("description", "")), ""]
    top = [(name, node) for name, node in schema["properties"].items() if "properties" not in node]
    sections = [(name, node) for name, node in schema["properties"].items() if "properties" in node]
    header = ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]

    def rows(keys):
        return [f"| <span id=\"{key_anchor(k)}\"></span>`{k}` | {_type(n)} | "
                f"{_inline(n['default']) if 'default' in n else '—'} | {_allowed(n)} | "
                f"{_cell(n.get('description', ''))} |" for k, n in keys]

    lines += ["## Top-level keys", ""] + header + rows(top) + [""]
    for name, node in sections:
        anchor = f"<span id=\"{key_anchor(name)}\"></span>"
        lines += [f"## {name}", "", anchor + _cell(node.get("description", "")), ""]
        lines += header + rows(schema_keys(node, name + ".")) + [""]
    return "\n".join(lines)


# --- outputs ------------------------------------------------------------------------------------

def layout_classes() -> list[type]:
    """RunLayout and the *Files classes of workflow.paths, in the module's order."""
    from workflow import paths
    return [paths.RunLayout] + [cls for name, cls in vars(paths).items()
                                if inspect.isclass(cls) and name.endswith("Files")]


def layout_members(cls: type) -> list[tuple[str, object]]:
    """The class's own public properties and methods, in definition order."""
    return [(name, member) for name, member in vars(cls).items()
            if not name.startswith("_") and (isinstance(member, property) or inspect.isfunction(member))]


def _example(cls: type, name: str, member) -> str:
    """The member's path in a directory named ``RUN`` (RunLayout) or ``DIR``, its arguments as
    ``<name>`` placeholders (wildcard strings are used as given)."""
    base = Path("RUN" if cls.__name__ == "RunLayout" else "DIR")
    obj = cls(base)
    if isinstance(member, property):
        value = getattr(obj, name)
    else:
        params = list(inspect.signature(member).parameters)[1:]
        if not params:
            return ""
        value = getattr(obj, name)(*[f"<{p}>" for p in params])
    value = getattr(value, "directory", value)
    return f"`{value}`" if isinstance(value, Path) else ""


def outputs_page() -> str:
    """The outputs reference: every path RunLayout and the *Files classes name, with its docstring."""
    lines = ["# Outputs reference", "",
             "Generated from `workflow/paths.py`: every file and directory the pipeline's stages name "
             "through `RunLayout` (a run directory, `RUN` = `<results_dir>/<run_name>/`) and the "
             "classes naming the files inside the directories a kernel is handed (`DIR`). "
             "Arguments are shown as `<placeholders>`. The [run directory](../run-directory.md) "
             "page describes the layout and the [file formats](../formats.md) page each file's "
             "contents.", ""]
    for cls in layout_classes():
        lines += [f"## {cls.__name__}", "", _cell(inspect.getdoc(cls) or ""), "",
                  "| name | path | description |", "|---|---|---|"]
        for name, member in layout_members(cls):
            call = name if isinstance(member, property) else f"{name}{inspect.signature(member)}"
            call = call.replace("(self, ", "(").replace("(self)", "()").replace("'", "")
            lines.append(f"| `{_cell(call)}` | {_example(cls, name, member)} | "
                         f"{_cell(inspect.getdoc(member) or '')} |")
        if cls.__bases__[0] is not object:
            lines.append(f"\nand everything of `{cls.__bases__[0].__name__}`.")
        lines.append("")
    return "\n".join(lines)


# --- command line -------------------------------------------------------------------------------

def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser's subcommands by name."""
    return next(action.choices for action in parser._actions
                if isinstance(action, argparse._SubParsersAction))


def _options(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    rows = ["| option | help |", "|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        names = ", ".join(action.option_strings) or action.metavar or action.dest
        if action.option_strings and action.nargs != 0:
            names += f" {action.metavar or action.dest.upper()}"
        text = formatter._expand_help(action) if action.help else ""
        if action.choices:
            text += " (one of " + ", ".join(map(str, action.choices)) + ")"
        shown = "default" in (action.help or "")
        if action.default not in (None, False, [], argparse.SUPPRESS) and not shown:
            text += f" (default: `{action.default}`)"
        rows.append(f"| `{_cell(names)}` | {_cell(text)} |")
    return rows


def cli_page() -> str:
    """The CLI reference: the command's options, then every subcommand's usage and options."""
    from workflow.cli import build_parser
    parser = build_parser()
    lines = ["# Command-line reference", "",
             "Generated from `workflow.cli.build_parser()`. Every stage of the [stage "
             "table](../stages.md) is a subcommand (its rule name with `-` for `_`), besides the "
             "commands that check, stage, run ensembles and sweeps.", "",
             "```", parser.format_usage().strip(), "```", ""] + _options(parser) + [""]
    for name, sub in subcommands(parser).items():
        lines += [f"## cosmoflow {name}", "", _cell(sub.description or ""), "",
                  "```", sub.format_usage().strip(), "```", ""] + _options(sub) + [""]
    return "\n".join(lines)


# --- stage blocks -------------------------------------------------------------------------------

STAGE_MARK = re.compile(r"^<!-- stage: (\w+) -->$", re.MULTILINE)


def _key_link(key: str) -> str:
    return f"[`{key}`](reference/configuration.md#{key_anchor(key)})"


def stage_block(name: str) -> str:
    """What the stage table declares for stage ``name``, as a short list."""
    from workflow.paths import RunLayout
    from workflow.stages import STAGES
    stage = next(s for s in STAGES if s.name == name)
    outputs = stage.outputs(RunLayout(Path("RUN")), **stage.unit.patterns())
    lines = [f"- **does**: {stage.summary}",
             f"- **unit of work**: {stage.unit.name}" + (", MPI" if stage.mpi else ""),
             "- **upstream**: " + (", ".join(f"`{u}`" for u in stage.upstream) or "—"),
             "- **writes last**: " + ", ".join(f"`{p}`" for p in outputs)]
    if stage.per_simulation:
        lines.append(f"- **per simulation**: `{stage.per_simulation(RunLayout(Path('RUN')), '<sim_id>')}`"
                     + (f", kept if {_key_link(stage.kept_if)}" if stage.kept_if else ""))
    lines.append("- **keys read**: " + ", ".join(map(_key_link, stage.reads)))
    if stage.tuning:
        lines.append("- **tuning keys** (rerun nothing): " + ", ".join(map(_key_link, stage.tuning)))
    return "\n".join(lines)


# --- MkDocs events ------------------------------------------------------------------------------

def on_files(files, config):
    for path, generator in GENERATED.items():
        files.append(File.generated(config, path, content=globals()[generator]()))
    return files


def on_page_markdown(markdown, page, config, files):
    return STAGE_MARK.sub(lambda match: stage_block(match.group(1)), markdown)
