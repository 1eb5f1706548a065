"""The OpenAI surfaces (chat completions, completions, embeddings) with no I/O.

These surfaces translate nothing: a request goes upstream as the client wrote it, checked and
pointed at the model's upstream name, and the answer comes back byte for byte but for the
model's name, which becomes the client's again. Checking is light on purpose: the upstream
names its own mistakes better, and vLLM's extras (`chat_template_kwargs`, `guided_json`,
`top_k`) must pass untouched.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from homelab_gateway.config import ModelConfig
from homelab_gateway.core.errors import GatewayError
from homelab_gateway.core.fields import (
    OUTPUT_LIMITS,
    InvalidRequest,
    cap_output,
    check_one_choice,
    is_int,
    kind_of,
)
from homelab_gateway.core.instructions import first_only
from homelab_gateway.core.jsonscan import TopLevelObject
from homelab_gateway.core.mapping import (
    CHARS_PER_TOKEN,
    MappedRequest,
    PackedRequest,
    merge,
    request_model,
)
from homelab_gateway.core.sse import EventTooLarge, SSEParser
from homelab_gateway.core.text import replace_lone_surrogates

PATHS = {"chat": "/chat/completions", "completions": "/completions", "embeddings": "/embeddings"}
"""Each surface's upstream path, below the upstream's base URL (which ends in /v1)."""
PROMPTS = {"chat": "messages", "completions": "prompt", "embeddings": "input"}
"""The field that holds each surface's prompt: required, and what the wait is estimated on."""
DONE = b"data: [DONE]\n\n"
MODEL_HEAD = 1024 * 1024
"""Bytes of a whole answer held back at most while its top-level `model` is looked for. vLLM
and Ollama write it first, so their answers pass on at once; llama.cpp writes it after the
choices. A body that has none by then passes on as it is."""
DATA_EVENT = re.compile(rb"data: ([^\r\n]*)\n\n")
"""One whole event as vLLM, llama.cpp and Ollama write every chunk: one `data:` line."""
_LAYOUTS = {
    b'"model":': (
        b'"error"',
        b'"choices":[]',
        b'"finish_reason":"',
        b'"usage"',
        b'"role":',
        b'"content":""',
        b'"delta":{}',
        b"[DONE]",
    ),
    b'"model": ': (
        b'"error"',
        b'"choices": []',
        b'"finish_reason": "',
        b'"usage"',
        b'"role": ',
        b'"content": ""',
        b'"delta": {}',
        b"[DONE]",
    ),
}
"""For a server's way of writing keys (compact, as vLLM's pydantic and llama.cpp write them, or
Python's `": "`), the bytes of every chunk that must be parsed: an error, usage, a choice's
last chunk, `[DONE]`, and the chunks that say nothing (a role, an empty delta), which are not
counted as output. A read with none of them is token chunks only, each trusted as the upstream
wrote it once it starts as the last parsed one did and ends its object. (Quotes inside a JSON
string are escaped, so these bytes are never text.)"""
_MODEL_KEY = re.compile(rb'"model"\s*:\s*("(?:[^"\\]|\\.)*")?')


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """A checked request as it waits: the upstream body packed, and what the answer needs."""

    kind: str  # chat | completions | embeddings
    packed: PackedRequest
    include_usage: bool  # the client asked for the usage chunk
    session: str | None  # `prompt_cache_key` or `user`, as the client wrote it


