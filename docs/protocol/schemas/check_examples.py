#!/usr/bin/env python3
"""Validates the JSON example frames of docs/protocol.md against the schemas in this folder.

Usage: python3 docs/protocol/schemas/check_examples.py [-v] [MARKDOWN ...]
(default MARKDOWN: docs/protocol.md of this repository). Needs `pip install jsonschema`
(4.18 or later, for the `referencing` registry). Exits 1 when a schema is malformed, an example
is invalid or cannot be classified, or a sanity case gives the wrong answer.

What counts as an example: every fenced ```json block, and every inline code span that starts
with `{` and ends with `}`. Spans that are shape sketches rather than JSON (`{id, data}`,
`{clientId?, data, …}`, `{version: 0, state: {}}`) are skipped and counted. Elisions inside real
examples are kept as markers and the errors located at them are forgiven (see `normalize`).

Which schema applies is decided by `targets_for` from the frame and the section it appears in
(sections 1-3 and 5, 7: conversation scope; section 4: channel scope; section 6 is REST and is
skipped), plus the small OVERRIDES table for fragments that are not frames.
"""
from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

try:
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource
except ImportError:  # pragma: no cover
    sys.exit("check_examples.py needs the jsonschema package (4.18+): pip install jsonschema")

HERE = Path(__file__).resolve().parent
REPO = next((p for p in HERE.parents if (p / "docs" / "protocol.md").exists()), HERE.parent)
BASE = "https://converger.dev/schemas/"
ELISION = "…"

CC, SC, CH, SH = ("client-conversation", "server-conversation", "client-channel", "server-channel")

# Fragments that are not frames, keyed by (section, example text without blanks).
OVERRIDES: dict[tuple[str, str], list[str]] = {
    ("4.5", '{"seqs":[…]}'): ["common#turnConflictDetails"],
    ("4.5", '{"revision":<latest>}'): ["common#turnSupersededDetails"],
    ("4.5", '{"version":<current>}'): ["common#staleRuntimeDetails"],
    ("4.5", '{"turn":{"seq":…,"revision":…}}'): ["common#noSuchTurnDetails"],
}

FORWARDED = {"resume", "abort", "genui_event", "client_tools", "client_skills", "survey"}
CLIENT_CONVERSATION_TYPES = {
    "hello", "sync", "ping", "read", "auth", "edit", "regenerate", "stop"} | FORWARDED
SERVER_TYPES = {"welcome", "ack", "error", "heartbeat", "replayTruncated", "deliveryStatus",
                "presence", "tokenRefreshed", "conversationUpdate", "run", "streamEnd", "cancel"}


# ------------------------------------------------------------------------------------ schemas

def load_registry() -> tuple[Registry, dict[str, dict]]:
    schemas = {}
    for path in sorted(HERE.glob("*.schema.json")):
        schema = json.loads(path.read_text(encoding="utf-8"))
        Draft202012Validator.check_schema(schema)
        expected = BASE + path.name
        if schema.get("$id") != expected:
            raise SystemExit(f"{path.name}: $id is {schema.get('$id')!r}, expected {expected!r}")
        schemas[path.stem.removesuffix(".schema")] = schema
    registry = Registry().with_resources(
        (schema["$id"], Resource.from_contents(schema)) for schema in schemas.values())
    return registry, schemas


def check_refs(registry: Registry, schemas: dict[str, dict]) -> list[str]:
    """Every $ref of every schema must resolve inside this folder."""
    problems = []

    def walk(node, resolver, where):
        if isinstance(node, dict):
            target = node.get("$ref")
            if isinstance(target, str):
                try:
                    resolver.lookup(target)
                except Exception as error:  # noqa: BLE001 - report any resolution failure
                    problems.append(f"{where}: $ref {target!r} does not resolve ({type(error).__name__})")
            for value in node.values():
                walk(value, resolver, where)
        elif isinstance(node, list):
            for value in node:
                walk(value, resolver, where)

    for name, schema in schemas.items():
        walk(schema, registry.resolver(base_uri=schema["$id"]), f"{name}.schema.json")
    return problems


