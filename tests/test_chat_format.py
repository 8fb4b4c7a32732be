"""Chat rows of every supported layout -> messages; bad rows -> one line naming row and field."""

from __future__ import annotations

import json

import pytest

from titan_plugins.chat import ChatFields, NoAssistantTurn, to_messages
from titan_plugins.errors import ConfigError

AUTO = ChatFields()
W = "train.jsonl:7"


def test_messages_layout_keeps_tool_fields():
    row = {"id": 3, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "w"}}]},
        {"role": "tool", "content": "21", "tool_call_id": "c1"},
        {"role": "assistant", "content": "21 degrees.", "reasoning_content": "easy"},
    ]}
    out = to_messages(row, AUTO, where=W)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool", "assistant"]
    assert out[2] == {"role": "assistant", "tool_calls": [{"function": {"name": "w"}}]}
    assert out[3]["tool_call_id"] == "c1" and out[4]["reasoning_content"] == "easy"
    assert out[0] is not row["messages"][0]


def test_sharegpt_layout():
    row = {"conversations": [
        {"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
        {"from": "gpt", "value": "A"}, {"from": "function_call", "value": "{}"},
        {"from": "observation", "value": "R"}, {"from": "gpt", "value": "B"}]}
    out = to_messages(row, AUTO, where=W)
    assert out == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                   {"role": "assistant", "content": "A"}, {"role": "assistant", "content": "{}"},
                   {"role": "tool", "content": "R"}, {"role": "assistant", "content": "B"}]
    assert to_messages(row, ChatFields(format="sharegpt"), where=W) == out
    custom = {"dialog": row["conversations"]}
    assert to_messages(custom, ChatFields(messages_field="dialog"), where=W) == out


def test_single_turn_layouts():
    row = {"instruction": "Translate", "input": "chat", "output": "cat", "system": "S"}
    assert to_messages(row, AUTO, where=W) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Translate\n\nchat"},
        {"role": "assistant", "content": "cat"}]
    assert to_messages({"instruction": "Hi", "output": "Yo", "input": ""}, AUTO, where=W)[0] == \
        {"role": "user", "content": "Hi"}
    pc = {"prompt": "2+2?", "completion": "4"}
    assert to_messages(pc, AUTO, where=W) == [{"role": "user", "content": "2+2?"},
                                              {"role": "assistant", "content": "4"}]
    conversational = {"prompt": [{"role": "user", "content": "2+2?"}],
                      "completion": [{"role": "assistant", "content": "4"}]}
    assert to_messages(conversational, ChatFields(format="prompt_completion"), where=W) == \
        to_messages(pc, AUTO, where=W)
    renamed = ChatFields(format="instruction", instruction_field="q", output_field="a")
    assert to_messages({"q": "x", "a": "y"}, renamed, where=W)[-1]["content"] == "y"


def test_from_config():
    fields = ChatFields.from_config({"format": "sharegpt", "messages_field": None})
    assert fields == ChatFields(format="sharegpt")
    assert ChatFields.from_config(None) == ChatFields()
    with pytest.raises(ConfigError, match=r"^data.chat.format='jsonl': expected one of auto"):
        ChatFields.from_config({"format": "jsonl"})


@pytest.mark.parametrize("row, fields, match", [
    ({"text": "hi"}, AUTO, r"messages: no 'messages' field .*the row has: text\)"),
    ({"text": "hi"}, ChatFields(format="messages"), r"messages: no such field \(the row has: text"),
    ({"messages": "hi"}, AUTO, r"messages: expected a list of messages, got a string"),
    ({"messages": []}, AUTO, r"messages: the conversation is empty"),
    ({"messages": [{"role": "bot", "content": "x"}]}, AUTO,
     r"messages\[0\].role='bot': unknown role \(expected system, user, assistant, tool\)"),
    ({"messages": [{"content": "x"}]}, AUTO, r"messages\[0\]: no 'role'"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 5}]},
     AUTO, r"messages\[1\].content: expected a string, got a number"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}]}, AUTO,
     r"messages\[0\].content: expected a string, got a list"),
    ({"messages": [{"role": "user"}]}, AUTO, r"messages\[0\].content: missing"),
    ({"messages": ["hi"]}, AUTO, r"messages\[0\]: expected an object, got a string"),
    ({"conversations": [{"from": "narrator", "value": "x"}]}, AUTO,
     r"conversations\[0\].from='narrator': unknown role"),
    ({"instruction": "x"}, ChatFields(format="instruction"), r"output: missing"),
    ({"prompt": "x", "completion": None}, ChatFields(format="prompt_completion"),
     r"completion: missing"),
    (["not", "a", "row"], AUTO, r"the row is a list, not an object"),
])
def test_bad_rows_are_one_line(row, fields, match):
    with pytest.raises(ConfigError, match=rf"^{W}: {match}") as err:
        to_messages(row, fields, where=W)
    assert "\n" not in str(err.value) and not isinstance(err.value, NoAssistantTurn)


def test_no_assistant_turn_is_its_own_error():
    """The data source skips and counts these; it is still a ConfigError for other callers."""
    row = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]}
    with pytest.raises(NoAssistantTurn, match=rf"^{W}: messages: no assistant turn$"):
        to_messages(row, AUTO, where=W)
    assert issubclass(NoAssistantTurn, ConfigError)


def test_tools_field():
    from titan_plugins.chat import to_tools

    tool = {"type": "function", "function": {"name": "w"}}
    assert to_tools({"messages": [], "tools": [tool]}, where=W) == [tool]
    assert to_tools({"tools": json.dumps([tool])}, where=W) == [tool]
    assert to_tools({"messages": []}, where=W) is None and to_tools({"tools": ""}, where=W) is None
    with pytest.raises(ConfigError, match=rf"^{W}: tools: a string that is not JSON$"):
        to_tools({"tools": "[oops"}, where=W)
    with pytest.raises(ConfigError, match=rf"^{W}: tools: expected a list of objects, got an obj"):
        to_tools({"tools": {"name": "w"}}, where=W)


def test_prompt_without_assistant_turn():
    row = {"messages": [{"role": "user", "content": "Q"}]}
    assert to_messages(row, AUTO, where=W, require_assistant=False) == row["messages"]
