"""`instructions.first_only`: what chat templates refuse never reaches them, and no instruction
is lost on the way."""

from __future__ import annotations

import itertools
import re
from typing import Any

import jinja2
from hypothesis import given
from hypothesis import strategies as st

from homelab_gateway.core.instructions import first_only, marked

# The refusals of the strict templates, in their own words: Qwen3.5's ("System message must be
# at the beginning") and Mistral's (after the optional system message, user and assistant
# alternate, tool calls and their results aside), rendered by jinja as vLLM renders them.
STRICT_TEMPLATE = """
{%- for message in messages %}
  {%- if message.role in ["system", "developer"] and not loop.first %}
    {{- raise_exception("System message must be at the beginning.") }}
  {%- endif %}
{%- endfor %}
{%- set turns = [] %}
{%- for message in messages if message.role not in ["system", "tool"] and not message.tool_calls %}
  {%- set turns = turns.append(message) %}
{%- endfor %}
{%- for message in turns %}
  {%- if (message.role == "user") != (loop.index0 % 2 == 0) %}
    {{- raise_exception("After the optional system message, conversation roles must alternate "
                        "user/assistant/user/assistant/...") }}
  {%- endif %}
{%- endfor %}
{%- for message in messages %}[{{ message.role }}]{{ message.content if message.content is string
  else message.content | map(attribute="text") | join }}
{% endfor %}"""


class Refused(Exception):
    pass


def raise_exception(text: str) -> None:
    raise Refused(text)


environment = jinja2.Environment()
environment.globals["raise_exception"] = raise_exception
strict = environment.from_string(STRICT_TEMPLATE)


def render(messages: list[dict[str, Any]]) -> str:
    return strict.render(messages=messages)


CALL = {"id": "call_000000001", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def test_claude_codes_mid_conversation_reminder_is_refused_as_sent_and_taken_folded() -> None:
    sent = [
        {"role": "system", "content": "You are Claude Code."},
        {"role": "user", "content": "fix the bug"},
        {"role": "assistant", "content": "Which file?"},
        {"role": "system", "content": "The user opened a.py."},
        {"role": "user", "content": "a.py"},
    ]
    try:
        render(sent)
    except Refused as e:
        assert "at the beginning" in str(e)
    else:
        raise AssertionError("the strict template took a system message mid-conversation")
    folded = first_only(sent)
    assert folded[:3] == sent[:3]
    assert folded[3] == {
        "role": "user",
        "content": marked("The user opened a.py.") + "\n\na.py",
    }
    assert len(folded) == 4
    render(folded)


def test_an_instruction_after_a_user_turn_joins_it_at_its_end() -> None:
    folded = first_only(
        [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "developer", "content": "be brief"},
            {"role": "assistant", "content": "hello"},
        ]
    )
    assert folded == [
        {"role": "user", "content": [{"type": "text", "text": "hi\n\n" + marked("be brief")}]},
        {"role": "assistant", "content": "hello"},
    ]


def test_the_opening_system_and_developer_messages_become_one() -> None:
    assert first_only(
        [
            {"role": "developer", "content": "a"},
            {"role": "system", "content": [{"type": "text", "text": "b"}]},
            {"role": "user", "content": "hi"},
        ]
    ) == [{"role": "system", "content": "a\n\nb"}, {"role": "user", "content": "hi"}]


def test_an_instruction_never_separates_a_call_from_its_results() -> None:
    sent = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "system", "content": "mind the time"},
        {"role": "tool", "tool_call_id": CALL["id"], "content": "done"},
        {"role": "assistant", "content": "finished"},
    ]
    folded = first_only(sent)
    assert folded[:2] == sent[:2]
    assert folded[2] == {
        "role": "tool",
        "tool_call_id": CALL["id"],
        "content": "done\n\n" + marked("mind the time"),
    }
    assert folded[3:] == sent[4:]
    render(folded)


