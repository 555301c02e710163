"""The worked patch (``mrv2.patch``), applied to a module's source in memory.

The plugin does not carry a second copy of vLLM's methods: it applies the
same unified diff that a vLLM maintainer would apply to the source tree, to
the text of the module that is loaded, and compiles the definitions the diff
changes. So the plugin and the patch cannot drift apart: they are one text.

What a diff may change, so that it can be applied to a live module:
- methods of a class (each compiled alone, with the module's globals, and
  set on the class in place of the original);
- new class attributes with a literal value;
- new ``import`` statements at module level.
Anything else (a new module-level function, a changed class statement, a
method using ``super()`` or name mangling, which a method compiled outside
its class cannot) makes :func:`plan` fail, so nothing is applied.
"""

from __future__ import annotations

import ast
import hashlib
import re
import textwrap
from dataclasses import dataclass, field

__all__ = ["SourceChange", "apply_diff", "fingerprint", "fingerprints", "plan", "split_diff"]

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class DiffError(ValueError):
    """The diff does not apply to the text, or changes what cannot be applied live."""


def split_diff(diff: str) -> dict[str, list[tuple[int, list[str]]]]:
    """Parse a unified diff: ``{path: [(old_start, hunk_lines), ...]}`` with
    paths as in the ``+++ b/...`` lines (prefix ``b/`` dropped) and hunk
    lines as written (first character ' ', '-' or '+')."""
    files: dict[str, list[tuple[int, list[str]]]] = {}
    hunks = None
    for line in diff.splitlines():
        if line.startswith("+++ "):
            path = line[4:].split("\t")[0].strip()
            hunks = files.setdefault(path[2:] if path.startswith("b/") else path, [])
        elif line.startswith(("--- ", "diff ")):
            continue
        elif line.startswith("@@"):
            m = _HUNK.match(line)
            if m is None or hunks is None:
                raise DiffError(f"malformed hunk header: {line!r}")
            hunks.append((int(m.group(1)), []))
        elif hunks and line[:1] in (" ", "-", "+"):
            hunks[-1][1].append(line)
        elif line == "" and hunks:  # an empty context line stripped of its space
            hunks[-1][1].append(" ")
        elif line.startswith("\\"):  # "\ No newline at end of file"
            continue
        elif line.strip():
            raise DiffError(f"unexpected line in diff: {line[:60]!r}")
    return files


def apply_diff(text: str, hunks: list[tuple[int, list[str]]]) -> tuple[str, list[tuple[str, int]]]:
    """Apply one file's hunks to ``text`` exactly (no fuzz: every context and
    removed line must match). A hunk is looked for at its stated line first,
    then anywhere after the previous one, where it must match once. Returns
    the new text and what changed in the original, as ``("del", i)`` (line
    ``i`` removed) and ``("ins", i)`` (lines inserted after line ``i``),
    1-based."""
    lines = text.split("\n")
    out: list[str] = []
    pos = 0
    changed: list[tuple[str, int]] = []
    for start, body in hunks:
        old = [ln[1:] for ln in body if ln[0] in " -"]
        new = [ln[1:] for ln in body if ln[0] in " +"]
        at = start - 1 if old else start
        if at < pos or lines[at : at + len(old)] != old:
            hits = [i for i in range(pos, len(lines) - len(old) + 1) if lines[i : i + len(old)] == old]
            if len(hits) != 1:
                raise DiffError(f"hunk at line {start} does not apply ({len(hits)} matches)")
            at = hits[0]
        i = at  # original lines consumed so far (0-based index of the next one)
        anchor = None  # lines replacing removed ones are inserted where the first removed one was
        for ln in body:
            if ln[0] == "+":
                changed.append(("ins", i if anchor is None else anchor))
                continue
            if ln[0] == "-":
                changed.append(("del", i + 1))
                anchor = i if anchor is None else anchor
            else:
                anchor = None
            i += 1
        out += lines[pos:at] + new
        pos = at + len(old)
    out += lines[pos:]
    return "\n".join(out), changed


def fingerprint(source: str) -> str:
    """A definition's fingerprint: sha256 of its source text (decorators
    included), first 16 hex digits."""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


@dataclass
class SourceChange:
    """What a diff changes in one module, ready to be set on the live classes."""

    module: str
    # (class, method) -> fingerprint of the original definition
    originals: dict[tuple[str, str], str] = field(default_factory=dict)
    # (class, method) -> (source of the changed definition, its first line in the patched text)
    methods: dict[tuple[str, str], tuple[str, int]] = field(default_factory=dict)
    # (class, attribute) -> literal value
    class_attrs: dict[tuple[str, str], object] = field(default_factory=dict)
    imports: list[str] = field(default_factory=list)  # new module-level import statements
    patched_text: str = ""


def _span(node: ast.AST) -> tuple[int, int]:
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", ())])
    return first, node.end_lineno


def _segment(lines: list[str], node: ast.AST) -> str:
    a, b = _span(node)
    return "\n".join(lines[a - 1 : b])


def _within(span: tuple[int, int], kind: str, i: int) -> bool:
    """Whether a change (``("del", i)`` or ``("ins", i)``) falls inside ``span``."""
    a, b = span
    return a <= i <= b if kind == "del" else a <= i < b


def _touches(span: tuple[int, int], changed: list[tuple[str, int]]) -> bool:
    return any(_within(span, kind, i) for kind, i in changed)


