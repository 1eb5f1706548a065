"""OpenAI Responses requests in, chat-completions requests out, with no I/O (the answer's
events are `response_stream`'s).

The gateway keeps no state: the whole conversation comes in `input` every turn (Codex resends
it), so `previous_response_id` and `conversation` are refused by name. Each request is mapped
once, validated as it goes, so a 400 names the exact item (`input.3.call_id: ...`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from homelab_gateway.config import ModelConfig
from homelab_gateway.core.fields import (
    OUTPUT_LIMITS,
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
from homelab_gateway.core.mapping import (
    MappedRequest,
    PackedRequest,
    estimate_tokens,
    merge,
    request_model,
)
from homelab_gateway.core.response_tools import Offered, offered_tools, tool_choice
from homelab_gateway.core.text import dumps, replace_lone_surrogates

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
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
    }
)
"""History items of those tools, and `reasoning`: the upstream takes none of them back."""
STATELESS = ("previous_response_id", "conversation", "prompt")
"""Fields that name something stored on the server: this gateway stores nothing."""
EFFORTS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}
"""Each effort as chat's `reasoning_effort` takes it."""


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
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest(f"stream: must be a boolean, got {kind_of(stream)}", "stream")

    tools, names, echo_tools = offered_tools(body.get("tools"))
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
    if _optional(body, "top_logprobs", is_int, "an integer >= 0", least=0):
        raise InvalidRequest("top_logprobs: log probabilities are not served here", "top_logprobs")
    choice, offered, echo_choice = tool_choice(body.get("tool_choice"), flat)
    if offered is not None:
        tools = [tool for tool in tools if tool["function"]["name"] in offered]
    if tools:
        out["tools"] = tools
        if choice is not None:
            out["tool_choice"] = choice
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest(
            f"parallel_tool_calls: must be a boolean, got {kind_of(parallel)}",
            "parallel_tool_calls",
        )
    if tools and parallel is not None:
        out["parallel_tool_calls"] = parallel
    reasoning, asked = _reasoning(body.get("reasoning"), model, out)
    text = _text_config(body.get("text"), out)
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise InvalidRequest(f"metadata: must be an object, got {kind_of(metadata)}", "metadata")

    out["stream"] = True  # always: one translation path, and idle/cancel work mid-generation
    out["stream_options"] = usage_options(continuous_usage_stats)
    upstream = merge(model.params, out)
    cap_output(upstream, model.max_tokens, absent_is_unbounded=True)

    keys = {name: body.get(name) for name in ("prompt_cache_key", "safety_identifier", "user")}
    echo = {
        "instructions": instructions,
        "tools": echo_tools,
        "tool_choice": echo_choice if tools else "auto",
        "parallel_tool_calls": parallel if parallel is not None else True,
        "reasoning": reasoning,
        "text": text,
        "metadata": dict(metadata or {}),
        **_echo(body, upstream, keys),
    }
    mapped = MappedRequest(
        model=replace_lone_surrogates(client_model),
        stream=bool(stream),
        body=upstream,
        stop_sequences=(),
        estimated_input_tokens=estimate_tokens(messages, tools),
        show_reasoning=model.show_reasoning == "always" or asked,
    )
    session = next((v for v in keys.values() if isinstance(v, str) and v), None)
    return ResponsesRequest(
        mapped.packed(), dumps(_clean(echo)), names, frozenset(call_ids), session
    )


