"""Anthropic Messages requests in, OpenAI chat-completions requests out, with no I/O.

Validation and mapping are one pass so that every 400 names the exact field that is wrong
(`messages.2.content.0.source.data: ...`), the way the Anthropic API words it. Fields a real
client sends that have no upstream equivalent (cache_control, context_management, betas, ...)
are ignored rather than rejected: Claude Code and the SDKs send more than the documented minimum.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from homelab_gateway.config import ModelConfig
from homelab_gateway.core.fields import (
    InvalidRequest,
    cap_output,
    check_base64,
    image_part,
    is_int,
    is_number,
    kind_of,
    string,
    typed,
    usage_options,
)
from homelab_gateway.core.instructions import first_only
from homelab_gateway.core.text import LONE_SURROGATE, dumps, replace_lone_surrogates

IMAGE_MEDIA_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "max": "high"}
CHARS_PER_TOKEN = 4  # the estimate used where the upstream cannot count tokens itself
# Claude Code's attribution line, first in its system prompt. It carries a per-prompt suffix
# (and, in some versions, a `cch=` value new on every request) ahead of a ~20,000-token system
# prompt, so with it no upstream prefix cache ever matches. Decided as vLLM's chat renderer does
# (`_strip_claude_code_billing_header`): a system text starting with it loses its first line,
# and the block goes if nothing follows; any other text is untouched.
BILLING_HEADER = "x-anthropic-billing-header"
PER_ATTEMPT = ("model", "priority")  # fields each attempt sets for the replica it goes to


@dataclass(frozen=True, slots=True)
class MappedRequest:
    model: str  # the name the client sent, echoed back in every answer
    stream: bool
    body: dict[str, Any]  # the OpenAI request for the upstream
    stop_sequences: tuple[str, ...]
    estimated_input_tokens: int
    show_reasoning: bool = True  # False: drop the upstream's reasoning from the answer

    def packed(self) -> PackedRequest:
        """What the request keeps while it waits for a slot (see `PackedRequest`)."""
        own = {name: self.body[name] for name in PER_ATTEMPT if name in self.body}
        rest = {name: value for name, value in self.body.items() if name not in PER_ATTEMPT}
        return PackedRequest(
            model=self.model,
            stream=self.stream,
            json=dumps(rest),
            own=own,
            stop_sequences=self.stop_sequences,
            estimated_input_tokens=self.estimated_input_tokens,
            show_reasoning=self.show_reasoning,
        )


@dataclass(frozen=True, slots=True)
class PackedRequest:
    """A mapped request as it waits for a slot: the upstream body as JSON bytes, since its
    parsed tree costs 6-8 times its size (a long conversation's one-line messages), and
    the fields of `PER_ATTEMPT` apart, to be set for the replica each attempt goes to."""

    model: str
    stream: bool
    json: bytes  # the upstream body less the `PER_ATTEMPT` fields
    own: dict[str, Any]  # the body's own values of those (a model's `params` may set one)
    stop_sequences: tuple[str, ...]
    estimated_input_tokens: int
    show_reasoning: bool

    def body(self, **fields: Any) -> bytes:
        """The upstream body with `fields` (of `PER_ATTEMPT`) set, ahead of the rest."""
        head = dumps({**self.own, **fields})
        if self.json == b"{}":
            return head
        if head == b"{}":
            return self.json
        return head[:-1] + b"," + self.json[1:]


def request_model(body: Any) -> str:
    """The client's model name, checked first so an unknown model can be a 404."""
    if not isinstance(body, Mapping):
        raise InvalidRequest(f"request body must be a JSON object, got {kind_of(body)}", "model")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest(f"model: must be a non-empty string, got {kind_of(model)}", "model")
    return model


def find_model(models: Mapping[str, ModelConfig], name: str) -> ModelConfig | None:
    """The model configured for the client's `name`: its exact entry, else a pattern's.

    A configured name with `*` in it is a shell-style pattern (fnmatch, case-sensitive), so
    Claude Code's built-in names (`claude-sonnet-4-5-20250929`, `claude-haiku-4-5`) reach a local
    model with nothing set but ANTHROPIC_BASE_URL. Exact names win; among patterns the most
    specific (most characters that are not wildcards) wins, then the first in the file.
    """
    exact = models.get(name)
    if exact is not None and "*" not in exact.name:
        return exact
    matches = [
        model
        for pattern, model in models.items()
        if "*" in pattern and fnmatch.fnmatchcase(name, pattern)
    ]
    if not matches:
        return None
    return max(matches, key=lambda model: len(model.name.replace("*", "").replace("?", "")))


def map_request(
    body: Mapping[str, Any],
    model: ModelConfig,
    *,
    continuous_usage_stats: bool = True,
    count_only: bool = False,
) -> MappedRequest:
    """Validate `body` and build the upstream request; raise InvalidRequest naming the field.

    `count_only` is the count_tokens endpoint: max_tokens is not required there.
    """
    client_model = request_model(body)
    messages: list[dict[str, Any]] = []
    strip = model.strip_billing_header
    system = body.get("system")
    if system is not None:
        text = _system_text(system, "system", strip=strip)
        if text is not None:
            messages.append({"role": "system", "content": text})
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list):
        raise InvalidRequest(f"messages: must be a non-empty array, got {kind_of(raw_messages)}")
    if not raw_messages:
        raise InvalidRequest("messages: must be a non-empty array, got an empty array")
    previous_tool_ids: set[str] = set()
    for i, message in enumerate(raw_messages):
        previous_tool_ids = _message(message, f"messages.{i}", previous_tool_ids, messages, strip)
    messages = first_only(messages)  # the templates take one system message, first

    out: dict[str, Any] = {"model": model.upstream_model, "messages": messages}
    max_tokens = body.get("max_tokens")
    if max_tokens is not None or not count_only:
        if not is_int(max_tokens) or max_tokens < 1:
            raise InvalidRequest(f"max_tokens: must be an integer >= 1, got {kind_of(max_tokens)}")
        out["max_tokens"] = max_tokens
        cap_output(out, model.max_tokens, absent_is_unbounded=False)

    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest(f"stream: must be a boolean, got {kind_of(stream)}")
    out["stream"] = True  # always: one translation path, and idle/cancel work mid-generation
    out["stream_options"] = usage_options(continuous_usage_stats)

    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None:
            if not is_number(value) or value < 0:
                raise InvalidRequest(f"{name}: must be a number >= 0, got {kind_of(value)}")
            out[name] = value
    top_k = body.get("top_k")
    if top_k is not None:
        if not is_int(top_k) or top_k < 0:
            raise InvalidRequest(f"top_k: must be an integer >= 0, got {kind_of(top_k)}")
        out["top_k"] = top_k

    stop_sequences = _stop_sequences(body.get("stop_sequences"))
    if stop_sequences:
        out["stop"] = list(stop_sequences)

    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, Mapping):
            raise InvalidRequest(f"metadata: must be an object, got {kind_of(metadata)}")
        user_id = metadata.get("user_id")
        if user_id is not None:
            if not isinstance(user_id, str):
                raise InvalidRequest(f"metadata.user_id: must be a string, got {kind_of(user_id)}")
            out["user"] = user_id

    tools = body.get("tools")
    if tools is not None:
        out["tools"] = _tools(tools)
    tool_choice = body.get("tool_choice")
    if tool_choice is not None:
        _tool_choice(tool_choice, out)

    thinking = _thinking(body.get("thinking"), model, out)
    _output_config(body.get("output_config"), body.get("output_format"), model, out)

    estimate = estimate_tokens(messages, out.get("tools"))
    return MappedRequest(
        model=replace_lone_surrogates(client_model),  # echoed in the answer, which is UTF-8
        stream=stream,
        body=merge(model.params, out),
        stop_sequences=stop_sequences,
        estimated_input_tokens=estimate,
        show_reasoning=model.show_reasoning == "always" or thinking,
    )


