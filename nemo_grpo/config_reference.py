"""The configuration reference (docs/config_reference.md), generated from the config dataclasses.

Every entry point's master config is walked section by section: each dotted key with its type, its default and
the one-line doc its field has in the source (the trailing `# comment`, or the comment lines right above it);
a section's intro is its class docstring's first sentence.

    python -m nemo_grpo.config_reference            # (re)write docs/config_reference.md
    python -m nemo_grpo.config_reference --check    # exit 1 if the file is stale or a key has no doc
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, Optional

from nemo_grpo.config import EvalMasterConfig, MasterConfig, RMEvalConfig, RMTrainConfig

OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "config_reference.md"
ENTRY_POINTS = [  # (title, command, master config)
    ("GRPO training", "python -m nemo_grpo.train", MasterConfig),
    ("Evaluation", "python -m nemo_grpo.eval", EvalMasterConfig),
    ("Reward-model training", "python -m nemo_grpo.train_rm", RMTrainConfig),
    ("Reward-model evaluation", "python -m nemo_grpo.eval_rm", RMEvalConfig),
]
MAX_DEFAULT_CHARS = 40
HEADER = """# Configuration reference

Generated from the config dataclasses (nemo_grpo/config.py and the modules it re-exports) by
`python -m nemo_grpo.config_reference` (`make config-reference`): do not edit it by hand. Set a key in a YAML
recipe (`--config recipe.yaml`) or on the command line by its dotted path, e.g.
`policy.generation.vllm_cfg.tensor_parallel_size=2`; `null` is YAML's None. An optional section (type
`Optional[...]`, default `null`) is off until one of its keys is set, and then has the defaults listed. A table
that a previous entry point already showed with the same keys, types and defaults is not repeated.
"""


@dataclasses.dataclass
class Section:
    """One table: a section's dotted path, its intro and its leaf keys (key, type, default, doc)."""
    path: str
    intro: str
    rows: list[tuple[str, str, str, str]]


@functools.lru_cache(maxsize=None)
def _class_docs(cls: type) -> dict[str, str]:
    """Field name -> the comment text of its definition in `cls`'s own source (above lines, then trailing)."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments, code_lines = {}, set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.add(tok.start[0])
    docs = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1
        while line in comments and line not in code_lines:
            above.insert(0, comments[line])
            line -= 1
        trailing = [comments[n] for n in (node.lineno, node.end_lineno) if n in comments and n in code_lines]
        docs[node.target.id] = " ".join(above + trailing[:1]).strip()
    return docs


def field_doc(cls: type, name: str) -> str:
    """The doc of field `name` of `cls`, from the source of the class that defines it (inherited fields too)."""
    for klass in cls.__mro__:
        if name in klass.__dict__.get("__annotations__", {}):
            return _class_docs(klass).get(name, "")
    return ""


def first_sentence(cls: type) -> str:
    """The first sentence of a class's own docstring, on one line (empty for none)."""
    text = cls.__doc__ or ""
    flat = "" if text.startswith(cls.__name__ + "(") else " ".join(text.split())  # dataclass's generated doc
    end = flat.find(". ")
    return flat if end < 0 else flat[: end + 1]


