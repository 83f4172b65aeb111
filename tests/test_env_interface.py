"""The environment interface's shared pieces (gagar_jax/rollout/envs/): the tool-call format,
the compact one-token calls and the byte tokenizer; values worked out by hand."""
import pytest

from gagar_jax.rollout.envs import base, tools
from gagar_jax.rollout.envs.tokenizer import ByteTokenizer, Tokenizer

TOOLS = {t.name: t for t in (
    tools.ToolSpec("read_file", "read a file", {"path": "string"}, required=("path",)),
    tools.ToolSpec("run_tests", "run the visible tests", {"verbose": "boolean"}),
    tools.ToolSpec("head", "first lines", {"path": "string", "n": "integer"}, ("path",)))}


def test_well_formed_calls_parse_in_order_and_text_outside_is_ignored():
    text = ("I will look first. " + tools.format_tool_call("read_file", {"path": "a.py"})
            + " then " + tools.format_tool_call("run_tests", {}))
    assert tools.parse_tool_calls(text, TOOLS) == [
        tools.ToolCall("read_file", {"path": "a.py"}), tools.ToolCall("run_tests", {})]
    assert tools.parse_tool_calls("no call here, a final answer", TOOLS) == []


@pytest.mark.parametrize("block, says", [
    ('{"name": "read_file", "arguments": {"path": "a.py"', "not valid JSON"),
    ('["read_file"]', "must be a JSON object"),
    ('{"name": "rm_rf", "arguments": {}}', "unknown tool 'rm_rf'"),
    ('{"name": "read_file", "arguments": "a.py"}', "arguments must be a JSON object"),
    ('{"name": "read_file", "arguments": {}}', "missing argument(s) path"),
    ('{"name": "read_file", "arguments": {"path": 3}}', "'path' must be a string"),
    ('{"name": "head", "arguments": {"path": "a", "n": true}}', "'n' must be a integer"),
    ('{"name": "head", "arguments": {"path": "a", "m": 1}}', "unknown argument 'm'"),
])
def test_every_malformed_call_is_an_error_naming_what_was_wrong(block, says):
    [err] = tools.parse_tool_calls(f"<tool_call>{block}</tool_call>", TOOLS)
    assert isinstance(err, tools.CallError) and says in err.message, err


def test_an_unclosed_block_is_an_error_after_the_complete_ones():
    text = tools.format_tool_call("run_tests", {}) + '<tool_call>{"name": "read_f'
    got = tools.parse_tool_calls(text, TOOLS)
    assert got[0] == tools.ToolCall("run_tests", {})
    assert isinstance(got[1], tools.CallError) and "unclosed" in got[1].message


def test_tool_schema_is_the_openai_tools_entry():
    assert TOOLS["head"].schema()["function"]["parameters"] == {
        "type": "object", "properties": {"path": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["path"]}


def test_compact_calls_take_the_text_up_to_the_next_reserved_token():
    tok = ByteTokenizer({"<|end|>": 256, "<look>": 257, "<answer>": 258})
    compact = tools.CompactCalls({257: ("look", ""), 258: ("answer", "text")})
    ids = tok.encode("hm<look>x<answer>42<|end|>")
    assert ids == [104, 109, 257, 120, 258, 52, 50, 256]
    assert compact.parse(ids, tok.decode, tok.stop_token_ids) == [
        tools.ToolCall("look", {}), tools.ToolCall("answer", {"text": "42"})]


def test_byte_tokenizer_round_trips_and_renders_each_turn_alone():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer) and tok.stop_token_ids == (256,) and tok.vocab_size == 257
    text = "héllo <|end|> x"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("a<|end|>") == [97, 256]
    first = tok.prompt([{"role": "user", "content": "hi"}])
    assert tok.decode(first) == "<|user|>\nhi\n<|assistant|>\n"
    obs = tok.observation([{"role": "tool", "content": "ok"}])
    assert tok.decode(obs) == "<|tool|>\nok\n<|assistant|>\n"
    with pytest.raises(ValueError, match=">= 256"):
        ByteTokenizer({"<x>": 10})


def test_a_finished_step_names_its_reason_and_carries_no_observation():
    assert base.Step(done=True, reason="submitted").reason == "submitted"
    with pytest.raises(ValueError, match="reason"):
        base.Step(done=True, reason="bored")
    with pytest.raises(ValueError, match="no observation"):
        base.Step(observation=[1], done=True, reason="submitted")
    with pytest.raises(ValueError, match="outcome"):
        base.check_verdict({"outcome": "ok"}, "t0")
