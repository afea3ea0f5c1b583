"""JSON Schema documents generated from the payload structs, and the drift check over them.

The structs in :mod:`schemas.events` are the contract; the files under ``schemas/json/`` are its
language-neutral rendering for consumers that are not Python (dashboards, audit tooling, other
teams' consumers). They are generated, committed, and checked: ``check`` fails when a struct
changed and the files were not regenerated, so a contract change always shows up in review as a
diff of the JSON files too.

One document per ``(TYPE, VERSION)``, named ``<TYPE>.v<VERSION>.json``, plus
``envelope.v<ENVELOPE_VERSION>.json``. Documents describe the JSON form of an event, which is
what ``msgspec.to_builtins`` gives for a decoded MessagePack record (``bytes`` become base64
strings, enums their values).

Rendering is pure and deterministic (sorted keys, 2-space indent, trailing newline) so that the
same structs give byte-identical files on every machine; only :func:`write_all` and
:func:`check` touch the file system.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from schemas.envelope import ENVELOPE_VERSION, Envelope
from schemas.events import ALL_EVENT_TYPES, Event

#: Dialect of every document (msgspec emits 2020-12 style ``$defs``/``$ref``).
DIALECT = "https://json-schema.org/draft/2020-12/schema"
#: Where the committed documents live.
DEFAULT_DIR = Path(__file__).resolve().parent / "json"
ENVELOPE_FILE = f"envelope.v{ENVELOPE_VERSION}.json"

Doc = dict[str, Any]


def schema_id(type_name: str, version: int) -> str:
    """``$id`` of a payload document. Built from the wire name, never the Python class name."""
    return f"switchyard/{type_name}/v{version}"


def schema_filename(type_name: str, version: int) -> str:
    return f"{type_name}.v{version}.json"


def _hoist(schema: Doc) -> tuple[Doc, Doc]:
    """Split msgspec's ``{"$defs": {...}, "$ref": "#/$defs/Root"}`` into (root, other defs).

    The root's ``$defs`` key is the Python class name (``WorkerLoadReportedV1``); inlining the
    root keeps that name out of the document's structure, so a class rename only touches the
    nested helper definitions, never where a reader finds the payload's fields.
    """
    defs = dict(schema.get("$defs", {}))
    ref = schema["$ref"]
    name = ref.removeprefix("#/$defs/")
    root = dict(defs.pop(name))
    if ref in json.dumps(defs):
        # Events are flat facts; a self-referencing payload would need the def kept in place.
        raise ValueError(f"{name} refers to itself; cannot inline its schema")
    return root, defs


def event_schema(cls: type[Event], latest_version: int | None = None) -> Doc:
    """The JSON Schema document of one payload type at one version.

    ``latest_version`` is the newest registered version of ``cls.TYPE``; when it is newer than
    ``cls.VERSION`` the document is marked deprecated, so readers of the schema files see what
    the codec does (it upcasts the old version on read).

    Struct objects stay open (no ``additionalProperties: false``): fields are added with
    defaults within a version, and readers of that version must accept and ignore them.

    A type's ``KEY_FIELD`` is not a property: it is the envelope's ``key``, which the document
    names in ``x-switchyard-key-field`` (decoded events carry it, the payload's bytes do not).
    """
    root, defs = _hoist(msgspec.json.schema(cls))
    if cls.KEY_FIELD is not None:  # not in the payload's bytes: the envelope's key says it
        root["properties"] = {k: v for k, v in root["properties"].items() if k != cls.KEY_FIELD}
        if cls.KEY_FIELD in root.get("required", ()):
            root["required"] = [k for k in root["required"] if k != cls.KEY_FIELD]
    doc: Doc = {
        "$schema": DIALECT,
        "$id": schema_id(cls.TYPE, cls.VERSION),
        **root,
        "title": cls.TYPE,
        "x-switchyard-kind": "event",
        "x-switchyard-type": cls.TYPE,
        "x-switchyard-version": cls.VERSION,
        "x-switchyard-stream": cls.STREAM,
    }
    if cls.KEY_FIELD is not None:
        doc["x-switchyard-key-field"] = cls.KEY_FIELD
    if defs:
        doc["$defs"] = defs
    if latest_version is not None and latest_version > cls.VERSION:
        doc["deprecated"] = True
        doc["x-switchyard-superseded-by"] = latest_version
    return doc


def envelope_schema() -> Doc:
    """The envelope document: every field but ``data``, which is an open object here.

    The payload's shape depends on ``type`` and ``v``; it is validated separately against the
    per-type document that ``x-switchyard-payload-schema`` names, rather than through a
    20-way ``if``/``then`` here, so adding an event type never changes the envelope document.
    """
    root, _ = _hoist(msgspec.json.schema(Envelope[Event]))
    properties = dict(root["properties"])
    properties["data"] = {
        "type": "object",
        "description": (
            "The payload. Its schema is the per-type document for this envelope's `type` and "
            "`v`: file `<type>.v<v>.json`, $id `switchyard/<type>/v<v>`."
        ),
        "x-switchyard-payload-schema": "switchyard/{type}/v{v}",
    }
    return {
        "$schema": DIALECT,
        "$id": f"switchyard/envelope/v{ENVELOPE_VERSION}",
        **root,
        "title": "Envelope",
        "properties": properties,
        "x-switchyard-kind": "envelope",
        "x-switchyard-version": ENVELOPE_VERSION,
    }


def render(doc: Doc) -> str:
    """Deterministic text of one document: sorted keys, 2-space indent, trailing newline."""
    return json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def render_all(types: tuple[type[Event], ...] = ALL_EVENT_TYPES) -> dict[str, str]:
    """Every document, as ``{file name relative to the schema dir: text}``."""
    latest: dict[str, int] = {}
    for cls in types:
        latest[cls.TYPE] = max(latest.get(cls.TYPE, 0), cls.VERSION)
    out = {ENVELOPE_FILE: render(envelope_schema())}
    for cls in types:
        name = schema_filename(cls.TYPE, cls.VERSION)
        if name in out:
            raise ValueError(f"duplicate registration of {cls.TYPE} v{cls.VERSION}")
        out[name] = render(event_schema(cls, latest[cls.TYPE]))
    return dict(sorted(out.items()))


def write_all(
    directory: Path = DEFAULT_DIR, types: tuple[type[Event], ...] = ALL_EVENT_TYPES
) -> list[str]:
    """Write every document into ``directory``; return the names of files created or changed.

    Files that no longer correspond to a registered type are left in place (``check`` reports
    them): a schema disappearing is a contract change a human should make on purpose.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    changed = []
    for name, text in render_all(types).items():
        path = directory / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8", newline="\n")
            changed.append(name)
    return changed


def check(
    directory: Path = DEFAULT_DIR, types: tuple[type[Event], ...] = ALL_EVENT_TYPES
) -> list[str]:
    """Drift between the structs and the files in ``directory``; empty when they agree.

    Each problem is one line naming the file: missing (a struct has no file), extra (a ``.json``
    file no struct renders), or differing (the struct changed without regenerating).
    """
    directory = Path(directory)
    expected = render_all(types)
    present = {p.name for p in directory.glob("*.json")} if directory.is_dir() else set()
    problems = []
    for name, text in expected.items():
        path = directory / name
        if name not in present:
            problems.append(f"missing: {path} (run the schema generator)")
        elif path.read_text(encoding="utf-8") != text:
            problems.append(f"differs: {path} does not match its struct (regenerate it)")
    for name in sorted(present - expected.keys()):
        problems.append(f"extra: {directory / name} matches no registered event type")
    return problems


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--check"]:
        found = check()
        print("\n".join(found) or "schemas/json is up to date")
        raise SystemExit(1 if found else 0)
    for written in write_all():
        print(f"wrote {DEFAULT_DIR / written}")