def _message(
    message: Any,
    where: str,
    previous_tool_ids: set[str],
    out: list[dict[str, Any]],
    strip: bool,
) -> set[str]:
    """Append the OpenAI messages for one Anthropic message; return the tool ids it calls."""
    if not isinstance(message, Mapping):
        raise InvalidRequest(f"{where}: must be an object, got {kind_of(message)}")
    role = message.get("role")
    content = message.get("content")
    if role == "system":  # Claude Code sends these inside messages: `first_only` folds them
        text = _system_text(content, f"{where}.content", strip=strip)
        if text is not None:
            out.append({"role": "system", "content": text})
        return previous_tool_ids
    if role not in ("user", "assistant"):
        raise InvalidRequest(f"{where}.role: must be 'user' or 'assistant', got {kind_of(role)}")
    if isinstance(content, str):
        out.append({"role": role, "content": content})
        return set()
    if not isinstance(content, list):
        raise InvalidRequest(
            f"{where}.content: must be a string or an array, got {kind_of(content)}"
        )
    if role == "assistant":
        return _assistant(content, f"{where}.content", out)
    _user(content, f"{where}.content", previous_tool_ids, out)
    return set()


def _assistant(blocks: list[Any], where: str, out: list[dict[str, Any]]) -> set[str]:
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = typed(block, f"{where}.{j}")
        if kind == "text":
            text.append(string(block, "text", f"{where}.{j}"))
        elif kind == "tool_use":
            call_id = string(block, "id", f"{where}.{j}", nonempty=True)
            name = string(block, "name", f"{where}.{j}", nonempty=True)
            arguments = block.get("input", {})
            if not isinstance(arguments, Mapping):
                raise InvalidRequest(
                    f"{where}.{j}.input: must be an object, got {kind_of(arguments)}"
                )
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments)},
                }
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue  # earlier reasoning is the client's record; upstreams do not take it back
        else:
            raise _unsupported_block(kind, f"{where}.{j}", "assistant")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text else None}
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    out.append(message)
    return {call["id"] for call in calls}


