"""The Hugging Face tokenizer adapter (gagar_jax/rollout/envs/hf_tokenizer.py) on a tokenizer
built here with the `tokenizers` library (byte-level BPE, ChatML specials; nothing downloaded)
and a template with the structure of Qwen3's, which rewrites earlier turns."""
import pytest

from gagar_jax.rollout.envs.hf_tokenizer import HFTokenizer
from gagar_jax.rollout.envs.tokenizer import Tokenizer

SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen3's chat template, its message handling as shipped (tool schemas left out): reasoning of
# assistant turns before the last user query is dropped, the last assistant turn gets an empty
# <think> block, consecutive tool messages share one user turn, and a conversation with no user
# query is refused.
QWEN3_STYLE = """\
{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + \
'<|im_end|>\\n' }}{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and \
not(message.content.startswith('<tool_response>') and \
message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}{{- raise_exception('No user query found in messages.') }}{%- endif %}
{%- for message in messages %}
    {%- if message.content is string %}{%- set content = message.content %}\
{%- else %}{%- set content = '' %}{%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')\
.split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + \
reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

SYSTEM = {"role": "system", "content": "You fix bugs."}
USER = {"role": "user", "content": "the test fails"}
TURN1 = ("<think>\nlook first\n</think>\n\n<tool_call>\n"
         '{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call><|im_end|>')
TURN2 = "the file is read<|im_end|>"
TURN3 = "<think>\nnow\n</think>\n\ndone<|im_end|>"
NUDGE = "call a tool"


@pytest.fixture(scope="module")
def make_hf():
    """A byte-level BPE tokenizer trained here, wrapped by transformers with a given template."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(["the tests pass and the file is read", "def f(x): return x + 1",
                             "user assistant tool system response"] * 5, trainer)

    def make(template):
        return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>",
                                      chat_template=template)
    return make


def _episode(tok, hf):
    """prompt, model turn (engine ids), tool result, turn, nudge, turn: the trajectory's ids."""
    ids = tok.prompt([SYSTEM, USER])
    ids += hf.encode(TURN1, add_special_tokens=False)
    ids += tok.observation([{"role": "tool", "content": "x = 1"}])
    ids += hf.encode(TURN2, add_special_tokens=False)
    ids += tok.observation([{"role": "user", "content": NUDGE}])
    return ids + hf.encode(TURN3, add_special_tokens=False)


def test_each_new_turn_is_rendered_alone_and_earlier_turns_stay_as_generated(make_hf):
    hf = make_hf(QWEN3_STYLE)
    tok = HFTokenizer(hf)
    assert isinstance(tok, Tokenizer)
    assert tok.stop_token_ids == (hf.convert_tokens_to_ids("<|im_end|>"),)
    traj = _episode(tok, hf)
    # What the model saw and produced, written out by hand from the template's rules: the
    # observation opens with the newline the template puts after <|im_end|>.
    assert hf.decode(traj) == (
        "<|im_start|>system\nYou fix bugs.<|im_end|>\n<|im_start|>user\nthe test fails<|im_end|>\n"
        "<|im_start|>assistant\n" + TURN1
        + "\n<|im_start|>user\n<tool_response>\nx = 1\n</tool_response><|im_end|>\n"
          "<|im_start|>assistant\n" + TURN2
        + f"\n<|im_start|>user\n{NUDGE}<|im_end|>\n<|im_start|>assistant\n" + TURN3)
    # Rendering the whole conversation again rewrites it: the first turn's reasoning is gone
    # (the nudge is now the last user query) and the second turn gains a <think> block. The
    # adapter's trajectory is not that.
    history = [SYSTEM, USER, {"role": "assistant", "content": TURN1.removesuffix("<|im_end|>")},
               {"role": "tool", "content": "x = 1"},
               {"role": "assistant", "content": TURN2.removesuffix("<|im_end|>")},
               {"role": "user", "content": NUDGE}]
    again = hf.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert "look first" not in again and "look first" in hf.decode(traj)
    assert not hf.decode(traj).startswith(again)


def test_the_template_refuses_a_tool_message_alone(make_hf):
    """Why observations are rendered after an anchor: Qwen3's template needs a user query."""
    hf = make_hf(QWEN3_STYLE)
    with pytest.raises(Exception, match="No user query"):
        hf.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)
    obs = HFTokenizer(hf).observation([{"role": "tool", "content": "a"},
                                       {"role": "tool", "content": "b"}])
    assert hf.decode(obs) == ("\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n"
                              "<tool_response>\nb\n</tool_response><|im_end|>\n"
                              "<|im_start|>assistant\n")


def test_a_stable_template_gives_the_full_render_token_for_token(make_hf):
    """Where the template does not rewrite (ChatML), prompt + turns + observations encode to
    exactly the ids of the whole conversation rendered at once."""
    hf = make_hf(CHATML)
    tok = HFTokenizer(hf)
    ids = tok.prompt([SYSTEM, USER]) + hf.encode("a call<|im_end|>", add_special_tokens=False)
    ids += tok.observation([{"role": "tool", "content": "the result"}])
    whole = hf.apply_chat_template(
        [SYSTEM, USER, {"role": "assistant", "content": "a call"},
         {"role": "tool", "content": "the result"}], tokenize=False, add_generation_prompt=True)
    assert ids == hf.encode(whole, add_special_tokens=False)


def test_template_arguments_and_bad_set_ups(make_hf):
    hf = make_hf(QWEN3_STYLE)
    tok = HFTokenizer(hf, template_kwargs={"enable_thinking": False})
    assert hf.decode(tok.observation([USER])).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        HFTokenizer(hf, stop_tokens=["<|nope|>"])
    with pytest.raises(ValueError, match="no chat template"):
        HFTokenizer(make_hf(None))