def test_a_system_message_without_content_is_an_empty_instruction() -> None:
    """Chat completions pass a client's messages unchecked: one with no `content` at all is
    an instruction with no text, as null content is, not a KeyError."""
    assert first_only(
        [
            {"role": "system"},
            {"role": "developer", "content": "d"},
            {"role": "user", "content": "hi"},
            {"role": "system"},
        ]
    ) == [{"role": "system", "content": "d"}, {"role": "user", "content": "hi"}]


def test_a_trailing_instruction_after_an_answer_is_a_user_turn() -> None:
    folded = first_only(
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "system", "content": "now summarise"},
        ]
    )
    assert folded[-1] == {"role": "user", "content": marked("now summarise")}
    render(folded)


def test_a_conversation_without_late_instructions_is_the_same_list_of_the_same_messages() -> None:
    sent = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    folded = first_only(sent)
    assert folded == sent
    assert all(a is b for a, b in zip(folded, sent, strict=True))


# Conversations as clients write them: turns that alternate (an assistant's tool calls followed
# by their results), with instructions anywhere.
texts = st.text(alphabet="abcxyz", min_size=1, max_size=8)
parts = st.lists(st.builds(lambda t: {"type": "text", "text": t}, texts), min_size=1, max_size=2)
contents = st.one_of(texts, parts)


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    instruction = st.builds(
        lambda role, content: {"role": role, "content": content},
        st.sampled_from(["system", "developer"]),
        contents,
    )
    messages: list[dict[str, Any]] = draw(st.lists(instruction, max_size=2))
    for turn in range(draw(st.integers(1, 6))):
        messages += draw(st.lists(instruction, max_size=2))
        if turn % 2 == 0:
            messages.append({"role": "user", "content": draw(contents)})
        elif draw(st.booleans()):
            calls = [{**CALL, "id": f"call_{turn:09d}"}]
            messages.append({"role": "assistant", "content": None, "tool_calls": calls})
            messages += draw(st.lists(instruction, max_size=1))
            messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": "out"})
            messages += draw(st.lists(instruction, max_size=1))
            messages.append({"role": "assistant", "content": draw(contents)})
        else:
            messages.append({"role": "assistant", "content": draw(contents)})
    messages += draw(st.lists(instruction, max_size=2))
    return messages


def text_of(message: dict[str, Any]) -> str:
    content = message["content"]
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


@given(conversations())
def test_the_strict_template_takes_every_folded_conversation(sent: list[dict[str, Any]]) -> None:
    folded = first_only(sent)
    render(folded)
    roles = [m["role"] for m in folded]
    assert "developer" not in roles
    assert "system" not in roles[1:]
    assert all(not (a == b == "user") for a, b in itertools.pairwise(roles))


@given(conversations())
def test_every_instruction_reaches_the_model_in_order(sent: list[dict[str, Any]]) -> None:
    folded = first_only(sent)
    late = []
    opening = True
    for message in sent:
        if message["role"] in ("system", "developer"):
            if not opening:
                late.append(marked(text_of(message)))
        else:
            opening = False
    rendered = "\n".join(text_of(m) for m in folded if m["role"] != "system")
    at = 0
    for text in late:
        at = rendered.index(text, at) + len(text)


def without_marks(text: str) -> str:
    return re.sub(r"<instruction>\n.*?\n</instruction>", "", text, flags=re.S).strip()


@given(conversations())
def test_the_other_messages_keep_their_order_and_their_own_text(sent: list[dict[str, Any]]) -> None:
    folded = first_only(sent)
    others = [m for m in sent if m["role"] not in ("system", "developer")]
    made = [m for m in folded if m["role"] == "user" and not without_marks(text_of(m))]
    kept = [m for m in folded if m["role"] != "system" and all(m is not n for n in made)]
    assert len(kept) == len(others)
    for message, same in zip(others, kept, strict=True):
        assert {**same, "content": None} == {**message, "content": None}
        assert without_marks(text_of(same)) == text_of(message).strip()
