"""Griffe extension for the API reference: turn reST roles into autorefs links.

tapeflow's docstrings cross-reference with reST roles (:func:`leaf`,
:meth:`Tape.empty`, :class:`~tapeflow.Node`), which read well in ``help()``.
mkdocstrings renders Markdown, where a role would show up as literal text, so
this extension rewrites each role, at docs-build time only, into an
mkdocs-autorefs reference to the object's heading on the site:

    :meth:`Tape.empty`         ->  [`Tape.empty`][tapeflow.Tape.empty]
    :class:`~tapeflow.Node`    ->  [`Node`][tapeflow.Node]
    :func:`tfl.tie <tapeflow.tie>`  ->  [`tfl.tie`][tapeflow.tie]
    :func:`jax.jit`            ->  `jax.jit`     (not documented here: no link)

A name is looked up the way Python would see it from the docstring's object:
its own members, then its class, its module (imports included) and the
packages above, then ``tapeflow`` and ``tapeflow.nn``; ``tfl.`` means
``tapeflow.``. The object found is then mapped to the identifier of the heading
that documents it, so a method a class inherits links to that class's entry
(``Session.assign_state``) and a private definition links to its public name.

Which headings exist is decided the way mkdocstrings-python decides what to
render: the ``::: path`` entries of the pages, their options (``members``,
``filters``, ``inherited_members``, ``show_if_no_docstring``) over the
handler's options in mkdocs.yml. A role whose object has no heading becomes
plain code rather than a dead link. The strict build test checks the other
direction: every link this writes resolves.

The same file is also an mkdocs hook (``hooks:`` in mkdocs.yml): roles that
reach a Markdown page as text (docs/ops.md is generated from the op
definitions' docstrings) are rewritten the same way, resolved from the
``tapeflow`` package.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import griffe
import yaml

DOCS = Path(__file__).resolve().parents[1]
ROOT = DOCS.parent
ROLE = re.compile(r":(?:py:)?(func|meth|class|attr|data|mod|exc|obj|const):`([^`]+)`")
FENCE = re.compile(r"^\s*(```|~~~)")
ENTRY = re.compile(r"^:::\s+(\S+)\s*$")
WRAPPED_ROLE = re.compile(r":(?:py:)?(?:func|meth|class|attr|data|mod|exc|obj|const):`[^`\n]*\n[^`\n]*`")
ANCHOR = re.compile(r"^#+ .*\{ #(tapeflow\.[\w.]+) \}\s*$", re.M)
FALLBACK_SCOPES = ("tapeflow", "tapeflow.nn")
DEFAULT_FILTERS = ["!^_[^_]"]  # mkdocstrings-python's default
UNRESOLVABLE = (griffe.AliasResolutionError, griffe.CyclicAliasError)  # an alias to something not loaded (jax, optax)


class _IgnoreTags(yaml.SafeLoader):
    """mkdocs.yml may hold ``!!python/name:`` tags (emoji, custom fences): read them as None."""


_IgnoreTags.add_multi_constructor("", lambda loader, suffix, node: None)


def _handler_options() -> dict[str, Any]:
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_IgnoreTags) or {}
    for plugin in config.get("plugins", []):
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            return dict(plugin["mkdocstrings"]["handlers"]["python"].get("options", {}))
    return {}


def _entries() -> Iterator[tuple[str, dict[str, Any]]]:
    """Every ``::: path`` entry of the docs pages with its own ``options:``."""
    for page in sorted(DOCS.rglob("*.md")):
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            m = ENTRY.match(line)
            if not m:
                continue
            block = []
            for nxt in lines[i + 1 :]:
                if nxt.strip() and not nxt.startswith((" ", "\t")):
                    break
                block.append(nxt)
            local = yaml.safe_load("\n".join(block)) if any(b.strip() for b in block) else None
            yield m.group(1), dict((local or {}).get("options") or {})


def _keep(name: str, filters: list[str]) -> bool:
    """mkdocstrings-python's name filter: the last matching rule decides."""
    keep, rules = None, set()
    for f in filters:
        exclude = f.startswith("!")
        rules.add(exclude)
        if re.search(f.removeprefix("!"), name):
            keep = not exclude
    return rules != {False} if keep is None else keep


def _rendered(obj: griffe.Object | griffe.Alias, opts: dict[str, Any], root: bool) -> Iterator[tuple[str, Any]]:
    """(heading id, object) of ``obj`` and of every member mkdocstrings renders under it."""
    yield obj.path, obj
    if not (obj.is_module or obj.is_class):
        return
    inherited = opts.get("inherited_members", False)
    listed = isinstance(inherited, list)  # inherited members named in a list bypass the filters
    filters = opts.get("filters", DEFAULT_FILTERS)
    members_list = opts.get("members") if root else None
    for name, member in (obj.all_members if inherited else obj.members).items():
        try:
            if member.inherited and not (inherited is True or (listed and name in inherited)):
                continue
            if members_list is False or members_list == []:
                continue
            if isinstance(members_list, list) and name not in members_list:
                continue
            if members_list is None:
                bypass = listed and member.inherited
                if filters == "public" and not (member.is_public or bypass):
                    continue
                if filters != "public" and not (_keep(name, filters) or bypass):
                    continue
                if not opts.get("show_if_no_docstring", False) and not (member.has_docstrings or bypass):
                    continue
                if filters != "public" and member.is_imported and not member.is_public:
                    continue
            if member.is_module:
                continue  # submodules are not rendered (show_submodules is off)
            if obj.is_class and name == "__init__" and opts.get("merge_init_into_class", False):
                continue
            yield from _rendered(member, opts, root=False)
        except UNRESOLVABLE:
            continue