def validator_for(target: str, registry: Registry) -> Draft202012Validator:
    name, _, definition = target.partition("#")
    uri = f"{BASE}{name}.schema.json"
    if definition:
        uri += f"#/$defs/{definition}"
    return Draft202012Validator({"$ref": uri}, registry=registry)


def check_error_table(schemas: dict[str, dict]) -> list[str]:
    """The errorCode/errorNumber enums and retry flags must match crates/protocol ErrorCode."""
    source = REPO / "crates/protocol/src/error_code.rs"
    if not source.exists():
        return []
    text = source.read_text(encoding="utf-8")
    names = dict(re.findall(r'ErrorCode::(\w+) => "([a-z_]+)"', text))
    numbers = {k: int(v) for k, v in re.findall(r"ErrorCode::(\w+) => (\d{4}),", text)}
    retry_block = text[text.index("pub fn retryable"):text.index("pub fn close_code")]
    retryable = set(re.findall(r"ErrorCode::(\w+)", retry_block))
    rust = {names[v]: (numbers[v], v in retryable) for v in names}
    defs = schemas["common"]["$defs"]
    problems = []
    if set(defs["errorCode"]["enum"]) != set(rust):
        problems.append(f"errorCode enum differs from error_code.rs: {sorted(set(defs['errorCode']['enum']) ^ set(rust))}")
    table = {}
    for rule in defs["errorData"]["allOf"]:
        code = rule["if"]["properties"]["code"]["const"]
        props = rule["then"].get("properties", {})
        if "number" in props:
            table[code] = (props["number"]["const"], props["retryable"]["const"])
    if table != rust:
        problems.append(f"number/retryable rules differ from error_code.rs for {sorted(k for k in rust if table.get(k) != rust[k])}")
    return problems


# ------------------------------------------------------------------------------------ extraction

@dataclass
class Example:
    source: str
    line: int
    section: str
    raw: str
    value: object = None
    elided: int = 0


HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")


def extract(path: Path) -> list[Example]:
    lines = path.read_text(encoding="utf-8").split("\n")
    examples: list[Example] = []
    section = ""
    prose: list[tuple[int, str, str]] = []  # (line number, section, text) outside fences
    i = 0
    while i < len(lines):
        line = lines[i]
        heading = HEADING.match(line)
        if heading:
            section = heading.group(1)
        fence = FENCE.match(line)
        if fence:
            indent, lang = fence.groups()
            body, start = [], i + 1
            i += 1
            while i < len(lines) and not FENCE.match(lines[i]):
                body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
                i += 1
            if lang == "json":
                examples.append(Example(path.name, start, section, "\n".join(body)))
            i += 1
            continue
        prose.append((i + 1, section, line))
        i += 1
    # Inline code spans, paired in order like Markdown does (a span may wrap lines).
    text = "\n".join(l for _, _, l in prose)
    line_of = [n for n, _, _ in prose]
    section_of = [s for _, s, _ in prose]
    for match in re.finditer(r"`([^`]+)`", text):
        span = match.group(1).strip()
        if span.startswith("{") and span.endswith("}"):
            row = text.count("\n", 0, match.start())
            examples.append(Example(path.name, line_of[row], section_of[row], span))
    return sorted(examples, key=lambda e: e.line)


# ------------------------------------------------------------------------------------ elisions

SKETCH_KEY = re.compile(r"[{,]\s*[A-Za-z_][\w.]*\??\s*[:,}]")