def _user(blocks: list[Any], where: str, tool_ids: set[str], out: list[dict[str, Any]]) -> None:
    parts: list[dict[str, Any]] = []
    tool_images: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = typed(block, f"{where}.{j}")
        if kind == "text":
            parts.append({"type": "text", "text": string(block, "text", f"{where}.{j}")})
        elif kind == "image":
            parts.append(_image(block, f"{where}.{j}"))
        elif kind == "tool_result":
            tool_id = string(block, "tool_use_id", f"{where}.{j}", nonempty=True)
            if tool_id not in tool_ids:
                raise InvalidRequest(
                    f"{where}.{j}.tool_use_id: {tool_id!r} answers no tool_use in the "
                    "previous assistant message"
                )
            text, images = _tool_result_content(block.get("content", ""), f"{where}.{j}.content")
            out.append({"role": "tool", "tool_call_id": tool_id, "content": text})
            tool_images.extend(images)
        else:
            raise _unsupported_block(kind, f"{where}.{j}", "user")
    # OpenAI tool messages carry text only: images a tool returned follow in a user message.
    parts = tool_images + parts
    if not parts:
        return
    if all(part["type"] == "text" for part in parts):
        out.append({"role": "user", "content": "".join(part["text"] for part in parts)})
    else:
        out.append({"role": "user", "content": parts})


def _tool_result_content(content: Any, where: str) -> tuple[str, list[dict[str, Any]]]:
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}: must be a string or an array, got {kind_of(content)}")
    text: list[str] = []
    images: list[dict[str, Any]] = []
    for k, block in enumerate(content):
        kind = typed(block, f"{where}.{k}")
        if kind == "text":
            text.append(string(block, "text", f"{where}.{k}"))
        elif kind == "image":
            images.append(_image(block, f"{where}.{k}"))
        else:
            raise _unsupported_block(kind, f"{where}.{k}", "tool_result")
    return "".join(text), images