def _final(obj: Any) -> Any:
    return obj.final_target if obj.is_alias else obj


class Index:
    """The headings the site will have, and the way from a role to one of them."""

    def __init__(self, pkg: griffe.Module) -> None:
        self.pkg = pkg
        self.ids: set[str] = set()
        self.by_target: dict[str, str] = {}  # canonical path of a definition -> heading id
        base = _handler_options()
        for path, local in _entries():
            obj = self._lookup_path(path)
            if obj is None:
                continue
            for hid, member in _rendered(obj, {**base, **local}, root=True):
                self.ids.add(hid)
                with contextlib.suppress(*UNRESOLVABLE):
                    self.by_target.setdefault(_final(member).path, hid)
        # headings a generated page gives an identifier itself (docs/api/tensor.md: `### x.sum { #tapeflow.Tensor.sum }`)
        for page in sorted(DOCS.rglob("*.md")):
            self.ids.update(ANCHOR.findall(page.read_text()))

    def _lookup_path(self, path: str) -> Any:
        parts = path.split(".")
        if parts[0] != self.pkg.name:
            return None
        return self._walk(self.pkg, parts[1:])

    @staticmethod
    def _walk(obj: Any, parts: list[str]) -> Any:
        try:
            for part in parts:
                members = _final(obj).all_members if _final(obj).is_class else _final(obj).members
                obj = members[part]
        except (KeyError, *UNRESOLVABLE):
            return None
        return obj

    def heading(self, target: str, scope: griffe.Object) -> str | None:
        """The heading id that documents ``target`` as seen from ``scope``, or None."""
        parts = target.split(".")
        if parts[0] == "tfl":
            parts[0] = self.pkg.name
        if parts[0] == self.pkg.name:
            return self._id_of(self.pkg, parts[1:])
        scopes: list[Any] = []
        s: Any = scope
        while s is not None:
            scopes.append(s)
            s = s.parent
        scopes += [self._lookup_path(p) for p in FALLBACK_SCOPES]
        for s in scopes:
            if s is None:
                continue
            head = self._walk(s, parts[:1])
            if head is not None:
                return self._id_of(head, parts[1:])
        return None

    def _id_of(self, head: Any, rest: list[str]) -> str | None:
        obj = self._walk(head, rest)
        if obj is None:
            return None
        try:
            head_id = head.path if head.path in self.ids else self.by_target.get(_final(head).path)
            if head_id is not None and (hid := ".".join([head_id, *rest])) in self.ids:
                return hid  # through the public name written: Tensor.register_hook, not Param's
            return obj.path if obj.path in self.ids else self.by_target.get(_final(obj).path)
        except UNRESOLVABLE:
            return None


def convert_roles(text: str, resolve: Any) -> str:
    """Rewrite the roles of a docstring outside code fences; ``resolve(target)`` gives a heading id or None."""

    def one(m: re.Match[str]) -> str:
        content = m.group(2).strip()
        if "<" in content and content.endswith(">"):  # :func:`title <target>`
            title, target = content[:-1].split("<", 1)
            title, target = title.strip(), target.strip()
        else:
            target = content.lstrip("!")
            title = target.lstrip("~").rsplit(".", 1)[-1] if target.startswith("~") else target
        target = target.lstrip("~.")
        hid = None if content.startswith("!") else resolve(target)
        return f"[`{title}`][{hid}]" if hid else f"`{title}`"

    # a role wrapped over two lines of a docstring (:meth:`title\n    <target>`) is read as one line
    text = WRAPPED_ROLE.sub(lambda m: re.sub(r"\s*\n\s*", " ", m.group(0)), text)
    out, fenced = [], False
    for line in text.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
        out.append(line if fenced or line.lstrip().startswith(">>>") else ROLE.sub(one, line))
    return "\n".join(out)


def _objects(obj: griffe.Object) -> Iterator[griffe.Object]:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member)  # type: ignore[arg-type]


class CrossRefs(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        index = Index(pkg)
        for obj in _objects(pkg):
            doc = obj.docstring
            if doc is not None and ROLE.search(doc.value):
                doc.value = convert_roles(doc.value, lambda target, o=obj: index.heading(target, o))
                doc.__dict__.pop("parsed", None)  # re-parse the new text if it was parsed already


_PAGE_INDEX: list[Index] = []  # built on the first page that needs it


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """mkdocs hook: rewrite the roles of a Markdown page as the griffe extension does for docstrings."""
    if not ROLE.search(markdown):
        return markdown
    if not _PAGE_INDEX:
        _PAGE_INDEX.append(Index(griffe.load("tapeflow", search_paths=[str(ROOT)])))
    index = _PAGE_INDEX[0]
    return convert_roles(markdown, lambda target: index.heading(target, index.pkg))
