"""System messages placed where chat templates take them: one, first.

The chat templates of Qwen3.5 and the Llama, Gemma and Mistral families refuse a system
message anywhere but first ("System message must be at the beginning"), and Gemma's and older
Mistral's want user and assistant turns to alternate. Clients send instructions mid-conversation
all the same (Claude Code appends a `role: "system"` message on most turns, Codex a developer
item), so `first_only` keeps the system messages that open the conversation as one leading
message and folds each later one into the turn beside it, marked, as vLLM's own Anthropic
endpoint folds them: only the conversation's end changes from one turn to the next, so the
upstream's prefix cache still holds every earlier turn.
"""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]
SYSTEM_ROLES = ("system", "developer")
"""Both are instructions: OpenAI's newer clients say "developer", which templates refuse too."""


def marked(text: str) -> str:
    """An instruction's text as it stands inside a user or tool turn."""
    return f"<instruction>\n{text}\n</instruction>"


def first_only(messages: list[Message]) -> list[Message]:
    """`messages` (chat completions' shape) with at most one system message, first.

    A later system message joins the user or tool turn before it; after an assistant turn (or
    at the start) it opens the next user turn, or becomes a user turn of its own where none
    follows, so no two user turns ever stand together. It never comes between an assistant's
    tool calls and their results: the results come first. Messages are copied where changed,
    never changed in place."""
    leading = 0
    while leading < len(messages) and messages[leading]["role"] in SYSTEM_ROLES:
        leading += 1
    if all(m["role"] not in SYSTEM_ROLES for m in messages[leading:]):
        return _joined(messages[:leading]) + messages[leading:]
    out: list[Message] = _joined(messages[:leading])
    opened = len(out)  # out[opened:] are the conversation's turns
    pending: list[str] = []  # instructions waiting for the next user turn
    for message in messages[leading:]:
        role = message["role"]
        if role in SYSTEM_ROLES:
            text = _text(message.get("content"))
            if not text:
                continue
            if len(out) > opened and out[-1]["role"] in ("user", "tool") and not pending:
                out[-1] = _with_text(out[-1], marked(text), at_end=True)
            else:
                pending.append(text)
            continue
        if pending and role == "user":
            message = _with_text(message, _marks(pending), at_end=False)
            pending = []
        elif pending and role != "tool":
            _place(out, opened, pending)
            pending = []
        out.append(message)
    if pending:
        _place(out, opened, pending)
    return out


def _place(out: list[Message], opened: int, pending: list[str]) -> None:
    """Pending instructions where no user turn follows: after a run of tool results they join
    the last result, else they are a user turn of their own."""
    if len(out) > opened and out[-1]["role"] == "tool":
        out[-1] = _with_text(out[-1], _marks(pending), at_end=True)
    else:
        out.append({"role": "user", "content": _marks(pending)})


def _marks(texts: list[str]) -> str:
    return "\n\n".join(marked(text) for text in texts)


def _joined(system: list[Message]) -> list[Message]:
    """The system messages that open a conversation as one, or none where all are empty."""
    if len(system) == 1 and system[0]["role"] == "system":
        return list(system)
    text = "\n\n".join(t for t in (_text(m.get("content")) for m in system) if t)
    return [{"role": "system", "content": text}] if text else []


def _text(content: Any) -> str:
    """A system message's text: chat completions take a string or an array of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _with_text(message: Message, text: str, *, at_end: bool) -> Message:
    """A copy of `message` with `text` joined at one end of its content: into the text part
    there, since some templates join parts without a separator, else as a part of its own."""
    content = message.get("content")
    if content is None or isinstance(content, str):
        old = content or ""
        new: Any = (old + "\n\n" + text if at_end else text + "\n\n" + old) if old else text
    else:
        parts = list(content)
        end = -1 if at_end else 0
        if parts and isinstance(parts[end], dict) and parts[end].get("type") == "text":
            old = parts[end].get("text") or ""
            joined = (old + "\n\n" + text if at_end else text + "\n\n" + old) if old else text
            parts[end] = {**parts[end], "text": joined}
        else:
            parts.insert(len(parts) if at_end else 0, {"type": "text", "text": text})
        new = parts
    return {**message, "content": new}