def _image(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, Mapping):
        raise InvalidRequest(f"{where}.source: must be an object, got {kind_of(source)}")
    kind = source.get("type")
    if kind == "url":
        url = string(source, "url", f"{where}.source", nonempty=True)
        if not url.startswith(("http://", "https://")):
            raise InvalidRequest(f"{where}.source.url: must be an http(s) URL")
        return image_part(url)
    if kind != "base64":
        raise InvalidRequest(f"{where}.source.type: must be 'base64' or 'url', got {kind_of(kind)}")
    media_type = source.get("media_type")
    if media_type not in IMAGE_MEDIA_TYPES:
        allowed = ", ".join(sorted(IMAGE_MEDIA_TYPES))
        raise InvalidRequest(f"{where}.source.media_type: must be one of {allowed}")
    data = string(source, "data", f"{where}.source", nonempty=True)
    check_base64(data, f"{where}.source.data")
    return image_part(f"data:{media_type};base64,{data}")


def _system_text(system: Any, where: str, *, strip: bool) -> str | None:
    """The system prompt's text; None when it held nothing but the billing header."""
    blocks = [{"type": "text", "text": system}] if isinstance(system, str) else system
    if not isinstance(blocks, list):
        raise InvalidRequest(f"{where}: must be a string or an array of text blocks")
    texts = []
    dropped = False
    for j, block in enumerate(blocks):
        kind = typed(block, f"{where}.{j}")
        if kind != "text":
            raise InvalidRequest(f"{where}.{j}.type: must be 'text', got {kind!r}")
        text = string(block, "text", f"{where}.{j}")
        if strip and text.startswith(BILLING_HEADER):
            text = text.partition("\n")[2]
            if not text:
                dropped = True
                continue
        texts.append(text)
    return None if dropped and not texts else "\n\n".join(texts)


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise InvalidRequest(f"tools: must be an array, got {kind_of(tools)}")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, Mapping):
            raise InvalidRequest(f"{where}: must be an object, got {kind_of(tool)}")
        kind = tool.get("type", "custom")
        if kind not in ("custom", None):
            raise InvalidRequest(
                f"{where}.type: server tool {kind!r} is not supported by this gateway; "
                "only client tools with an input_schema are"
            )
        name = string(tool, "name", where, nonempty=True)
        schema = tool.get("input_schema")
        if not isinstance(schema, Mapping):
            raise InvalidRequest(f"{where}.input_schema: must be an object, got {kind_of(schema)}")
        function: dict[str, Any] = {"name": name, "parameters": dict(schema)}
        description = tool.get("description")
        if description is not None:
            function["description"] = string(tool, "description", where)
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any, out: dict[str, Any]) -> None:
    if not isinstance(choice, Mapping):
        raise InvalidRequest(f"tool_choice: must be an object, got {kind_of(choice)}")
    kind = choice.get("type")
    if kind == "tool":
        name = string(choice, "name", "tool_choice", nonempty=True)
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    elif kind in TOOL_CHOICES:
        out["tool_choice"] = TOOL_CHOICES[kind]
    else:
        raise InvalidRequest(
            f"tool_choice.type: must be 'auto', 'any', 'tool' or 'none', got {kind_of(kind)}"
        )
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise InvalidRequest("tool_choice.disable_parallel_tool_use: must be a boolean")
        if parallel:
            out["parallel_tool_calls"] = False


