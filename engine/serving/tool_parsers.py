"""Tool calls in a model's text, found as the text streams in: vLLM's `hermes` and `llama3_json` formats for
`tool_choice: auto` (`--tool-call-parser`), and the grammar-made forms of `required` (a JSON array of
{"name", "parameters"} objects) and of a named function (the arguments object alone).

A parser is fed the choice's text deltas and says what each adds: content text, and per call its id and name
(once the name is whole), then the raw text of its arguments as it grows, so a stream sends OpenAI's tool-call
deltas and the concatenated fragments are the arguments a non-streamed answer carries. A non-streamed answer
feeds the whole text at once. Each character is looked at once: the cost is linear in the output.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's marker before a tool call
ARGUMENT_KEYS = ("arguments", "parameters")


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ObjectScan:
    """One JSON object's text, fed in pieces: the raw text of each top-level value so far, and which are whole.
    `feed` stops at the object's closing brace and returns how much of the piece the object took."""

    def __init__(self) -> None:
        self.text = ""  # everything the object took, for the final json.loads
        self.values: dict[str, str] = {}
        self.whole: set[str] = set()
        self.done = False
        self._state = "open"  # open (before "{"), key, colon, value, after (a value ended, before "," or "}")
        self._key = ""
        self._depth = 0  # open brackets inside the current value
        self._in_string = self._escaped = False

    def feed(self, piece: str) -> int:
        for at, ch in enumerate(piece):
            if self.done:
                return at
            self.text += ch
            self._step(ch)
        return len(piece)

    def _step(self, ch: str) -> None:
        if self._state == "value":
            self._value_char(ch)
        elif self._in_string:  # a key
            if self._string_ends(ch):
                self._state = "colon"
            else:
                self._key += ch
        elif ch == "{" and self._state == "open":
            self._state = "key"
        elif ch == '"' and self._state == "key":
            self._in_string, self._key = True, ""
        elif ch == ":" and self._state == "colon":
            self._key = _decoded(f'"{self._key}"')
            self._state, self.values[self._key] = "value", ""
        elif ch == "," and self._state == "after":
            self._state = "key"
        elif ch == "}" and self._state in ("key", "after"):
            self.done = True

    def _value_char(self, ch: str) -> None:
        raw = self.values[self._key]
        if not raw and ch.isspace():
            return
        if self._in_string:
            self._string_ends(ch)
        elif ch == '"':
            self._in_string = True
        elif ch in "[{":
            self._depth += 1
        elif ch in "]}":
            if self._depth == 0:  # the object's own "}" ends a number, true, false or null
                self._end_value(raw.rstrip())
                self.done = True
                return
            self._depth -= 1
        elif ch == "," and self._depth == 0:
            self._end_value(raw.rstrip())
            self._state = "key"
            return
        raw += ch
        self.values[self._key] = raw
        if self._depth == 0 and not self._in_string and raw[0] in '"[{':
            self._end_value(raw)

    def _string_ends(self, ch: str) -> bool:
        """Inside a string: whether `ch` closes it (a quote no backslash escapes)."""
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            self._in_string = False
            return True
        return False

    def _end_value(self, raw: str) -> None:
        self.values[self._key] = raw
        self.whole.add(self._key)
        self._state = "after"

    def name(self) -> str | None:
        """The call's function name, once it is whole."""
        if "name" not in self.whole:
            return None
        try:
            name = json.loads(self.values["name"])
        except ValueError:
            return None
        return name if isinstance(name, str) else None

    def arguments(self) -> tuple[str, bool]:
        """The arguments' raw text so far, and whether it is whole."""
        key = next((k for k in ARGUMENT_KEYS if k in self.values), None)
        return ("", False) if key is None else (self.values[key], key in self.whole)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class CallDelta:
    """What one chunk says of one call: the first carries its id and name, the rest argument fragments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_dict(self) -> dict:
        function = {"arguments": self.arguments} if self.name is None else {"name": self.name, "arguments": ""}
        head = {"id": self.id, "type": "function"} if self.id is not None else {}
        return {"index": self.index, **head, "function": function}


@dataclass
class _Call:
    scan: ObjectScan
    name: str | None = None  # a named call's, known before any text
    id: str = field(default_factory=call_id)
    announced: bool = False
    sent: int = 0  # characters of the arguments sent
    closed: bool = False  # hermes: its </tool_call> seen

    def deltas(self, index: int) -> list[CallDelta]:
        name = self.name or self.scan.name()
        if name is None:
            return []
        out = []
        if not self.announced:
            self.announced = True
            out.append(CallDelta(index, "", self.id, name))
        raw, whole = self.scan.arguments()
        if raw.startswith('"'):  # arguments written as a JSON string: only whole, decoded
            raw = _decoded(raw) if whole else ""
        if len(raw) > self.sent:
            out.append(CallDelta(index, raw[self.sent :]))
            self.sent = len(raw)
        return out

    def result(self) -> ToolCall | None:
        """The whole call, or None where its JSON does not parse or has no name."""
        raw, whole = self.scan.arguments()
        name = self.name or self.scan.name()
        if name is None or not whole:
            return None
        arguments = _decoded(raw) if raw.startswith('"') else raw
        try:
            json.loads(arguments)
        except ValueError:
            return None
        return ToolCall(self.id, name, arguments)


def _decoded(raw: str) -> str:
    """A JSON string's value (the raw text where it is not one)."""
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return value if isinstance(value, str) else raw


