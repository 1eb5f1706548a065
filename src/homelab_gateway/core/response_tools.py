"""The tools of a Responses request as chat's `tools` and `tool_choice` take them: functions,
custom (freeform) tools as functions of one string, namespaces flattened; OpenAI's hosted
tools left out."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from homelab_gateway.core.fields import InvalidRequest, kind_of, string

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
"""Tools OpenAI runs, or that only OpenAI's models are trained to call in its own format (a
shell, `apply_patch` as a built-in): they are dropped from the request (Codex always offers
`web_search`) rather than refused."""
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


def offered_tools(
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
        name = string(tool, "name", where, nonempty=True)
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
            namespace = string(tool, "name", where, nonempty=True)
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


def tool_choice(
    choice: Any, flat: Mapping[tuple[str | None, str], str]
) -> tuple[Any, set[str] | None, Any]:
    """Chat's tool_choice, the upstream names to offer where the choice narrows them
    (`allowed_tools`), and the choice as the response echoes it."""
    if choice is None:
        return None, None, "auto"
    if isinstance(choice, str) and choice in TOOL_CHOICES:
        return choice, None, choice
    if not isinstance(choice, Mapping):
        raise InvalidRequest(
            "tool_choice: must be 'auto', 'none', 'required' or an object", "tool_choice"
        )
    kind = choice.get("type")
    if kind in ("function", "custom"):
        name = _offered(choice, "tool_choice", flat)
        return {"type": "function", "function": {"name": name}}, None, _named(name)
    if kind == "allowed_tools":
        mode = choice.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise InvalidRequest(
                f"tool_choice.mode: must be 'auto' or 'required', got {kind_of(mode)}",
                "tool_choice.mode",
            )
        allowed = choice.get("tools")
        if not isinstance(allowed, list) or not allowed:
            raise InvalidRequest(
                f"tool_choice.tools: must be a non-empty array, got {kind_of(allowed)}",
                "tool_choice.tools",
            )
        names = [_offered(tool, f"tool_choice.tools.{j}", flat) for j, tool in enumerate(allowed)]
        echo = {"type": "allowed_tools", "mode": mode, "tools": [_named(n) for n in names]}
        return mode, set(names), echo
    raise InvalidRequest(
        f"tool_choice.type: must be 'function', 'custom' or 'allowed_tools' (hosted tools are "
        f"not run here), got {kind_of(kind)}",
        "tool_choice.type",
    )


def _offered(entry: Any, where: str, flat: Mapping[tuple[str | None, str], str]) -> str:
    """The upstream name of the tool a choice names: one the request offers."""
    if not isinstance(entry, Mapping) or entry.get("type") not in ("function", "custom"):
        raise InvalidRequest(f"{where}: must name a function or custom tool", where)
    name = string(entry, "name", where, nonempty=True)
    namespace = entry.get("namespace")
    upstream_name = flat.get((namespace if isinstance(namespace, str) else None, name))
    if upstream_name is None:
        raise InvalidRequest(f"{where}.name: {name!r} is not among the tools", f"{where}.name")
    return upstream_name


def _named(name: str) -> dict[str, str]:
    """A named tool, as a response's `tool_choice` says it (the name the model sees, as the
    echoed tools say it too)."""
    return {"type": "function", "name": name}