def section_class(tp: Any) -> Optional[type]:
    """The dataclass of a section type (`X` or `Optional[X]`), None for a leaf type."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] if _is_optional(tp) else [tp]
    return args[0] if len(args) == 1 and dataclasses.is_dataclass(args[0]) else None


def _is_optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def type_name(tp: Any) -> str:
    """`int`, `Optional[int]`, `list[str]`, ... for a resolved annotation."""
    if _is_optional(tp):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return f"Optional[{', '.join(type_name(a) for a in inner)}]"
    origin = typing.get_origin(tp)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in typing.get_args(tp))}]"
    return getattr(tp, "__name__", str(tp))


def format_default(value: Any) -> str:
    """A default as YAML spells it (null, true, [..]), cut to MAX_DEFAULT_CHARS."""
    if value is None or isinstance(value, bool):
        text = {None: "null", True: "true", False: "false"}[value]
    elif isinstance(value, str):
        text = value if value else '""'
    elif isinstance(value, (list, tuple)):
        text = "[" + ", ".join(format_default(v) for v in value) + "]"
    else:
        text = repr(value)
    return text if len(text) <= MAX_DEFAULT_CHARS else text[: MAX_DEFAULT_CHARS - 1] + "…"


def walk(cls: type, value: Any, path: str = "", intro: str = "") -> list[Section]:
    """The sections of `cls` (default instance `value`) under dotted `path`, depth first, leaf keys in order."""
    hints = typing.get_type_hints(cls)
    section, below = Section(path, intro, []), []
    for f in dataclasses.fields(cls):
        key, tp, default = f"{path}.{f.name}".lstrip("."), hints[f.name], getattr(value, f.name)
        sub = section_class(tp)
        if sub is None:
            section.rows.append((key, type_name(tp), format_default(default), field_doc(cls, f.name)))
            continue
        doc, here = first_sentence(sub), field_doc(cls, f.name)
        text = " ".join(t for t in (doc, f"Here: {here.rstrip('.')}." if doc and here else here) if t)
        if default is None:
            text = f"Optional section (`{type_name(tp)}`, default `null`). {text}".strip()
        below += walk(sub, sub() if default is None else default, key, text)
    return ([section] if section.rows else []) + below


def missing_docs() -> list[str]:
    """Every dotted key (and section) of every master that has no doc, as `master: key`."""
    missing = []
    for _, _, master in ENTRY_POINTS:
        for section in walk(master, master()):
            if section.path and not section.intro:
                missing.append(f"{master.__name__}: {section.path} (section)")
            missing += [f"{master.__name__}: {key}" for key, _, _, doc in section.rows if not doc]
    return missing


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _text(text: str) -> str:
    """Prose for Markdown: `<` and `*` escaped outside code spans (`step_<N>` is no HTML tag), `|` everywhere."""
    parts = text.split("`")
    return _cell("`".join(p if i % 2 else p.replace("<", "\\<").replace("*", "\\*") for i, p in enumerate(parts)))


def render_section(section: Section) -> list[str]:
    """One section's heading, intro and table."""
    lines = [f"### `{section.path or '(top level)'}`", ""]
    if section.intro:
        lines += [_text(section.intro), ""]
    lines += ["| Key | Type | Default | Description |", "|---|---|---|---|"]
    for key, tp, default, doc in section.rows:
        lines.append(f"| `{key}` | `{_cell(tp)}` | `{_cell(default)}` | {_text(doc)} |")
    return lines + [""]


def _same_as(same: list[tuple[str, str]]) -> list[str]:
    """One line per earlier entry point for the tables (path, entry point title) that repeat one of its own."""
    lines = []
    for title in dict.fromkeys(earlier for _, earlier in same):
        paths = ", ".join(f"`{path}`" for path, earlier in same if earlier == title)
        lines += [f"Same keys, types and defaults as under {title}: {paths}.", ""]
    return lines


def render() -> str:
    """The whole reference, as Markdown."""
    lines, shown = [HEADER], {}
    for title, command, master in ENTRY_POINTS:
        lines += [f"## {title}: `{command}`", ""]
        if first_sentence(master):
            lines += [_text(first_sentence(master)), ""]
        same: list[tuple[str, str]] = []
        for section in walk(master, master()):
            earlier = shown.setdefault((section.path, repr(section.rows)), title)
            if earlier != title:
                same.append((section.path, earlier))
                continue
            lines += _same_as(same) + render_section(section)
            same = []
        lines += _same_as(same)
    return "\n".join(lines).rstrip("\n") + "\n"


def check(path: Path = OUTPUT) -> list[str]:
    """The problems --check reports: keys without a doc, and a stale or missing reference file."""
    problems = [f"no doc for {key}" for key in missing_docs()]
    current = path.read_text(encoding="utf-8") if path.is_file() else None
    if current != render():
        to = "" if path == OUTPUT else f" --output {path}"
        problems.append(f"{path} is {'missing' if current is None else 'stale'}: "
                        f"run `python -m nemo_grpo.config_reference{to}` (make config-reference)")
    return problems


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale or a key has no doc")
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"default: {OUTPUT}")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.output)
        for problem in problems:
            print(f"config reference: {problem}", file=sys.stderr)
        return 1 if problems else 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(render(), encoding="utf-8")
    missing = missing_docs()
    print(f"wrote {args.output}" + (f" ({len(missing)} keys without a doc: --check lists them)" if missing else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
