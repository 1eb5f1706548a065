"""OpenAI Responses requests in, chat-completions requests out; the translator's block events in,
Responses events out; no I/O.

The gateway keeps no state: the whole conversation comes in `input` every turn (Codex resends
it), so `previous_response_id` and `conversation` are refused by name. Each request is mapped
once, validated as it goes, so a 400 names the exact item (`input.3.call_id: ...`).

The answer reuses `StreamTranslator`: its blocks (thinking, text, tool_use) are the Responses
output items (reasoning, message, function_call) one for one, so chunk handling (reasoning
fields, tool fragments, surrogates, usage, finish reasons) has one implementation.
`ResponseStream` numbers the events, keeps the output for the final object, and holds a closed
item's `done` events until it knows whether the answer ended there cut short.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson

from homelab_gateway.config import ModelConfig
from homelab_gateway.core.mapping import (
    InvalidRequest,
    MappedRequest,
    PackedRequest,
    dumps,
    estimate_tokens,
    is_int,
    is_number,
    kind_of,
    merge,
    request_model,
)
from homelab_gateway.core.sse import encode_event
from homelab_gateway.core.translator import Event, replace_lone_surrogates

HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer_use_preview",
        "computer_use",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
        "tool_search",
    }
)
"""Tools OpenAI runs itself: no upstream here can, so they are dropped from the request (Codex
always offers `web_search`) rather than refused."""
HOSTED_ITEMS = frozenset(
    {
        "web_search_call",
        "file_search_call",
        "code_interpreter_call",
        "image_generation_call",
        "computer_call",
        "computer_call_output",
        "mcp_call",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "local_shell_call",
        "local_shell_call_output",
        "tool_search_call",
        "tool_search_output",
    }
)
"""History items of those tools, and `reasoning`: the upstream takes none of them back."""
STATELESS = ("previous_response_id", "conversation", "prompt")
"""Fields that name something stored on the server: this gateway stores nothing."""
EFFORTS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}
TOOL_CHOICES = frozenset({"auto", "none", "required"})
NAMESPACE_SEPARATOR = "__"
"""Between a namespace and a function's name, where a namespaced tool is offered upstream."""
INPUT_SCHEMA = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The tool's whole input"}},
    "required": ["input"],
}
"""A custom (freeform) tool's parameters as a function: its input as one string."""


class Offered(NamedTuple):
    """A tool as the client named it, behind the name the upstream sees."""

    namespace: str | None
    name: str
    custom: bool = False  # a freeform tool: its calls are `custom_tool_call`s with an `input`


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    packed: PackedRequest
    echo: bytes  # the Response fields that repeat the request, as a JSON object
    names: dict[str, Offered]  # by the name upstream
    call_ids: frozenset[str]  # the input's call ids: a new call must not repeat one
    session: str | None


