"""YAML loading with a source location for every node.

`load_located(text, path)` returns plain Python data (dicts, lists, scalars) plus an index
from each node's path (a tuple of keys and list positions) to its `Location`. Keys of
mappings are indexed under `path + ("<key>", name)` so that errors about a key (unknown,
duplicate) point at the key itself rather than at its value.

Duplicate keys are errors (PyYAML silently keeps the last one). Anchors and merge keys work
as in PyYAML; tags other than the core schema's are rejected by the safe loader.

Before anything is composed, `scan` walks the parser's events once and refuses nesting
deeper than MAX_DEPTH and documents of more than MAX_NODES nodes counted with every alias
expanded (Note [Spec limits]): PyYAML's composer recurses per nesting level, and `build`
below copies an aliased node at every use.
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from .diagnostics import Diagnostic, Location
from .limits import MAX_DEPTH, MAX_NODES

Path_ = tuple

# Tags of plain mappings and lists; any other tag on a collection (!!set, !!omap,
# !!python/...) is rejected. Scalars with a tag the safe loader cannot build fail there.
_PLAIN_TAGS = ("tag:yaml.org,2002:map", "tag:yaml.org,2002:seq")


@dataclass(frozen=True)
class Located:
    data: object
    locs: dict  # Path_ -> Location
    path: str

    def loc(self, path: Path_) -> Location:
        """Location of the node at `path`, or of its nearest located ancestor."""
        p = tuple(path)
        while p:
            if p in self.locs:
                return self.locs[p]
            p = p[:-1]
        return self.locs.get((), Location(self.path, 1, 1))

    def key_loc(self, path: Path_) -> Location:
        """Location of the key that introduces `path` (falls back to the value)."""
        p = tuple(path)
        if p and (p[:-1] + ("<key>", p[-1])) in self.locs:
            return self.locs[p[:-1] + ("<key>", p[-1])]
        return self.loc(p)


def _mark(path: str, node: yaml.Node | yaml.Event) -> Location:
    mark = node.start_mark
    return Location(path, mark.line + 1, mark.column + 1) if mark else Location(path)


def _yaml_error(e: yaml.YAMLError, path: str) -> Diagnostic:
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        loc = Location(path, mark.line + 1, mark.column + 1) if mark else Location(path)
        return Diagnostic(loc, f"invalid YAML: {e.problem or e}", "fix the YAML syntax")
    return Diagnostic(Location(path), f"invalid YAML: {e}", "fix the YAML syntax")


def scan(text: str, path: str) -> Diagnostic | None:
    """The first limit the document breaks (depth, nodes after alias expansion), or None.

    One pass over parser events: the parser keeps an explicit state stack (no recursion),
    and an anchor's size is recorded when its node ends, so an alias costs one addition
    whatever it expands to."""
    nodes = 0
    open_: list[tuple[int, str | None]] = []  # (node count when it opened, anchor)
    sizes: dict[str, int] = {}  # anchor -> nodes of its node, aliases expanded
    for ev in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(ev, yaml.AliasEvent):
            nodes += sizes.get(ev.anchor or "", 1)
        elif isinstance(ev, yaml.ScalarEvent):
            nodes += 1
            if ev.anchor:
                sizes[ev.anchor] = 1
        elif isinstance(ev, yaml.CollectionStartEvent):
            nodes += 1
            open_.append((nodes, ev.anchor))
            if len(open_) > MAX_DEPTH:
                return Diagnostic(_mark(path, ev), f"the spec nests more than {MAX_DEPTH} "
                                  "levels deep", "specs are a few levels of mappings and lists; "
                                  "flatten this structure")
        elif isinstance(ev, yaml.CollectionEndEvent):
            start, anchor = open_.pop()
            if anchor:
                sizes[anchor] = nodes - start + 1
        else:
            continue
        if nodes > MAX_NODES:
            what = "with its aliases expanded " if sizes else ""
            return Diagnostic(_mark(path, ev), f"the spec has more than {MAX_NODES} YAML nodes "
                              f"{what}(limit reached here)",
                              "a spec is a few hundred nodes; write a long list as a range "
                              "({from: a, to: b}) and do not nest aliases inside aliases")
    return None


def load_located(text: str, path: str) -> tuple[Located | None, list[Diagnostic]]:
    errors: list[Diagnostic] = []
    try:
        limit = scan(text, path)
        if limit is not None:
            return None, [limit]
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        return None, [_yaml_error(e, path)]
    if node is None:
        return None, [Diagnostic(Location(path, 1, 1), "the spec is empty",
                                 "a spec is a mapping with at least `family` and `params`")]
    constructor = yaml.SafeLoader("")
    locs: dict = {}

    def build(n: yaml.Node, p: tuple):
        locs[p] = _mark(path, n)
        if n.tag not in _PLAIN_TAGS and not isinstance(n, yaml.ScalarNode):
            errors.append(Diagnostic(_mark(path, n), f"YAML tag '{n.tag}' is not allowed here",
                                     "specs use plain mappings, lists and scalars"))
            return None
        if isinstance(n, yaml.MappingNode):
            # Merge keys (`<<: *anchor`): flatten_mapping puts the merged pairs first; a key
            # written explicitly overrides a merged one, as in YAML. Only two explicit
            # definitions of one key are a duplicate.
            explicit = sum(1 for k, _ in n.value if k.tag != "tag:yaml.org,2002:merge")
            constructor.flatten_mapping(n)
            merged = len(n.value) - explicit
            out: dict = {}
            written: set = set()
            for i, (k_node, v_node) in enumerate(n.value):
                try:
                    key = constructor.construct_object(k_node, deep=True)
                except ValueError as e:
                    errors.append(Diagnostic(_mark(path, k_node), f"cannot read key: {e}",
                                             "keys are plain names"))
                    continue
                if not isinstance(key, (str, int)):
                    errors.append(Diagnostic(_mark(path, k_node), f"mapping key {key!r} is not a name",
                                             "keys are plain names"))
                    continue
                if key in written and i >= merged:
                    errors.append(Diagnostic(
                        _mark(path, k_node), f"duplicate key '{key}'",
                        f"'{key}' is already defined at line {locs[p + ('<key>', key)].line}; "
                        "remove one of them"))
                    continue
                if i >= merged:
                    written.add(key)
                locs[p + ("<key>", key)] = _mark(path, k_node)
                out[key] = build(v_node, p + (key,))
            return out
        if isinstance(n, yaml.SequenceNode):
            return [build(v, p + (i,)) for i, v in enumerate(n.value)]
        try:
            return constructor.construct_object(n, deep=True)
        except ValueError as e:  # e.g. an integer of more digits than Python converts
            errors.append(Diagnostic(_mark(path, n), f"cannot read scalar: {e}",
                                     "write a plain name or a number of at most 20 digits"))
            return None

    try:
        data = build(node, ())
    except yaml.YAMLError as e:
        return None, [_yaml_error(e, path)]
    return Located(data, locs, path), errors