def map_openai(kind: str, body: Any, model: ModelConfig) -> OpenAIRequest:
    """Check `body` for surface `kind` and build the upstream request for `model`; raise
    InvalidRequest naming the field. The model's `params` go under the client's own fields,
    and its `max_tokens` caps the output (`cap_output`); one choice per request (`n`). With
    `system_messages = "first"`, a chat's later system messages are folded (`first_only`) for
    the model's template, which refuses them in place."""
    client_model = request_model(body)
    prompt_field = _prompt_field(kind, body)
    prompt = body.get(prompt_field)
    _check_prompt(kind, prompt_field, prompt)
    out = merge(model.params, body)
    out["model"] = model.upstream_model
    if kind == "chat" and model.system_messages == "first":
        _check_contents(prompt)
        out["messages"] = first_only(prompt)
    # vLLM's scheduler order is the gateway's to give (`forward_priority`), not a client's.
    out.pop("priority", None)
    least = 0 if kind == "completions" else 1  # 0 with `echo`: vLLM scores the prompt alone
    for name in OUTPUT_LIMITS:
        value = body.get(name)
        if value is not None and (not is_int(value) or value < least):
            raise InvalidRequest(
                f"{name}: must be an integer >= {least}, got {kind_of(value)}", name
            )
    if kind != "embeddings":
        cap_output(out, model.max_tokens, absent_is_unbounded=kind == "chat")
        check_one_choice(out)
    stream = body.get("stream") or False  # null is vLLM's default, as absent
    if kind == "embeddings":
        stream = False
    elif not isinstance(stream, bool):
        raise InvalidRequest(f"stream: must be a boolean, got {kind_of(stream)}", "stream")
    include_usage = False
    if stream:
        options = body.get("stream_options")
        if options is not None and not isinstance(options, Mapping):
            raise InvalidRequest(
                f"stream_options: must be an object, got {kind_of(options)}", "stream_options"
            )
        include_usage = bool(options and options.get("include_usage"))
        # Asked for always, for the gateway's own counts; a client that did not ask never
        # sees the usage chunk (`StreamRelay`), nor usage in every chunk, which vLLM sends only
        # with the usage chunk.
        options = dict(options or {})
        if not include_usage:
            options.pop("continuous_usage_stats", None)
        out["stream_options"] = {**options, "include_usage": True}
    session = next(
        (
            value
            for value in (body.get("prompt_cache_key"), body.get("user"))
            if isinstance(value, str) and value
        ),
        None,
    )
    estimate = max(1, len(json.dumps(prompt, ensure_ascii=False)) // CHARS_PER_TOKEN)
    if kind == "chat" and "tools" in body:
        estimate += len(json.dumps(body["tools"], ensure_ascii=False)) // CHARS_PER_TOKEN
    mapped = MappedRequest(
        model=replace_lone_surrogates(client_model),
        stream=stream,
        body=out,
        stop_sequences=(),
        estimated_input_tokens=estimate,
    )
    return OpenAIRequest(kind, mapped.packed(), include_usage, session)


def _prompt_field(kind: str, body: Mapping[str, Any]) -> str:
    """Where the prompt is: vLLM also takes an embeddings request in chat's `messages`, and a
    completion of `prompt_embeds` alone."""
    if kind == "embeddings" and "input" not in body and "messages" in body:
        return "messages"
    if kind == "completions" and "prompt" not in body and "prompt_embeds" in body:
        return "prompt_embeds"
    return PROMPTS[kind]


def _check_contents(messages: list[Mapping[str, Any]]) -> None:
    """Each message's content is what `first_only` can fold an instruction into; otherwise
    passed on unchecked, for the upstream to name."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            where = f"messages.{i}.content"
            raise InvalidRequest(
                f"{where}: must be a string, an array of parts or null, got {kind_of(content)}",
                where,
            )


def _check_prompt(kind: str, name: str, prompt: Any) -> None:
    if name == "prompt_embeds":
        return  # base64 tensors: the upstream's to read
    if name == "messages":
        kind = "chat"
    if kind == "chat":
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequest(f"{name}: must be a non-empty array, got {kind_of(prompt)}", name)
        for i, message in enumerate(prompt):
            if not isinstance(message, Mapping):
                raise InvalidRequest(
                    f"{name}.{i}: must be an object, got {kind_of(message)}", f"{name}.{i}"
                )
            if not isinstance(message.get("role"), str):
                raise InvalidRequest(
                    f"{name}.{i}.role: must be a string, got {kind_of(message.get('role'))}",
                    f"{name}.{i}.role",
                )
        return
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequest(
            f"{name}: must be a string or a non-empty array, got {kind_of(prompt)}", name
        )
    for i, item in enumerate(prompt):
        if not (
            isinstance(item, str)
            or is_int(item)
            or (isinstance(item, list) and all(is_int(token) for token in item))
        ):
            raise InvalidRequest(
                f"{name}.{i}: must be a string, a token id or an array of token ids, "
                f"got {kind_of(item)}",
                f"{name}.{i}",
            )


def error_document(error: GatewayError) -> dict[str, Any]:
    """`{"error": {...}}` as OpenAI writes it: an upstream's own error object where it gave
    one (vLLM's flat `{"object": "error", ...}` too), else the gateway's."""
    if error.upstream_body is not None:
        found = _openai_error(error.upstream_body)
        if found is not None:
            return {"error": found}
    return error.openai_body()


def _openai_error(body: bytes) -> dict[str, Any] | None:
    try:
        document = orjson.loads(body)
    except ValueError:
        return None
    if not isinstance(document, dict):
        return None
    error = document.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error
    if isinstance(error, str):  # Ollama's, and proxies'
        return {"message": error, "type": "server_error", "param": None, "code": None}
    if document.get("object") == "error" and isinstance(document.get("message"), str):
        return {key: value for key, value in document.items() if key != "object"}
    return None


def error_line(document: dict[str, Any]) -> bytes:
    """The data line that ends a stream in failure: the OpenAI SDKs raise on its `error`."""
    return b"data: " + orjson.dumps(document) + b"\n\n"


def failure(message: str) -> dict[str, Any]:
    """The error of a stream the gateway itself found broken."""
    return {"message": message, "type": "server_error", "param": None, "code": None}


def renamed(data: bytes, document: Any, name: str) -> bytes:
    """`data` (the JSON text of `document`) with its top-level `model` as `name`, every other
    byte as it was; where the key is not written plainly, `document` written anew."""
    if not isinstance(document, dict):
        return data
    value = document.get("model")
    if not isinstance(value, str) or value == name:
        return data
    spot = _model_value(data)
    if spot is not None:
        _, start, end = spot
        return data[:start] + orjson.dumps(name) + data[end:]
    document["model"] = name
    return orjson.dumps(document)


def _model_value(data: bytes) -> tuple[int, int, int] | None:
    """Where `data`'s top-level `"model":` key starts, and where its string value starts and
    ends, if it is all there."""
    for key in _MODEL_KEY.finditer(data):
        if _top_level(data, key.start()):
            return None if key.group(1) is None else (key.start(), *key.span(1))
    return None


def _top_level(data: bytes, at: int) -> bool:
    """Whether a key at `at` is one of the outermost object's: exactly when what comes before
    it opens an object that the key could end (in a nested object, or inside a string, this
    makes no JSON)."""
    try:
        return isinstance(orjson.loads(data[:at] + b'"model":0}'), dict)
    except ValueError:
        return False


def cached_tokens(usage: Mapping[str, Any] | None) -> int | None:
    """Of the prompt, the tokens read from the upstream's prefix cache, where its usage says
    (`prompt_tokens_details.cached_tokens`: vLLM with `--enable-prompt-tokens-details`,
    llama.cpp's server)."""
    details = (usage or {}).get("prompt_tokens_details")
    tokens = details.get("cached_tokens") if isinstance(details, dict) else None
    return tokens if is_int(tokens) and tokens >= 0 else None


class WholeRelay:
    """A whole (non-streamed) JSON answer, passed on as it arrives with its model renamed.

    The head is held back only until its top-level `model` value has arrived (at most
    `MODEL_HEAD` bytes), so an embeddings answer of many megabytes never sits in the gateway.
    Its top-level `usage` is read wherever it stands, as the answer passes.
    """

    def __init__(self, name: str, *, rename: bool = True) -> None:
        self.name = name
        self._head: bytes | None = b"" if rename else None  # None: passing through
        self._usage = TopLevelObject("usage")

    def feed(self, data: bytes) -> bytes:
        self._usage.feed(data)
        if self._head is None:
            return data
        head = self._head + data
        spot = _model_value(head)
        if spot is None and len(head) < MODEL_HEAD:
            self._head = head
            return b""
        self._head = None
        if spot is None:
            return head
        _, start, end = spot
        return head[:start] + orjson.dumps(self.name) + head[end:]

    def end(self) -> bytes:
        head, self._head = self._head or b"", None
        return head

    @property
    def usage(self) -> dict[str, Any] | None:
        return self._usage.value


class StreamRelay:
    """An upstream's chunk stream, event by event: renamed, and passed on.

    Each `feed` answers the bytes to write for one upstream read. `[DONE]` is passed and ends
    the answer (`done`); the usage chunk (`"choices": []`) is dropped unless the client asked
    for it (older clients break on an empty `choices`); an error event is passed in OpenAI's
    shape and fails the stream (`failed`), with no `[DONE]` after it.

    An event as servers write it (`DATA_EVENT`) is renamed where its bytes say the model
    they said before, and parsed only if they may hold an error or the usage chunk: a JSON
    parse and re-framing of every token cost the relay more than translating does on the
    Messages surface (`python -m bench.surfaces`).
    """

    def __init__(self, name: str, include_usage: bool) -> None:
        self.name = name
        self.include_usage = include_usage
        self.done = False
        self.failed = False
        self.usage: dict[str, Any] | None = None
        self.chunks = 0  # chunks with output in them: the count until usage says
        self.finish_reason: str | None = None
        self.error: dict[str, Any] | None = None  # what the stream failed with
        self.started = False  # a chunk with output has been passed on
        self._parser = SSEParser()
        # The model as the last parsed chunk wrote it (`"model":"Qwen/QwQ-32B"`), and what
        # it becomes; None until a chunk said one.
        self._said: bytes | None = None
        self._says: bytes = b""
        self._prefix: bytes | None = None  # what came before it, the last time
        self._special: tuple[bytes, ...] = ()  # what only special chunks have, in its layout

    @property
    def over(self) -> bool:
        return self.done or self.failed

    def feed(self, data: bytes) -> bytes:
        if self.over:
            return b""
        if self._said is not None and self._parser.idle and data.endswith(b"\n\n"):
            run = self._run(data)
            if run is not None:
                return run
        out: list[bytes] = []
        parser, match = self._parser, DATA_EVENT.match
        position, size = 0, len(data)
        while position < size and not self.over:
            if parser.idle:
                while (event := match(data, position)) is not None and (
                    event.end() - position - 2 <= parser.limit
                ):
                    out.append(self._plain(event[1], data, position, event.end()))
                    position = event.end()
                    if self.over:
                        return b"".join(out)
                if position == size:
                    break
            # One event the generic way (or the rest, where no blank line ends one).
            end = data.find(b"\n\n", position) + 2
            if end < 2:
                end = size
            try:
                events, too_large = parser.feed(data[position:end]), None
            except EventTooLarge as e:
                events, too_large = e.events, e
            for sse in events:
                if self.over:
                    break
                out.append(self._event(sse.data.encode("utf-8", "surrogatepass")))
            if too_large is not None:
                out.append(self.fail(f"upstream sent {too_large}"))
            position = end
        return b"".join(out)

    def _run(self, data: bytes) -> bytes | None:
        """A read of plain chunks only (the common read), renamed in one pass; None where one
        of them is not as the chunks before it, or may be special (the caller then takes them
        one by one). Literal searches over the whole read, not a regex and not a loop over its
        events: either cost more than all the rest of the relay (`python -m bench.surfaces`)."""
        said, says = self._said, self._says
        assert said is not None
        if b"\r" in data or any(mark in data for mark in self._special):
            return None
        events = data.count(b"\n\n")
        if data.count(b"\n") != 2 * events or data.count(b"}\n\n") != events:
            return None  # an event of more than one line, or one that is no object
        head = b"data: " + (self._prefix or b"") + said
        # Every event starts as the last one seen did, up to and with its model (so that is
        # its top-level model), and the model says so nowhere else.
        if not (
            self._prefix is not None
            and data.startswith(head)
            and data.count(b"\n\n" + head) == events - 1
            and data.count(said) == events
        ):
            return self._each(data)
        self.chunks += events
        self.started = True
        return data if said == says else data.replace(said, says)

    def _each(self, data: bytes) -> bytes | None:
        """`_run` event by event: where one's head differs from the last (a new second in
        `created`), it is checked anew."""
        said, says = self._said, self._says
        assert said is not None
        events = data.split(b"\n\n")
        events.pop()  # after the last event's blank line
        out = []
        for event in events:
            if not event.startswith(b"data: "):
                return None
            payload = event[6:]
            at = payload.find(said)
            if at == -1 or not self._known_prefix(payload, at):
                return None
            out.append(b"data: " + payload[:at] + says + payload[at + len(said) :])
        self.chunks += len(events)
        self.started = True
        return data if said == says else b"\n\n".join(out) + b"\n\n"

    def _known_prefix(self, payload: bytes, at: int) -> bool:
        """Whether `said` at `at` in `payload` (an event's `{...}`) is its top-level model:
        what precedes it is what preceded it last time (a stream's id and object stay,
        `created` changes once a second), or makes it top-level anew."""
        prefix = payload[:at]
        if prefix == self._prefix:
            return True
        if not _top_level(payload, at):
            return False
        self._prefix = prefix
        return True

    def _plain(self, payload: bytes, data: bytes, start: int, end: int) -> bytes:
        """One `data: ...` event, `data[start:end]`: passed as it is, or renamed in place."""
        if payload == b"[DONE]":
            self.done = True
            return DONE
        said = self._said
        if (
            said is None
            or not payload.endswith(b"}")
            or any(mark in payload for mark in self._special)
        ):
            return self._event(payload)
        at = payload.find(said)
        if at == -1 or not self._known_prefix(payload, at):
            return self._event(payload)
        # Any other chunk says something (a token, a tool call's piece): the count until the
        # usage chunk gives the real one.
        self.chunks += 1
        self.started = True
        if said == self._says:
            return data[start:end]
        return b"data: " + payload[:at] + self._says + payload[at + len(said) :] + b"\n\n"

    def _event(self, data: bytes) -> bytes:
        """One event's data, parsed in full."""
        if data == b"[DONE]":
            self.done = True
            return DONE
        try:
            document = orjson.loads(data)
        except ValueError:
            return self.fail("upstream sent a line that is not JSON")
        if isinstance(document, dict):
            if isinstance(document.get("error"), dict | str) or document.get("object") == "error":
                found = _openai_error(data)
                return self._end(found or failure(data[:500].decode("utf-8", "replace")))
            choices = document.get("choices")
            usage = document.get("usage")
            if isinstance(usage, dict):
                self.usage = usage
                if choices == [] and not self.include_usage:
                    return b""
            if isinstance(choices, list):
                self._count(choices)
            self._learn(data, document)
        out = renamed(data, document, self.name)
        return b"data: " + out.replace(b"\n", b"\ndata: ") + b"\n\n"

    def _learn(self, data: bytes, document: dict[str, Any]) -> None:
        """How this upstream writes its model's name, for the events after this one."""
        value = document.get("model")
        spot = _model_value(data) if isinstance(value, str) else None
        if spot is None:
            self._said = None
            return
        key, start, end = spot
        layout = _LAYOUTS.get(data[key:start])
        if layout is None:  # keys written as no server we know writes them: no shortcut
            self._said = None
            return
        self._special = layout
        self._said = data[key:end]
        self._prefix = data[:key]
        self._says = self._said if value == self.name else data[key:start] + orjson.dumps(self.name)

    def _count(self, choices: list[Any]) -> None:
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                output = (
                    delta.get("content")
                    or delta.get("reasoning")
                    or delta.get("reasoning_content")
                    or delta.get("tool_calls")
                )
            else:
                output = choice.get("text")
            if output:
                self.chunks += 1
                self.started = True
            reason = choice.get("finish_reason")
            if isinstance(reason, str):
                self.finish_reason = reason

    def fail(self, message: str) -> bytes:
        """End the stream with an error line: the upstream broke off, or sent what is no
        chunk."""
        if self.over:
            return b""
        return self._end(failure(message))

    def _end(self, error: dict[str, Any]) -> bytes:
        self.failed = True
        self.error = error
        return error_line({"error": error})

    def eof(self, upstream: str) -> bytes:
        """The body ended: without `[DONE]`, the answer may be cut short, so it fails."""
        return self.fail(f"upstream {upstream} ended the stream before [DONE]")

    @property
    def output_tokens(self) -> int:
        usage = self.usage or {}
        tokens = usage.get("completion_tokens")
        return tokens if is_int(tokens) else self.chunks

    @property
    def input_tokens(self) -> int | None:
        tokens = (self.usage or {}).get("prompt_tokens")
        return tokens if is_int(tokens) else None