def map_responses(
    body: Any, model: ModelConfig, *, continuous_usage_stats: bool = True
) -> ResponsesRequest:
    """Validate `body` and build the upstream chat request; raise InvalidRequest naming the
    field."""
    client_model = request_model(body)
    for name in STATELESS:
        if body.get(name) is not None:
            raise InvalidRequest(
                f"{name}: this gateway stores no responses or conversations; send the whole "
                "conversation in `input`",
                name,
            )
    if body.get("background"):
        raise InvalidRequest(
            "background: this gateway stores no responses; stream the answer instead",
            "background",
        )
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise InvalidRequest(f"stream: must be a boolean, got {kind_of(stream)}", "stream")

    tools, names, echo_tools = _tools(body.get("tools"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest(
            f"instructions: must be a string, got {kind_of(instructions)}", "instructions"
        )
    flat = {(tool.namespace, tool.name): upstream for upstream, tool in names.items()}
    messages, call_ids = _input(body.get("input"), instructions, flat)

    out: dict[str, Any] = {"model": model.upstream_model, "messages": messages}
    limit = _optional(body, "max_output_tokens", is_int, "an integer >= 1", least=1)
    if limit is not None:
        out["max_tokens"] = limit
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        value = _optional(body, name, is_number, "a number")
        if value is not None:
            out[name] = value
    top_logprobs = _optional(body, "top_logprobs", is_int, "an integer >= 0", least=0)
    if top_logprobs:
        raise InvalidRequest("top_logprobs: log probabilities are not served here", "top_logprobs")
    if tools:
        out["tools"] = tools
        choice = body.get("tool_choice")
        if choice is not None:
            out["tool_choice"], offered = _tool_choice(choice, names)
            if offered is not None:
                out["tools"] = [t for t in tools if t["function"]["name"] in offered]
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise InvalidRequest(
                f"parallel_tool_calls: must be a boolean, got {kind_of(parallel)}",
                "parallel_tool_calls",
            )
        if tools:
            out["parallel_tool_calls"] = parallel
    reasoning, asked = _reasoning(body.get("reasoning"), model, out)
    text = _text_config(body.get("text"), out)
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise InvalidRequest(f"metadata: must be an object, got {kind_of(metadata)}", "metadata")

    out["stream"] = True  # always: one translation path, and idle/cancel work mid-generation
    out["stream_options"] = {"include_usage": True}
    if continuous_usage_stats:
        out["stream_options"]["continuous_usage_stats"] = True
    upstream = merge(model.params, out)
    if model.max_tokens is not None:
        upstream["max_tokens"] = min(
            upstream.get("max_tokens") or model.max_tokens, model.max_tokens
        )

    keys = {name: body.get(name) for name in ("prompt_cache_key", "safety_identifier", "user")}
    session = next((v for v in keys.values() if isinstance(v, str) and v), None)
    echo = {
        "instructions": instructions,
        "max_output_tokens": limit,
        "max_tool_calls": body.get("max_tool_calls")
        if is_int(body.get("max_tool_calls"))
        else None,
        "parallel_tool_calls": parallel if parallel is not None else True,
        "tool_choice": _echo_choice(body.get("tool_choice"), tools),
        "tools": echo_tools,
        "temperature": upstream.get("temperature", 1.0),
        "top_p": upstream.get("top_p", 1.0),
        "presence_penalty": upstream.get("presence_penalty", 0.0),
        "frequency_penalty": upstream.get("frequency_penalty", 0.0),
        "top_logprobs": 0,
        "reasoning": reasoning,
        "text": text,
        "truncation": "auto" if body.get("truncation") == "auto" else "disabled",
        "store": False,  # accepted, and never true: nothing is stored
        "background": False,
        "service_tier": body.get("service_tier")
        if isinstance(body.get("service_tier"), str)
        else "default",
        "metadata": dict(metadata or {}),
        "safety_identifier": _string_or_none(keys["safety_identifier"]),
        "prompt_cache_key": _string_or_none(keys["prompt_cache_key"]),
        "previous_response_id": None,
    }
    if isinstance(keys["user"], str):
        echo["user"] = keys["user"]
    mapped = MappedRequest(
        model=replace_lone_surrogates(client_model),
        stream=stream,
        body=upstream,
        stop_sequences=(),
        estimated_input_tokens=estimate_tokens(messages, tools),
        show_reasoning=model.show_reasoning == "always" or asked,
    )
    return ResponsesRequest(
        mapped.packed(), dumps(_clean(echo)), names, frozenset(call_ids), session
    )


def _clean(value: Any) -> Any:
    """`value` with every lone surrogate (a client's `\\u` escape can spell one) as U+FFFD:
    the response is UTF-8, and strict parsers (orjson, serde) refuse the escape."""
    if isinstance(value, str):
        return replace_lone_surrogates(value)
    if isinstance(value, list):
        return [_clean(item) for item in value]
    if isinstance(value, dict):
        return {_clean(key): _clean(item) for key, item in value.items()}
    return value


def _optional(
    body: Mapping[str, Any], name: str, check: Any, wanted: str, *, least: float | None = None
) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if not check(value) or (least is not None and value < least):
        raise InvalidRequest(f"{name}: must be {wanted}, got {kind_of(value)}", name)
    return value


def _string_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _input(
    items: Any, instructions: str | None, flat: Mapping[tuple[str | None, str], str]
) -> tuple[list[dict[str, Any]], set[str]]:
    """The chat messages for `input`, and the call ids it holds.

    `instructions` and the system and developer messages that open the input become one
    leading system message: chat templates reject "developer", and many take one system
    message, first. A later one stays where it is, as a system message."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list):
        raise InvalidRequest(
            f"input: must be a string or an array of items, got {kind_of(items)}", "input"
        )
    system = [instructions] if instructions else []
    out: list[dict[str, Any]] = []
    calls: set[str] = set()
    opening = True
    joinable = False  # the last message is the assistant's: a call joins it
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, Mapping):
            raise InvalidRequest(f"{where}: must be an object, got {kind_of(item)}", where)
        kind = item.get("type", "message")
        if kind in HOSTED_ITEMS or kind == "reasoning":
            continue
        if kind == "message":
            role = item.get("role")
            if role in ("system", "developer"):
                text = _text_content(item.get("content"), f"{where}.content")
                if opening:
                    system.append(text)
                else:
                    out.append({"role": "system", "content": text})
                    joinable = False
                continue
            opening = False
            if role == "assistant":
                text = _text_content(item.get("content"), f"{where}.content", assistant=True)
                out.append({"role": "assistant", "content": text})
                joinable = True
            elif role == "user":
                out.append({"role": "user", "content": _user_content(item.get("content"), where)})
                joinable = False
            else:
                raise InvalidRequest(
                    f"{where}.role: must be 'user', 'assistant', 'system' or 'developer', "
                    f"got {kind_of(role)}",
                    f"{where}.role",
                )
        elif kind in ("function_call", "custom_tool_call"):
            opening = False
            call_id = _string(item, "call_id", where)
            if call_id in calls:
                raise InvalidRequest(
                    f"{where}.call_id: {call_id!r} is used by an earlier call", f"{where}.call_id"
                )
            calls.add(call_id)
            name = _string(item, "name", where)
            namespace = item.get("namespace")
            upstream_name = flat.get((namespace if isinstance(namespace, str) else None, name))
            if kind == "custom_tool_call":
                arguments = dumps({"input": _string(item, "input", where, empty=True)}).decode()
            else:
                arguments = item.get("arguments", "")
            if not isinstance(arguments, str):
                raise InvalidRequest(
                    f"{where}.arguments: must be a string of JSON, got {kind_of(arguments)}",
                    f"{where}.arguments",
                )
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": upstream_name or name, "arguments": arguments or "{}"},
            }
            if joinable:
                out[-1].setdefault("tool_calls", []).append(call)
                if not out[-1]["content"]:
                    out[-1]["content"] = None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                joinable = True
        elif kind in ("function_call_output", "custom_tool_call_output"):
            opening = False
            call_id = _string(item, "call_id", where)
            if call_id not in calls:
                raise InvalidRequest(
                    f"{where}.call_id: {call_id!r} answers no function_call before it",
                    f"{where}.call_id",
                )
            text, images = _output_content(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
            if images:  # a tool message carries text only: its images follow as the user's
                out.append({"role": "user", "content": images})
            joinable = False
        else:
            raise InvalidRequest(
                f"{where}.type: item type {kind!r} is not supported here (this gateway keeps no "
                "state, and runs no hosted tools)",
                f"{where}.type",
            )
    if system:
        out.insert(0, {"role": "system", "content": "\n\n".join(system)})
    if not any(message["role"] != "system" for message in out):
        raise InvalidRequest("input: holds no user or assistant message", "input")
    return out, calls


def _text_content(content: Any, where: str, *, assistant: bool = False) -> str:
    """A message's text: a string, or text parts (`input_text`, `output_text`, and the
    assistant's `refusal`)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(
            f"{where}: must be a string or an array of parts, got {kind_of(content)}", where
        )
    texts = []
    for j, part in enumerate(content):
        kind = _part_type(part, f"{where}.{j}")
        if kind in ("input_text", "output_text", "text"):
            texts.append(_string(part, "text", f"{where}.{j}", empty=True))
        elif kind == "refusal" and assistant:
            texts.append(_string(part, "refusal", f"{where}.{j}", empty=True))
        else:
            raise InvalidRequest(
                f"{where}.{j}.type: part type {kind!r} is not supported in this message",
                f"{where}.{j}.type",
            )
    return "".join(texts)


def _user_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(
            f"{where}.content: must be a string or an array of parts, got {kind_of(content)}",
            f"{where}.content",
        )
    parts = [_part(part, f"{where}.content.{j}") for j, part in enumerate(content)]
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _part(part: Any, where: str) -> dict[str, Any]:
    kind = _part_type(part, where)
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": _string(part, "text", where, empty=True)}
    if kind == "input_image":
        return _image(part, where)
    raise InvalidRequest(
        f"{where}.type: part type {kind!r} is not supported here (text and images are)",
        f"{where}.type",
    )


def _image(part: Mapping[str, Any], where: str) -> dict[str, Any]:
    if part.get("file_id") is not None:
        raise InvalidRequest(
            f"{where}.file_id: this gateway stores no files; send image_url", f"{where}.file_id"
        )
    url = _string(part, "image_url", where)
    if url.startswith("data:"):
        header, _, data = url.partition(",")
        if not header.endswith(";base64") or not header.startswith("data:image/"):
            raise InvalidRequest(
                f"{where}.image_url: a data URL must be data:image/...;base64,...",
                f"{where}.image_url",
            )
        try:
            base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest(
                f"{where}.image_url: is not valid base64", f"{where}.image_url"
            ) from None
    elif not url.startswith(("http://", "https://")):
        raise InvalidRequest(
            f"{where}.image_url: must be an http(s) or data URL", f"{where}.image_url"
        )
    image: dict[str, Any] = {"url": url}
    detail = part.get("detail")
    if detail in ("low", "high", "auto"):
        image["detail"] = detail
    return {"type": "image_url", "image_url": image}


def _output_content(output: Any, where: str) -> tuple[str, list[dict[str, Any]]]:
    """A function call's output: its text for the tool message, and its images apart."""
    if isinstance(output, str):
        return output, []
    if not isinstance(output, list):
        raise InvalidRequest(
            f"{where}: must be a string or an array of parts, got {kind_of(output)}", where
        )
    texts: list[str] = []
    images: list[dict[str, Any]] = []
    for j, part in enumerate(output):
        mapped = _part(part, f"{where}.{j}")
        if mapped["type"] == "text":
            texts.append(mapped["text"])
        else:
            images.append(mapped)
    return "".join(texts), images


def _tools(
    tools: Any,
) -> tuple[list[dict[str, Any]], dict[str, Offered], list[dict[str, Any]]]:
    """The chat tools, what each upstream name stands for, and the tools as the response
    echoes them: the functions offered, under the names the model sees. A custom (freeform)
    tool is offered as a function of one string, `input`, its grammar in its description."""
    if tools is None:
        return [], {}, []
    if not isinstance(tools, list):
        raise InvalidRequest(f"tools: must be an array, got {kind_of(tools)}", "tools")
    out: list[dict[str, Any]] = []
    names: dict[str, Offered] = {}
    echo: list[dict[str, Any]] = []

    def offer(
        tool: Mapping[str, Any], where: str, namespace: str | None, custom: bool = False
    ) -> None:
        name = _string(tool, "name", where)
        upstream_name = name if namespace is None else namespace + NAMESPACE_SEPARATOR + name
        if upstream_name in names:
            raise InvalidRequest(
                f"{where}.name: {upstream_name!r} is offered twice", f"{where}.name"
            )
        names[upstream_name] = Offered(namespace, name, custom)
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequest(
                f"{where}.description: must be a string, got {kind_of(description)}",
                f"{where}.description",
            )
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise InvalidRequest(
                f"{where}.parameters: must be an object, got {kind_of(parameters)}",
                f"{where}.parameters",
            )
        strict = tool.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequest(
                f"{where}.strict: must be a boolean, got {kind_of(strict)}", f"{where}.strict"
            )
        function: dict[str, Any] = {
            "name": upstream_name,
            "parameters": dict(parameters) if parameters else {"type": "object", "properties": {}},
        }
        if description:
            function["description"] = description
        if strict is not None:
            function["strict"] = strict
        out.append({"type": "function", "function": function})
        echo.append(
            {
                "type": "function",
                "name": upstream_name,
                "description": description,
                "parameters": function["parameters"],
                "strict": strict,
            }
        )

    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, Mapping):
            raise InvalidRequest(f"{where}: must be an object, got {kind_of(tool)}", where)
        kind = tool.get("type")
        if kind == "function":
            offer(tool, where, None)
        elif kind == "custom":
            offer(_as_function(tool, where), where, None, custom=True)
        elif kind == "namespace":
            namespace = _string(tool, "name", where)
            members = tool.get("tools")
            if not isinstance(members, list):
                raise InvalidRequest(
                    f"{where}.tools: must be an array, got {kind_of(members)}", f"{where}.tools"
                )
            for j, member in enumerate(members):
                if not isinstance(member, Mapping) or member.get("type", "function") != "function":
                    raise InvalidRequest(
                        f"{where}.tools.{j}: must be a function tool", f"{where}.tools.{j}"
                    )
                offer(member, f"{where}.tools.{j}", namespace)
        elif isinstance(kind, str) and (kind in HOSTED_TOOLS or kind.startswith("web_search")):
            continue
        else:
            raise InvalidRequest(
                f"{where}.type: tool type {kind_of(kind)} is not supported here (function, "
                "custom and namespace tools are; hosted tools are left out)",
                f"{where}.type",
            )
    return out, names, echo