def _thinking(thinking: Any, model: ModelConfig, out: dict[str, Any]) -> bool:
    """Map `thinking`; answer whether the client asked for reasoning."""
    if thinking is None:
        return False
    if not isinstance(thinking, Mapping):
        raise InvalidRequest(f"thinking: must be an object, got {kind_of(thinking)}")
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise InvalidRequest(
            f"thinking.type: must be 'enabled', 'disabled' or 'adaptive', got {kind_of(kind)}"
        )
    budget = thinking.get("budget_tokens")
    if budget is not None and (not is_int(budget) or budget < 0):
        raise InvalidRequest(
            f"thinking.budget_tokens: must be an integer >= 0, got {kind_of(budget)}"
        )
    if model.map_thinking:
        out["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
    return kind != "disabled"


def _output_config(config: Any, beta_format: Any, model: ModelConfig, out: dict[str, Any]) -> None:
    """`output_config` (effort, format) and the older beta spelling `output_format`."""
    if config is not None and not isinstance(config, Mapping):
        raise InvalidRequest(f"output_config: must be an object, got {kind_of(config)}")
    config = config or {}
    output_format = config.get("format")
    if output_format is not None and beta_format is not None and output_format != beta_format:
        raise InvalidRequest("output_format: differs from output_config.format; send one of them")
    if output_format is not None:
        out["response_format"] = _response_format(output_format, "output_config.format")
    elif beta_format is not None:
        out["response_format"] = _response_format(beta_format, "output_format")
    _effort(config.get("effort"), model, out)


def _response_format(output_format: Any, where: str) -> dict[str, Any]:
    """Anthropic's JSON-schema output as OpenAI's `response_format`, which vLLM, llama.cpp and
    Ollama all take; anything else is refused by name rather than answered in prose."""
    if not isinstance(output_format, Mapping):
        raise InvalidRequest(f"{where}: must be an object, got {kind_of(output_format)}")
    kind = output_format.get("type")
    if kind != "json_schema":
        raise InvalidRequest(
            f"{where}.type: only 'json_schema' can be carried upstream, got {kind_of(kind)}"
        )
    schema = output_format.get("schema")
    if not isinstance(schema, Mapping) or not schema:
        raise InvalidRequest(f"{where}.schema: must be a non-empty object, got {kind_of(schema)}")
    unknown = sorted(set(output_format) - {"type", "schema"})
    if unknown:
        raise InvalidRequest(f"{where}.{unknown[0]}: cannot be carried to the upstream")
    return {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": dict(schema), "strict": True},
    }


def _effort(effort: Any, model: ModelConfig, out: dict[str, Any]) -> None:
    if effort is None:
        return
    if effort not in EFFORTS:
        raise InvalidRequest(
            f"output_config.effort: must be one of {', '.join(EFFORTS)}, got {kind_of(effort)}"
        )
    if model.map_effort:
        out["reasoning_effort"] = EFFORTS[effort]


def _stop_sequences(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise InvalidRequest("stop_sequences: must be an array of non-empty strings")
    for i, sequence in enumerate(value):  # one is echoed back as the answer's stop_sequence
        if LONE_SURROGATE.search(sequence):
            raise InvalidRequest(
                f"stop_sequences.{i}: holds a lone surrogate escape, which is no character"
            )
    return tuple(value)


def _unsupported_block(kind: str, where: str, role: str) -> InvalidRequest:
    return InvalidRequest(f"{where}.type: block type {kind!r} is not supported in a {role} message")


def merge(defaults: Mapping[str, Any], request: Mapping[str, Any]) -> dict[str, Any]:
    """The model's configured params under the request's own fields: the client's value wins."""
    merged = dict(defaults)
    for key, value in request.items():
        base = merged.get(key)
        if isinstance(base, Mapping) and isinstance(value, Mapping):
            merged[key] = merge(base, value)
        else:
            merged[key] = value
    return merged


def estimate_tokens(messages: Sequence[Mapping[str, Any]], tools: Any) -> int:
    text = json.dumps([messages, tools or []], ensure_ascii=False)
    return max(1, len(text) // CHARS_PER_TOKEN)