def outside_strings(text: str) -> str:
    """The text with string contents blanked, for pattern checks."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


def normalize(raw: str) -> str | None:
    """Turns an example with elisions into JSON, or None for a shape sketch.

    Elisions become markers containing `…`: a bare `…`, an unquoted placeholder (`<head>`,
    `<bool>`, `N`) or a string that is only a placeholder ("<conversationId>") becomes a string
    such as "…<head>"; `[…]` becomes ["…"]; `{…}` and a trailing
    `, …` inside an object become a member "…": "…". Strings written with `…` ("0193e0a4-…")
    are markers already. Errors located at a marker are forgiven by `forgivable`.
    """
    if SKETCH_KEY.search(outside_strings(raw)):
        return None
    out, i, n = [], 0, len(raw)
    while i < n:
        ch = raw[i]
        if ch == '"':
            j = i + 1
            while j < n and raw[j] != '"':
                j += 2 if raw[j] == "\\" else 1
            literal = raw[i:j + 1]
            if re.fullmatch(r'"<[^<>"]+>"', literal):
                literal = json.dumps(ELISION + literal[1:-1], ensure_ascii=False)  # "<conversationId>"
            out.append(literal)
            i = j + 1
        elif ch == ELISION:
            before = "".join(out).rstrip()
            after = raw[i + 1:].lstrip()
            if before.endswith(("{", ",")) and after.startswith("}"):
                out.append(f'"{ELISION}":"{ELISION}"')  # elided members of an object
            else:
                out.append(f'"{ELISION}"')  # an elided value or array item
            i += 1
        elif ch == "<":
            j = raw.find(">", i)
            if j < 0:
                return None
            out.append(json.dumps(ELISION + raw[i:j + 1], ensure_ascii=False))
            i = j + 1
        elif ch.isalpha() and not (out and out[-1][-1:].isdigit()):  # a word, not 1e5
            j = i
            while j < n and (raw[j].isalnum() or raw[j] in "_."):
                j += 1
            word = raw[i:j]
            out.append(word if word in ("true", "false", "null") else json.dumps(ELISION + word, ensure_ascii=False))
            i = j
        else:
            out.append(ch)
            i += 1
    try:
        json.loads("".join(out))
    except json.JSONDecodeError:
        return None
    return "".join(out)


def count_markers(value) -> int:
    if isinstance(value, str):
        return int(ELISION in value)
    if isinstance(value, list):
        return sum(count_markers(v) for v in value)
    if isinstance(value, dict):
        return sum(count_markers(k) + count_markers(v) for k, v in value.items())
    return 0


def forgivable(error) -> bool:
    """True when an error is only about an elided part of an example."""
    instance = error.instance
    if isinstance(instance, str) and ELISION in instance:
        return True  # a marker value, or a marker property name (propertyNames)
    if isinstance(instance, dict) and ELISION in instance and error.validator == "required":
        return True  # an object whose other members were elided
    if error.validator in ("oneOf", "anyOf") and error.context and "valid under each of" not in error.message:
        branches = defaultdict(list)
        for sub in error.context:
            branches[sub.relative_schema_path[0]].append(sub)
        return any(all(forgivable(sub) for sub in subs) for subs in branches.values())
    return False


def explain(error) -> list:
    """The leaf errors behind an error: for oneOf/anyOf, those of the closest branch (the one
    with the fewest unforgiven errors, preferring branches whose `type` const matched)."""
    if error.validator not in ("oneOf", "anyOf") or not error.context or "valid under each of" in error.message:
        return [error]
    branches = defaultdict(list)
    for sub in error.context:
        branches[sub.relative_schema_path[0]].append(sub)

    def distance(subs):
        unforgiven = [s for s in subs if not forgivable(s)]
        wrong_type = any(list(s.relative_path) == ["type"] and s.validator in ("const", "enum", "not")
                         for s in unforgiven)
        return (wrong_type, len(unforgiven))

    closest = min(branches.values(), key=distance)
    return [leaf for sub in closest if not forgivable(sub) for leaf in explain(sub)]


# ------------------------------------------------------------------------------------ classification

def targets_for(example: Example) -> list[str] | str:
    """Schemas an example must satisfy, or a string saying why it is skipped."""
    key = (example.section, re.sub(r"\s+", "", example.raw))
    if key in OVERRIDES:
        return OVERRIDES[key]
    major = example.section.split(".")[0]
    if major == "6":
        return "REST body, not a frame"
    obj = example.value
    channel = major == "4"
    if not isinstance(obj, dict):
        return []
    if "type" not in obj and {"reason", "retryAfterMs"} <= obj.keys():
        return ["common#closeReason"]
    if "conversationId" in obj and "frame" in obj:
        frame = obj["frame"]
        kind = frame.get("type") if isinstance(frame, dict) else None
        if kind is None:
            return [CH, SH]  # an envelope with its frame elided: the shape holds both ways
        if kind in ("turnResult", "sync") or ("seq" not in frame and kind not in SERVER_TYPES):
            return [CH]
        return [SH]
    kind = obj.get("type")
    if not isinstance(kind, str):
        return []
    if kind == "hello":
        return [CH if channel else CC]
    if kind == "welcome":
        data = obj.get("data") or {}
        return [SH if data.get("scope") == "channel" else SC]
    if kind in ("genui_components", "skills"):
        return [CH] if channel else [SC]  # agents publish them; end users receive them
    if kind == "heartbeat":
        return [SH if channel else SC]
    if kind in ("deliveryStatus", "presence") or (kind == "typing" and "sender" in obj):
        return [SC, f"{SH}#envelopedFrame"]  # end users and agents get the same shape
    if kind == "typing":
        return [SC]  # without sender: the shape relayed from agents to end users
    if kind in SERVER_TYPES:
        return [SC]  # bare run/error in section 4 are the relayed shapes end users get
    if kind == "streamChunk" and "from" in obj:
        return [SC]  # a stream chunk as end users receive it (4.9)
    if kind == "genui" and "done" in obj and not isinstance(obj.get("seq", 0.5), int):
        # mekik agents send it, mekik end users get it (a stream chunk's seq has a fraction)
        return [SC, f"{CH}#envelopedFrame"]
    if kind in CLIENT_CONVERSATION_TYPES:
        return [CC, f"{SH}#envelopedFrame"] if kind in FORWARDED and channel else [CC]
    if "seq" in obj:
        return [f"{SH}#envelopedFrame" if channel else SC]
    return [f"{CH}#envelopedFrame" if channel else CC]


# ------------------------------------------------------------------------------------ sanity cases

U = "0193e0a4-5b6c-7d8e-9f00-112233445566"
SANITY: list[tuple[str, object, bool]] = [
    (CC, {"type": "text", "clientId": "c-1", "data": {"text": "hi"}, "actions": [1]}, True),
    (CC, {"type": "text", "id": "m-1", "data": {"text": "x"}, "metadata": None}, True),
    (CC, {"type": "event", "data": {"name": "clicked"}}, True),
    (CC, {"type": "abort", "clientId": "stop-1", "data": {}}, True),
    (CC, {"type": "stop", "clientId": "stop-2", "seq": 7}, True),
    (CC, {"type": "stop", "seq": 0}, False),
    (CC, {"type": "text", "data": {"text": "x"}, "turnPolicy": "interrupt"}, True),
    (CC, {"type": "text", "data": {"text": "x"}, "turnPolicy": "supersede"}, False),
    (CC, {"type": "hello", "token": "t"}, True),
    (CC, {"type": "text", "data": {"text": 5}}, False),
    (CC, {"type": "text", "clientId": "c 3", "data": {"text": "x"}}, False),
    (CC, {"type": "ack", "clientId": "c", "seq": 1}, False),
    (CC, {"type": "welcome", "data": {}}, False),
    (CC, {"type": "sync", "watermark": "3"}, False),
    (CC, {"type": "typing", "isTyping": "yes"}, False),
    (CC, {"type": "edit", "seq": 0, "data": {}}, False),
    (CC, {"type": "whatever"}, False),
    (SC, {"type": "error", "data": {"code": "too_many_in_flight", "message": "m", "number": 3002,
                                    "retryable": True, "retryAfterMs": 100, "clientId": "c-9", "frameType": "text"}}, True),
    (SC, {"type": "error", "data": {"code": "too_many_in_flight", "message": "m", "number": 3001, "retryable": True}}, False),
    (SC, {"type": "error", "data": {"code": "busy", "message": "one moment"}}, True),
    (SC, {"type": "error", "data": {"code": "no_such_code"}}, False),
    (SC, {"type": "ack", "clientId": "g-1", "turn": {"seq": 18, "revision": 2}, "duplicate": True}, True),
    (SC, {"type": "ack", "clientId": "g-1"}, False),
    (SC, {"type": "text", "id": U, "seq": 3, "from": "user", "sender": {"id": "alice", "role": "user"},
          "data": {"text": "hi"}, "timestamp": 1767222000123, "clientId": "c-1", "replaces": 2}, True),
    (SC, {"type": "text", "id": U, "seq": 0, "from": "user", "sender": {"id": "alice", "role": "user"},
          "data": {"text": "hi"}, "timestamp": 1767222000123}, False),
    (SC, {"type": "run", "data": {"status": "thinking"}}, True),
    (SC, {"type": "heartbeat", "timestamp": 1}, False),
    (CH, {"conversationId": U, "frame": {"type": "turnResult", "turn": {"seq": 1}, "frames": []}}, True),
    (CH, {"conversationId": U, "frame": {"type": "turnResult", "turn": {"seq": 0}, "frames": []}}, False),
    (CH, {"conversationId": U, "frame": {"type": "text", "clientId": "p-1", "data": {"text": "x"}}}, True),
    (CH, {"conversationId": U, "frame": {"type": "ack", "data": {}}}, False),
    (CH, {"conversationId": "not-a-uuid", "frame": {"type": "sync", "watermark": 0}}, False),
    (CH, {"type": "hello", "protocol": "converger/1", "token": "t", "group": "no spaces"}, False),
    (CH, {"type": "hello", "protocol": "converger/1", "token": "t", "group": None, "watermarks": {U: 0}}, True),
    (CH, {"type": "text", "data": {"text": "bare"}}, False),
    (SH, {"type": "heartbeat", "timestamp": 1}, True),
    (SH, {"type": "error", "data": {"code": "busy"}}, False),
    (SH, {"conversationId": U, "frame": {"type": "ack", "turn": {"seq": 18, "revision": 0}, "ids": [],
                                         "seqs": [], "timestamp": 1}}, True),
    (SH, {"conversationId": U, "frame": {"type": "error", "data": {
        "code": "turn_conflict", "message": "m", "number": 4100, "retryable": False, "frameType": "turnResult"}}}, False),
    (SH, {"conversationId": U, "frame": {"type": "typing", "isTyping": True}}, False),
    # Shapes built by the gateway that the examples of docs/protocol.md do not show.
    (SC, {"type": "welcome", "data": {
        "protocol": "mekik/1", "compat": ["mekik/1"], "scope": "conversation", "conversationId": U,
        "userId": "anon-0123456789abcdef0123456789abcdef", "connectionId": U, "watermark": 0, "pending": [],
        "expiresAt": 1767225600000, "capabilities": dict.fromkeys(
            ["acks", "typing", "receipts", "presence", "edit", "regenerate"], True),
        "limits": {"maxFrameBytes": 65536, "maxTextBytes": 16384, "maxMetadataBytes": 4096, "maxInFlight": 32,
                   "heartbeatIntervalMs": 25000, "idleTimeoutMs": 60000, "replayBatch": 200, "replayMax": 1000}}}, True),
    (SH, {"type": "welcome", "data": {
        "protocol": "converger/1", "scope": "channel", "channelId": U, "connectionId": U, "since": 1,
        "expiresAt": 2, "capabilities": dict.fromkeys(["acks", "typing", "groups", "turnResults"], True),
        "limits": {"maxFrameBytes": 65536, "maxTextBytes": 16384, "maxMetadataBytes": 4096, "maxInFlight": 32,
                   "heartbeatIntervalMs": 25000, "idleTimeoutMs": 60000, "replayBatch": 200, "replayMax": 1000,
                   "maxConversations": 10000}}}, True),
    (SH, {"conversationId": U, "frame": {
        "type": "text", "id": U, "seq": 24, "from": "user", "sender": {"id": "alice", "role": "user"},
        "data": {"text": "what is 3+3"}, "timestamp": 5, "replaces": 18,
        "meta": {"channel": {"id": U}, "participant": {"id": "alice", "role": "user"},
                 "turn": {"seq": 18, "revision": 1, "key": f"{U}:18:1", "reason": "edit"},
                 "runtime": {"version": 0, "state": {}}}}}, True),
    (SH, {"conversationId": U, "frame": {
        "type": "text", "id": U, "seq": 18, "from": "user", "sender": {"id": "alice", "role": "user"},
        "data": {"text": "hi"}, "timestamp": 5,
        "meta": {"channel": {"id": U}, "participant": {"id": "alice", "role": "user"},
                 "turn": {"seq": 18, "revision": 0, "key": f"{U}:18:0", "reason": "edit"},
                 "runtime": {"version": 0, "state": {}}}}}, False),
    (SC, {"type": "error", "data": {"code": "unauthorized", "message": "m", "number": 2000, "retryable": False,
                                    "details": {"reason": "token_expired"}}}, True),
    (SC, {"type": "error", "data": {"code": "bot_unavailable", "message": "m", "number": 5004, "retryable": True,
                                    "clientId": "f-1", "frameType": "survey"}}, True),
    (SH, {"type": "error", "data": {"code": "conversation_not_found", "message": "m", "number": 4001,
                                    "retryable": False}}, True),
    (SH, {"conversationId": U, "frame": {"type": "error", "data": {
        "code": "bad_request", "message": "no such turn", "number": 1000, "retryable": False, "clientId": "r-1",
        "frameType": "turnResult", "details": {"turn": {"seq": 99, "revision": 0}}}}}, True),
    (SC, {"type": "genui_components", "hash": "h1", "unchanged": True}, True),
    (CH, {"type": "genui_components", "hash": "h1", "components": ["card"]}, True),
    (CH, {"type": "genui_components", "hash": "h1"}, False),
]


# ------------------------------------------------------------------------------------ main

def main(argv: list[str]) -> int:
    verbose = "-v" in argv
    paths = [Path(a) for a in argv if a != "-v"] or [REPO / "docs/protocol.md"]
    registry, schemas = load_registry()
    failures = check_refs(registry, schemas) + check_error_table(schemas)
    if failures:
        for failure in failures:
            print("FAIL", failure, file=sys.stderr)
        return 1
    validators: dict[str, Draft202012Validator] = {}

    def validator(target: str) -> Draft202012Validator:
        if target not in validators:
            validators[target] = validator_for(target, registry)
        return validators[target]

    for target, instance, valid in SANITY:
        if validator(target).is_valid(instance) != valid:
            failures.append(f"sanity: {target} should {'accept' if valid else 'reject'} {json.dumps(instance)}")

    validated = fragments = checks = 0
    skipped: dict[str, int] = defaultdict(int)
    for path in paths:
        for example in extract(path):
            where = f"{example.source}:{example.line} (section {example.section or '-'})"
            normalized = normalize(example.raw)
            if normalized is None:
                skipped["shape sketch, not JSON"] += 1
                if verbose:
                    print(f"skip  {where}: sketch {example.raw[:70]}")
                continue
            example.value = json.loads(normalized)
            example.elided = count_markers(example.value)
            targets = targets_for(example)
            if isinstance(targets, str):
                skipped[targets] += 1
                if verbose:
                    print(f"skip  {where}: {targets}")
                continue
            if not targets:
                failures.append(f"{where}: cannot tell which schema applies: {example.raw[:120]}")
                continue
            bad = []
            for target in targets:
                checks += 1
                errors = [e for e in validator(target).iter_errors(example.value) if not forgivable(e)]
                for error in errors:
                    for leaf in explain(error):
                        location = "/" + "/".join(str(p) for p in leaf.absolute_path)
                        bad.append(f"{target} at {location}: {leaf.message[:200]}")
            if bad:
                failures.append(f"{where}: {example.raw[:120]}\n    " + "\n    ".join(bad))
            elif all(target.startswith("common#") for target in targets):
                fragments += 1
                if verbose:
                    print(f"ok    {where} -> {', '.join(targets)}")
            else:
                validated += 1
                if verbose:
                    print(f"ok    {where} -> {', '.join(targets)}"
                          + (f" ({example.elided} elided)" if example.elided else ""))

    print(f"{', '.join(p.name for p in paths)}: {validated} example frames valid, "
          f"{fragments} fragments valid (close reasons, error details), {checks} schema checks; "
          f"{len(SANITY)} sanity cases")
    for reason, count in sorted(skipped.items()):
        print(f"  skipped {count}: {reason}")
    if validated == 0:
        failures.append("no examples found")
    for failure in failures:
        print("FAIL", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