def _members(tree: ast.Module) -> dict[str, dict[str, ast.AST]]:
    """Top-level classes -> their methods and simple attributes, by name."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            members = {}
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members[item.name] = item
                elif isinstance(item, ast.Assign) and len(item.targets) == 1 and isinstance(item.targets[0], ast.Name):
                    members[item.targets[0].id] = item
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members[item.target.id] = item
            out[node.name] = members
    return out


def fingerprints(text: str, keys) -> dict[tuple[str, str], str | None]:
    """The fingerprint of each ``(class, method)`` of ``keys`` in the module
    source ``text`` (None: no such method)."""
    lines = text.split("\n")
    members = _members(ast.parse(text))
    out = {}
    for cls, name in keys:
        item = members.get(cls, {}).get(name)
        ok = isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
        out[(cls, name)] = fingerprint(_segment(lines, item)) if ok else None
    return out


def function_fingerprints(text: str, names) -> dict[str, str | None]:
    """The fingerprint of each top-level function (``name``) or method
    (``Class.name``) of ``names`` in the module source ``text`` (None: no
    such definition)."""
    lines = text.split("\n")
    tree = ast.parse(text)
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    members = _members(tree)
    out = {}
    for name in names:
        cls, _, attr = name.rpartition(".")
        item = members.get(cls, {}).get(attr) if cls else defs.get(name)
        ok = isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
        out[name] = fingerprint(_segment(lines, item)) if ok else None
    return out


def plan(module: str, text: str, hunks: list[tuple[int, list[str]]]) -> SourceChange:
    """What ``hunks`` change in ``text`` (the source of ``module``), checked
    to be applicable to the live module (see the module docstring)."""
    new_text, changed = apply_diff(text, hunks)
    old_lines, new_lines = text.split("\n"), new_text.split("\n")
    old_tree, new_tree = ast.parse(text), ast.parse(new_text)
    change = SourceChange(module=module, patched_text=new_text)
    old_members, new_members = _members(old_tree), _members(new_tree)
    covered: list[tuple[int, int]] = []  # original line spans accounted for
    for node in old_tree.body:
        if isinstance(node, ast.ClassDef):
            for name, item in old_members[node.name].items():
                if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                span = _span(item)
                if not _touches(span, changed):
                    continue
                new_item = new_members.get(node.name, {}).get(name)
                if not isinstance(new_item, type(item)):
                    raise DiffError(f"{node.name}.{name}: removed or no longer a method")
                src = _segment(new_lines, new_item)
                if "super()" in src or "__class__" in src or re.search(r"\bself\.__\w*[^_\W]\b", src):
                    raise DiffError(f"{node.name}.{name}: uses super() or name mangling; cannot be compiled alone")
                change.originals[(node.name, name)] = fingerprint(_segment(old_lines, item))
                change.methods[(node.name, name)] = (src, _span(new_item)[0])
                covered.append(span)
    for cls, members in new_members.items():
        for name, item in members.items():
            if name in old_members.get(cls, {}):
                continue
            if not isinstance(item, (ast.Assign, ast.AnnAssign)):
                raise DiffError(f"{cls}.{name}: a new method; only changed methods can be applied live")
            try:
                change.class_attrs[(cls, name)] = ast.literal_eval(item.value)
            except (ValueError, TypeError, SyntaxError):
                raise DiffError(f"{cls}.{name}: a new class attribute must be a literal") from None
    old_imports = {ast.unparse(n) for n in old_tree.body if isinstance(n, (ast.Import, ast.ImportFrom))}
    change.imports = [
        ast.unparse(n)
        for n in new_tree.body
        if isinstance(n, (ast.Import, ast.ImportFrom)) and ast.unparse(n) not in old_imports
    ]
    # every changed line must lie in a changed method, or be a new import / class attribute
    _check_accounted(old_tree, changed, covered, change)
    return change


def _check_accounted(old_tree, changed, covered, change) -> None:
    """Every change lies in a changed method, or inserts a new import into the
    module's import block or a new attribute into its class."""
    classes = {n.name: (n.lineno, n.end_lineno) for n in old_tree.body if isinstance(n, ast.ClassDef)}
    inserts = [classes[c] for c, _ in change.class_attrs if c in classes]
    import_lines = [n.lineno for n in old_tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    if change.imports and import_lines:
        inserts.append((min(import_lines) - 1, max(import_lines) + 1))
    for kind, i in changed:
        if any(_within(s, kind, i) for s in covered):
            continue
        if kind == "ins" and any(_within(s, kind, i) for s in inserts):
            continue
        raise DiffError(f"line {i} of the original: a change outside the methods, imports and class attributes")


def compile_method(change: SourceChange, key: tuple[str, str], module_globals: dict, filename: str):
    """The changed method ``key`` compiled with the module's own globals (so
    that it reads what the module reads, and what tests patch there), its
    line numbers those of the patched text under ``filename``."""
    src, first = change.methods[key]
    code = compile("\n" * (first - 1) + textwrap.dedent(src), filename, "exec")
    ns: dict = {}
    exec(code, module_globals, ns)  # noqa: S102  (the definition only: a def statement)
    fn = ns[key[1]]
    target = fn
    while hasattr(target, "__wrapped__"):
        target = target.__wrapped__
    for f in {fn, target}:
        if hasattr(f, "__qualname__"):
            f.__qualname__ = f"{key[0]}.{key[1]}"
        if hasattr(f, "__module__"):
            f.__module__ = change.module
    return fn