def _as_function(tool: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A custom tool as the function it is offered as."""
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequest(
            f"{where}.description: must be a string, got {kind_of(description)}",
            f"{where}.description",
        )
    parts = [description] if description else []
    form = tool.get("format")
    if isinstance(form, Mapping) and form.get("type") == "grammar":
        syntax, definition = form.get("syntax"), form.get("definition")
        if isinstance(definition, str):
            parts.append(f"The input follows this {syntax} grammar:\n{definition}")
    return {"name": tool.get("name"), "description": "\n\n".join(parts), "parameters": INPUT_SCHEMA}


def _tool_choice(choice: Any, names: Mapping[str, Offered]) -> tuple[Any, set[str] | None]:
    """Chat's tool_choice, and the tools to offer where the choice narrows them."""
    if isinstance(choice, str) and choice in TOOL_CHOICES:
        return choice, None
    if not isinstance(choice, Mapping):
        raise InvalidRequest(
            "tool_choice: must be 'auto', 'none', 'required' or an object", "tool_choice"
        )
    kind = choice.get("type")
    flat = {(tool.namespace, tool.name): upstream for upstream, tool in names.items()}
    if kind in ("function", "custom"):
        name = _string(choice, "name", "tool_choice")
        namespace = choice.get("namespace")
        upstream_name = flat.get((namespace if isinstance(namespace, str) else None, name), name)
        if upstream_name not in names:
            raise InvalidRequest(
                f"tool_choice.name: {name!r} is not among the tools", "tool_choice.name"
            )
        return {"type": "function", "function": {"name": upstream_name}}, None
    if kind == "allowed_tools":
        mode = choice.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise InvalidRequest(
                f"tool_choice.mode: must be 'auto' or 'required', got {kind_of(mode)}",
                "tool_choice.mode",
            )
        allowed = choice.get("tools")
        if not isinstance(allowed, list):
            raise InvalidRequest(
                f"tool_choice.tools: must be an array, got {kind_of(allowed)}", "tool_choice.tools"
            )
        offered = set()
        for j, tool in enumerate(allowed):
            if isinstance(tool, Mapping) and tool.get("type") == "function":
                name = _string(tool, "name", f"tool_choice.tools.{j}")
                offered.add(flat.get((None, name), name))
        return mode, offered
    raise InvalidRequest(
        f"tool_choice.type: must be 'function' or 'allowed_tools' (hosted tools are not run "
        f"here), got {kind_of(kind)}",
        "tool_choice.type",
    )


def _echo_choice(choice: Any, tools: list[dict[str, Any]]) -> Any:
    if isinstance(choice, Mapping) and choice.get("type") == "function" and tools:
        return {"type": "function", "name": choice.get("name")}
    if isinstance(choice, str) and choice in TOOL_CHOICES:
        return choice
    return "auto"


def _reasoning(
    reasoning: Any, model: ModelConfig, out: dict[str, Any]
) -> tuple[dict[str, Any] | None, bool]:
    """Map `reasoning`; answer its echo and whether the client asked for reasoning."""
    if reasoning is None:
        return None, False
    if not isinstance(reasoning, Mapping):
        raise InvalidRequest(f"reasoning: must be an object, got {kind_of(reasoning)}", "reasoning")
    effort = reasoning.get("effort")
    if effort is not None and effort != "none" and effort not in EFFORTS:
        raise InvalidRequest(
            f"reasoning.effort: must be one of none, {', '.join(EFFORTS)}, got {kind_of(effort)}",
            "reasoning.effort",
        )
    summary = reasoning.get("summary")
    if summary not in (None, "auto", "concise", "detailed"):
        raise InvalidRequest(
            f"reasoning.summary: must be 'auto', 'concise' or 'detailed', got {kind_of(summary)}",
            "reasoning.summary",
        )
    if effort in EFFORTS and model.map_effort:
        out["reasoning_effort"] = EFFORTS[effort]
    if effort is not None and model.map_thinking:
        out["chat_template_kwargs"] = {"enable_thinking": effort != "none"}
    return {"effort": effort, "summary": summary}, effort != "none"


def _text_config(text: Any, out: dict[str, Any]) -> dict[str, Any]:
    """Map `text.format` to chat's `response_format`; answer the `text` the response echoes
    (a JSON schema's own body is echoed as null, as Open Responses defines it)."""
    if text is None:
        return {"format": {"type": "text"}}
    if not isinstance(text, Mapping):
        raise InvalidRequest(f"text: must be an object, got {kind_of(text)}", "text")
    echo: dict[str, Any] = {}
    verbosity = text.get("verbosity")
    if verbosity is not None:
        if verbosity not in ("low", "medium", "high"):
            raise InvalidRequest(
                f"text.verbosity: must be 'low', 'medium' or 'high', got {kind_of(verbosity)}",
                "text.verbosity",
            )
        echo["verbosity"] = verbosity
    form = text.get("format") or {"type": "text"}
    if not isinstance(form, Mapping):
        raise InvalidRequest(f"text.format: must be an object, got {kind_of(form)}", "text.format")
    kind = form.get("type")
    if kind == "text":
        echo["format"] = {"type": "text"}
    elif kind == "json_object":
        out["response_format"] = {"type": "json_object"}
        echo["format"] = {"type": "json_object"}
    elif kind == "json_schema":
        name = _string(form, "name", "text.format")
        schema = form.get("schema")
        if not isinstance(schema, Mapping):
            raise InvalidRequest(
                f"text.format.schema: must be an object, got {kind_of(schema)}",
                "text.format.schema",
            )
        strict = form.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequest(
                f"text.format.strict: must be a boolean, got {kind_of(strict)}",
                "text.format.strict",
            )
        description = form.get("description")
        json_schema: dict[str, Any] = {"name": name, "schema": dict(schema)}
        if strict is not None:
            json_schema["strict"] = strict
        if isinstance(description, str):
            json_schema["description"] = description
        out["response_format"] = {"type": "json_schema", "json_schema": json_schema}
        echo["format"] = {
            "type": "json_schema",
            "name": name,
            "description": description if isinstance(description, str) else None,
            "schema": None,
            "strict": bool(strict),
        }
    else:
        raise InvalidRequest(
            f"text.format.type: must be 'text', 'json_object' or 'json_schema', got "
            f"{kind_of(kind)}",
            "text.format.type",
        )
    return echo


def _part_type(part: Any, where: str) -> str:
    if not isinstance(part, Mapping):
        raise InvalidRequest(f"{where}: must be an object, got {kind_of(part)}", where)
    kind = part.get("type")
    if not isinstance(kind, str):
        raise InvalidRequest(
            f"{where}.type: must be a string, got {kind_of(kind)}", f"{where}.type"
        )
    return kind


def _string(item: Mapping[str, Any], key: str, where: str, *, empty: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not empty and not value):
        wanted = "a string" if empty else "a non-empty string"
        raise InvalidRequest(
            f"{where}.{key}: must be {wanted}, got {kind_of(value)}", f"{where}.{key}"
        )
    return value


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(24)


INCOMPLETE = {"max_tokens": "max_output_tokens", "refusal": "content_filter"}
"""The translator's stop reasons that leave a response incomplete, and the reason it says."""


class ResponseStream:
    """The translator's block events in, Responses events out, numbered from 0.

    A queued stream starts with `queue_frame` (`response.created`, then `response.queued` at
    each new place); `begin` says its slot came (`response.in_progress`), and `feed` takes the
    translator's events from there. After `completed`, `incomplete` or `failed` every call
    returns nothing. `response()` is the final object, the whole answer of a request that did
    not stream.
    """

    def __init__(
        self, request: ResponsesRequest, *, response_id: str, now: Callable[[], float]
    ) -> None:
        self.request = request
        self.id = response_id
        self.now = now  # for `created_at` and `completed_at`
        self.created_at = int(now())
        self.completed_at: int | None = None
        self.status: str | None = None  # what the client was last told; None: nothing yet
        self._sequence = 0
        self._output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._index = -1  # its place in the output
        self._parts: list[str] = []  # its text or arguments so far
        self._closing = False  # its block ended: its `done` events wait for the stop reason
        self._queued: orjson.Fragment | None = None  # the queued response, made once
        self._calls: set[str] = set()  # call ids given in this answer
        self._reasoning_deltas = 0
        self._usage: dict[str, Any] | None = None
        self._stop_reason: str | None = None
        self.error: dict[str, str] | None = None

    @property
    def over(self) -> bool:
        return self.status in ("completed", "incomplete", "failed")

    def call_id(self, upstream_id: Any) -> str:
        """The call id of a new tool call: the upstream's, unless it has none or it repeats
        one of the conversation's (some servers number their calls from 0 every turn)."""
        taken = self.request.call_ids
        if isinstance(upstream_id, str) and upstream_id not in taken | self._calls | {""}:
            self._calls.add(upstream_id)
            return upstream_id
        call_id = "call_" + secrets.token_hex(12)
        self._calls.add(call_id)
        return call_id

    def queue_frame(self, position: int, estimate: float | None) -> bytes:
        """The frames that tell a waiting stream its place, with `response.created` first."""
        events = []
        if self.status is None:
            self.status = "queued"
            events.append(self._lifecycle("response.created"))
        if self._queued is None:
            self._queued = orjson.Fragment(self._response())
        queue: dict[str, Any] = {"type": "queue", "position": position}
        if estimate is not None:
            queue["estimated_wait_s"] = round(estimate, 1)
        events.append(self._event("response.queued", response=self._queued, queue=queue))
        return b"".join(map(encode_event, events))

    def begin(self) -> list[Event]:
        """The slot came: `response.in_progress` (after `response.created`, if not yet sent)."""
        if self.status not in (None, "queued"):
            return []
        events = []
        if self.status is None:
            self.status = "in_progress"
            events.append(self._lifecycle("response.created"))
        self.status, self._queued = "in_progress", None
        events.append(self._lifecycle("response.in_progress"))
        return events

    def feed(self, events: list[Event]) -> list[Event]:
        """The Responses events for a batch of the translator's events."""
        out: list[Event] = []
        for event in events:
            if self.over:
                break
            kind = event["type"]
            if self._closing and kind != "message_delta":
                out += self._close("completed")
            if kind == "content_block_delta":
                self._delta(event["delta"], out)
            elif kind == "content_block_start":
                out += self._start(event["content_block"])
            elif kind == "content_block_stop":
                self._closing = True
            elif kind == "message_start":
                out += self.begin()
            elif kind == "message_delta":
                self._stop_reason = event["delta"]["stop_reason"]
                self._usage = event["usage"]
                if self._closing:
                    out += self._close(
                        "incomplete" if self._stop_reason in INCOMPLETE else "completed"
                    )
            elif kind == "message_stop":
                out += self._finish()
            elif kind == "error":
                # Codex retries a `server_error`, and not `server_is_overloaded`: an upstream
                # that broke off or aborted may well answer the next time.
                out += self.fail("server_error", event["error"]["message"])
        return out

    def fail(self, code: str, message: str) -> list[Event]:
        """`response.failed`, never a response that looks whole: the item cut off stays
        `incomplete`, with what it had."""
        if self.over:
            return []
        events = []
        if self.status is None:  # the stream starts as every stream does
            self.status = "in_progress"
            events.append(self._lifecycle("response.created"))
        if self._open is not None:
            self._settle("incomplete")
        self.error = {"code": code, "message": message}
        self.status = "failed"
        return [*events, self._lifecycle("response.failed")]

    def response(self) -> bytes:
        """The response object as JSON: the answer of a request that did not stream."""
        return self._response()

    def _start(self, block: Event) -> list[Event]:
        kind = block["type"]
        if kind == "text":
            item = {
                "type": "message",
                "id": "msg_" + secrets.token_hex(16),
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        elif kind == "thinking":
            item = {
                "type": "reasoning",
                "id": "rs_" + secrets.token_hex(16),
                "summary": [],
                "content": [],
            }
            part = {"type": "reasoning_text", "text": ""}
        else:
            tool = self.request.names.get(block["name"]) or Offered(None, block["name"])
            item = {
                "type": "custom_tool_call" if tool.custom else "function_call",
                "id": ("ctc_" if tool.custom else "fc_") + secrets.token_hex(16),
                "call_id": block["id"],
                "name": tool.name,
                "input" if tool.custom else "arguments": "",
                "status": "in_progress",
            }
            if tool.namespace is not None:
                item["namespace"] = tool.namespace
            part = None
        self._open, self._parts = item, []
        self._output.append(item)
        index = self._index = len(self._output) - 1
        events = [self._event("response.output_item.added", output_index=index, item=dict(item))]
        if part is not None:
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        return events

    def _delta(self, delta: Event, out: list[Event]) -> None:
        """One delta's event: this runs once per token, so it builds the event in one go."""
        item = self._open
        assert item is not None
        kind = delta["type"]
        if kind == "text_delta":
            text = delta["text"]
            fields = {"delta": text, "logprobs": []}
            name = "response.output_text.delta"
        elif kind == "thinking_delta":
            text = delta["thinking"]
            self._reasoning_deltas += 1
            fields = {"delta": text}
            name = "response.reasoning_text.delta"
        elif kind == "input_json_delta":
            text = delta["partial_json"]
            self._parts.append(text)
            if item["type"] != "custom_tool_call":  # its input comes whole, at the end
                out.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=self._index,
                        delta=text,
                    )
                )
            return
        else:
            return  # a thinking block's (empty) signature: no upstream signs its reasoning
        self._parts.append(text)
        number = self._sequence
        self._sequence = number + 1
        out.append(
            {
                "type": name,
                "sequence_number": number,
                "item_id": item["id"],
                "output_index": self._index,
                "content_index": 0,
                **fields,
            }
        )

    def _settle(self, status: str) -> str:
        """Put the open item's text in it; answer that text."""
        item = self._open
        assert item is not None
        self._open, self._closing = None, False
        text = "".join(self._parts)
        self._parts = []
        if item["type"] == "function_call":
            item["arguments"], item["status"] = text or "{}", status
            return item["arguments"]
        if item["type"] == "custom_tool_call":
            item["input"], item["status"] = _custom_input(text), status
            return item["input"]
        if item["type"] == "message":
            item["status"] = status
            item["content"] = [
                {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            ]
        else:
            item["content"] = [{"type": "reasoning_text", "text": text}]
        return text

    def _close(self, status: str) -> list[Event]:
        """The `done` events of the item whose block ended."""
        item = self._open
        assert item is not None
        text = self._settle(status)
        index = self._index
        events: list[Event] = []
        if item["type"] == "custom_tool_call":
            events.append(
                self._event(
                    "response.custom_tool_call_input.done",
                    item_id=item["id"],
                    output_index=index,
                    input=text,
                )
            )
        elif item["type"] == "function_call":
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=text,
                )
            )
        else:
            done = (
                "response.output_text.done"
                if item["type"] == "message"
                else "response.reasoning_text.done"
            )
            fields: dict[str, Any] = {"logprobs": []} if item["type"] == "message" else {}
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append(self._event(done, **where, text=text, **fields))
            events.append(
                self._event("response.content_part.done", **where, part=item["content"][0])
            )
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def _finish(self) -> list[Event]:
        reason = INCOMPLETE.get(self._stop_reason or "")
        self.status = "completed" if reason is None else "incomplete"
        self.completed_at = int(self.now())
        return [self._lifecycle("response.completed" if reason is None else "response.incomplete")]

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _lifecycle(self, kind: str) -> Event:
        return self._event(kind, response=orjson.Fragment(self._response()))

    def _response(self) -> bytes:
        status = self.status or "in_progress"
        over = self.over
        reason = INCOMPLETE.get(self._stop_reason or "") if status == "incomplete" else None
        fields = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": self.completed_at,
            "model": self.request.packed.model,
            "output": list(self._output) if over else [],
            "error": self.error,
            "incomplete_details": {"reason": reason} if reason else None,
            "usage": self._usage_object() if over else None,
        }
        return orjson.dumps(fields)[:-1] + b"," + self.request.echo[1:]

    def _usage_object(self) -> dict[str, Any] | None:
        usage = self._usage
        if usage is None:
            return None
        cached = usage["cache_read_input_tokens"]
        prompt = usage["input_tokens"] + usage["cache_creation_input_tokens"] + cached
        output = usage["output_tokens"]
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": min(self._reasoning_deltas, output)},
            "total_tokens": prompt + output,
        }


def _custom_input(arguments: str) -> str:
    """A custom tool's input, from the arguments of the function it was offered as; a model
    that wrote something else gets it passed on as it is."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return value["input"]
    return arguments