class ToolParser:
    """What every format shares: the content, the calls, and the deltas since the last `feed`. Whitespace at the
    end of the content is held back until more content follows: where a call follows instead it is dropped, so
    no chunk carries only the newline before a tag."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.content = ""
        self._pending = ""  # text held back: it may be the start of a tag
        self._space = ""  # content's trailing whitespace, held back
        self._new_content = ""

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """The content and call deltas `text` adds."""
        self._split(text)
        content, self._new_content = self._new_content, ""
        return content, [d for i, call in enumerate(self.calls) for d in call.deltas(i)]

    def finish(self) -> tuple[str, list[CallDelta]]:
        """The text ended: what was held back is content (whitespace only where no call came)."""
        self._close()
        pending, self._pending = self._pending, ""
        self._emit(pending)
        if not self.calls:
            self.content += self._space
            self._new_content += self._space
        self._space = ""
        return self.feed("")

    def result(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole text's content (None when empty) and calls. A call that does not parse makes the whole text
        content, as vLLM's parsers answer."""
        self.feed(text)
        self.finish()
        calls = [call.result() for call in self.calls]
        if not calls or any(c is None for c in calls):
            return text or None, []
        return self.content or None, [c for c in calls if c is not None]

    def _emit(self, content: str) -> None:
        text = self._space + content
        body = text.rstrip()
        self._space = text[len(body) :]
        self.content += body
        self._new_content += body

    def _start_call(self, call: _Call) -> None:
        self._space = ""
        self.calls.append(call)

    def _close(self) -> None:
        """The text ended (a named call's arguments are whole only then)."""

    def _split(self, text: str) -> None:
        raise NotImplementedError


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; the text around them is content."""

    def _split(self, text: str) -> None:
        text, self._pending = self._pending + text, ""
        while text:
            last = self.calls[-1] if self.calls else None
            if last is not None and not last.scan.done:
                text = text[last.scan.feed(text) :]
            elif last is not None and not last.closed:
                at = text.find(HERMES_CLOSE)
                if at < 0:
                    self._pending = text[len(text) - _partial_suffix(text, HERMES_CLOSE) :]
                    return
                last.closed = True
                text = text[at + len(HERMES_CLOSE) :]
            else:
                text = self._content_until_tag(text)

    def _content_until_tag(self, text: str) -> str:
        at = text.find(HERMES_OPEN)
        if at >= 0:
            self._emit(text[:at])
            self._start_call(_Call(ObjectScan()))
            return text[at + len(HERMES_OPEN) :]
        keep = _partial_suffix(text, HERMES_OPEN)
        self._emit(text[: len(text) - keep])
        self._pending = text[len(text) - keep :]
        return ""


class Llama3JsonParser(ToolParser):
    """Llama 3.1's JSON tool calls: an optional <|python_tag|>, then objects {"name": ..., "parameters": {...}}
    separated by ";". A text that does not start so is content."""

    def __init__(self) -> None:
        super().__init__()
        self._mode: str | None = None  # None: undecided; "calls" or "content"

    def _split(self, text: str) -> None:
        text, self._pending = self._pending + text, ""
        if self._mode is None:
            start = text.lstrip()
            if not start or (PYTHON_TAG.startswith(start) and start != PYTHON_TAG):
                self._pending = text
                return
            self._mode = "calls" if start.startswith(("{", PYTHON_TAG)) else "content"
            text = start.removeprefix(PYTHON_TAG) if self._mode == "calls" else text
        if self._mode == "content":
            self._emit(text)
            return
        while text:
            if self.calls and not self.calls[-1].scan.done:
                text = text[self.calls[-1].scan.feed(text) :]
            else:
                text = text.lstrip().lstrip(";").lstrip()
                if text:
                    self._start_call(_Call(ObjectScan()))


class RequiredParser(ToolParser):
    """`tool_choice: required`: the grammar's JSON array of {"name", "parameters"} objects."""

    def _split(self, text: str) -> None:
        while text:
            if self.calls and not self.calls[-1].scan.done:
                text = text[self.calls[-1].scan.feed(text) :]
                continue
            at = text.find("{")
            if at < 0:
                return
            self._start_call(_Call(ObjectScan()))
            text = text[at:]


class NamedParser(ToolParser):
    """A named function: the grammar's text is the arguments object itself, whole when the text ends."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._scan = ObjectScan()
        self._scan.values["arguments"] = ""
        self.calls.append(_Call(self._scan, name))

    def _split(self, text: str) -> None:
        self._scan.values["arguments"] += text

    def _close(self) -> None:
        self._scan.values["arguments"] = self._scan.values["arguments"].strip()
        self._scan.whole.add("arguments")


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag` (held back: it may be the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# --tool-call-parser's choices (engine/config.py TOOL_CALL_PARSERS) -> the parser
AUTO_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def auto_parser(name: str) -> ToolParser:
    return AUTO_PARSERS[name]()