def _echo(
    body: Mapping[str, Any], upstream: Mapping[str, Any], keys: Mapping[str, Any]
) -> dict[str, Any]:
    """The response's fields that repeat the request's settings: the values that apply (the
    model's `params` and its cap included), and the specification's defaults elsewhere."""
    limit = next((upstream[n] for n in OUTPUT_LIMITS if is_int(upstream.get(n))), None)
    tier = body.get("service_tier")
    echo = {
        "max_output_tokens": limit,
        "max_tool_calls": body["max_tool_calls"] if is_int(body.get("max_tool_calls")) else None,
        "temperature": upstream.get("temperature", 1.0),
        "top_p": upstream.get("top_p", 1.0),
        "presence_penalty": upstream.get("presence_penalty", 0.0),
        "frequency_penalty": upstream.get("frequency_penalty", 0.0),
        "top_logprobs": 0,
        "truncation": "auto" if body.get("truncation") == "auto" else "disabled",
        "store": False,  # accepted, and never true: nothing is stored
        "background": False,
        "service_tier": tier if isinstance(tier, str) else "default",
        "safety_identifier": _string_or_none(keys["safety_identifier"]),
        "prompt_cache_key": _string_or_none(keys["prompt_cache_key"]),
        "previous_response_id": None,
    }
    if isinstance(keys["user"], str):
        echo["user"] = keys["user"]
    return echo


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

    `instructions` and every system and developer message go as system messages in order,
    which `first_only` makes into what chat templates take: one system message, first, with
    later ones folded into the turns beside them. Chat wants a call's results right after the
    message that made it: assistant text (or an instruction's item) that comes between a call
    and its output does not end that message, and images a tool returned follow all its
    results."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list):
        raise InvalidRequest(
            f"input: must be a string or an array of items, got {kind_of(items)}", "input"
        )
    out: list[dict[str, Any]] = (
        [{"role": "system", "content": instructions}] if instructions else []
    )
    calls: set[str] = set()  # every call id so far
    unanswered: set[str] = set()  # the calls of `holder` with no output yet
    holder: dict[str, Any] | None = None  # the assistant message the next call joins
    images: list[dict[str, Any]] = []  # what the tools returned, after their results

    def add(message: dict[str, Any]) -> None:
        nonlocal holder
        if images:
            out.append({"role": "user", "content": images[:]})
            images.clear()
        out.append(message)
        holder = message if message["role"] == "assistant" else None

    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, Mapping):
            raise InvalidRequest(f"{where}: must be an object, got {kind_of(item)}", where)
        kind = item.get("type", "message")
        if not isinstance(kind, str):
            raise InvalidRequest(
                f"{where}.type: must be a string, got {kind_of(kind)}", f"{where}.type"
            )
        if kind in HOSTED_ITEMS or kind == "reasoning":
            continue
        if kind == "message":
            role = item.get("role")
            if role in ("system", "developer"):
                text = _text_content(item.get("content"), f"{where}.content")
                out.append({"role": "system", "content": text})  # no turn: calls go on
            elif role == "assistant":
                text = _text_content(item.get("content"), f"{where}.content", assistant=True)
                if holder is not None and unanswered:
                    holder["content"] = (holder["content"] or "") + text
                else:
                    add({"role": "assistant", "content": text})
            elif role == "user":
                add({"role": "user", "content": _user_content(item.get("content"), where)})
            else:
                raise InvalidRequest(
                    f"{where}.role: must be 'user', 'assistant', 'system' or 'developer', "
                    f"got {kind_of(role)}",
                    f"{where}.role",
                )
        elif kind in ("function_call", "custom_tool_call"):
            call_id = string(item, "call_id", where, nonempty=True)
            if call_id in calls:
                raise InvalidRequest(
                    f"{where}.call_id: {call_id!r} is used by an earlier call", f"{where}.call_id"
                )
            calls.add(call_id)
            name = string(item, "name", where, nonempty=True)
            namespace = item.get("namespace")
            upstream_name = flat.get((namespace if isinstance(namespace, str) else None, name))
            if kind == "custom_tool_call":
                arguments = dumps({"input": string(item, "input", where)}).decode()
            else:
                arguments = _arguments(item.get("arguments", ""), f"{where}.arguments")
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": upstream_name or name, "arguments": arguments},
            }
            if holder is None or (holder is not out[-1] and not unanswered):
                add({"role": "assistant", "content": None})
                unanswered.clear()
            assert holder is not None
            holder.setdefault("tool_calls", []).append(call)
            holder["content"] = holder["content"] or None
            unanswered.add(call_id)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = string(item, "call_id", where, nonempty=True)
            if call_id not in calls:
                raise InvalidRequest(
                    f"{where}.call_id: {call_id!r} answers no function_call before it",
                    f"{where}.call_id",
                )
            text, returned = _output_content(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
            images.extend(returned)  # a tool message carries text only
            unanswered.discard(call_id)
        else:
            raise InvalidRequest(
                f"{where}.type: item type {kind!r} is not supported here (this gateway keeps no "
                "state, and runs no hosted tools)",
                f"{where}.type",
            )
    if images:
        out.append({"role": "user", "content": images})
    if not any(message["role"] != "system" for message in out):
        raise InvalidRequest("input: holds no user or assistant message", "input")
    return first_only(out), calls


def _arguments(arguments: Any, where: str) -> str:
    """A past call's arguments for the upstream, which parses them (vLLM renders them into
    its chat template): where they are no JSON object (a call cut short, a model's slip),
    they go as one, holding the text, so the conversation can still go on."""
    if not isinstance(arguments, str):
        raise InvalidRequest(f"{where}: must be a string of JSON, got {kind_of(arguments)}", where)
    if not arguments:
        return "{}"
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        value = None
    if isinstance(value, dict):
        return arguments
    return dumps({"unparsed_arguments": arguments}).decode()


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
        kind = typed(part, f"{where}.{j}")
        if kind in ("input_text", "output_text", "text"):
            texts.append(string(part, "text", f"{where}.{j}"))
        elif kind == "refusal" and assistant:
            texts.append(string(part, "refusal", f"{where}.{j}"))
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
    kind = typed(part, where)
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": string(part, "text", where)}
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
    url = string(part, "image_url", where, nonempty=True)
    if url.startswith("data:"):
        header, _, data = url.partition(",")
        if not header.endswith(";base64") or not header.startswith("data:image/"):
            raise InvalidRequest(
                f"{where}.image_url: a data URL must be data:image/...;base64,...",
                f"{where}.image_url",
            )
        check_base64(data, f"{where}.image_url")
    elif not url.startswith(("http://", "https://")):
        raise InvalidRequest(
            f"{where}.image_url: must be an http(s) or data URL", f"{where}.image_url"
        )
    return image_part(url, part.get("detail"))


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


def _reasoning(
    reasoning: Any, model: ModelConfig, out: dict[str, Any]
) -> tuple[dict[str, Any] | None, bool]:
    """Map `reasoning`; answer its echo and whether the client asked for reasoning."""
    if reasoning is None:
        return None, False
    if not isinstance(reasoning, Mapping):
        raise InvalidRequest(f"reasoning: must be an object, got {kind_of(reasoning)}", "reasoning")
    effort = reasoning.get("effort")
    if effort is not None and (not isinstance(effort, str) or effort not in {*EFFORTS, "none"}):
        raise InvalidRequest(
            f"reasoning.effort: must be one of none, {', '.join(EFFORTS)}, got {kind_of(effort)}",
            "reasoning.effort",
        )
    summary = reasoning.get("summary")
    if summary is not None and summary not in ("auto", "concise", "detailed"):
        raise InvalidRequest(
            f"reasoning.summary: must be 'auto', 'concise' or 'detailed', got {kind_of(summary)}",
            "reasoning.summary",
        )
    if effort in EFFORTS and model.map_effort:
        out["reasoning_effort"] = EFFORTS[effort]
    if effort is not None and model.map_thinking:
        out["chat_template_kwargs"] = {"enable_thinking": effort != "none"}
    # The specification's efforts have no "minimal": it is echoed as the "low" it runs as.
    echoed = "low" if effort == "minimal" else effort
    return {"effort": echoed, "summary": summary}, effort != "none"


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
        name = string(form, "name", "text.format", nonempty=True)
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
