"""The generation front end's pure text handling: incremental detokenization never splits a
character and concatenates to the full decode; stop strings cut before their first
occurrence, even across pieces; chat templates render, refuse and load (compared with
transformers in tests/integration/test_generation_prompts.py)."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from app.generation.chat import ChatTemplate, ChatTemplateError, load_chat_template
from app.generation.detokenize import REPLACEMENT_CHARACTER, IncrementalDetokenizer, WholeText
from app.generation.stops import StopMatcher

TEXTS = [
    "plain ascii text, with spaces and punctuation!",
    "héllo wörld — naïve café",
    "emoji 🚀🔥 and CJK 你好世界 mixed in",
    "  leading spaces and trailing  ",
]


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    """A byte-level BPE trained here on ASCII only: every non-ASCII character is several
    byte tokens, so a character is split across tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    return tokenizer


def _decode(tokenizer: Tokenizer) -> object:
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 2, 3])
def test_pieces_never_split_a_character_and_concatenate_to_the_full_decode(
    byte_level: Tokenizer, text: str, step: int
) -> None:
    ids = byte_level.encode(text).ids
    detokenizer = IncrementalDetokenizer(_decode(byte_level))  # type: ignore[arg-type]
    pieces = [detokenizer.add(ids[start : start + step]) for start in range(0, len(ids), step)]
    pieces.append(detokenizer.flush())
    assert not any(REPLACEMENT_CHARACTER in piece for piece in pieces)
    assert "".join(pieces) == byte_level.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_whole_text_releases_nothing_until_the_end_then_the_full_decode(
    byte_level: Tokenizer, text: str
) -> None:
    ids = byte_level.encode(text).ids
    whole = WholeText(_decode(byte_level))  # type: ignore[arg-type]
    assert [whole.add(ids[start : start + 2]) for start in range(0, len(ids), 2)] == [""] * (
        (len(ids) + 1) // 2
    )
    assert whole.flush() == byte_level.decode(ids) == text
    assert whole.flush() == ""


def test_a_sentencepiece_continuation_keeps_the_space_that_parts_it_from_the_prompt() -> None:
    """A Metaspace decoder (Llama 2, Mistral) drops the leading space of whatever a decode
    starts with: the generated ids decoded alone gave "Paris." for "The capital is" ->
    " Paris.", on the streamed and the whole path."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], show_progress=False)
    tokenizer.train_from_iterator(["The capital is Paris. The capital is Rome."] * 20, trainer)
    prompt = tokenizer.encode("The capital is").ids
    generated = tokenizer.encode("The capital is Paris.").ids[len(prompt) :]
    assert tokenizer.decode(generated) == "Paris."  # this test's premise: the space is lost
    decode = _decode(tokenizer)
    for step in (1, 2):
        streamed = IncrementalDetokenizer(decode, prompt)  # type: ignore[arg-type]
        pieces = [streamed.add(generated[i : i + step]) for i in range(0, len(generated), step)]
        assert "".join(pieces) + streamed.flush() == " Paris."
    whole = WholeText(decode, prompt)  # type: ignore[arg-type]
    whole.add(generated)
    assert whole.flush() == " Paris."


def test_a_split_character_is_held_until_its_last_byte(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("🚀").ids
    assert len(ids) == 4  # one token per byte: this test's premise
    detokenizer = IncrementalDetokenizer(_decode(byte_level))  # type: ignore[arg-type]
    assert [detokenizer.add([token]) for token in ids] == ["", "", "", "🚀"]


def test_an_incomplete_character_at_the_end_is_flushed_as_a_full_decode_shows_it(
    byte_level: Tokenizer,
) -> None:
    ids = byte_level.encode("a🚀").ids[:-1]
    detokenizer = IncrementalDetokenizer(_decode(byte_level))  # type: ignore[arg-type]
    text = detokenizer.add(ids) + detokenizer.flush()
    assert text == byte_level.decode(ids)
    assert text.startswith("a") and text.endswith(REPLACEMENT_CHARACTER)


class _CountingDecode:
    """`decode`, counting the token ids it was given: the work a sequence's text costs."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded = 0

    def __call__(self, ids: Sequence[int]) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def _streamed(detokenizer: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detokenizer.add([token]) for token in ids] + [detokenizer.flush()]


def test_a_run_of_special_tokens_does_not_grow_the_decoded_window(
    byte_level_with_padding: tuple[Tokenizer, int],
) -> None:
    """A model emitting <pad> (left out of the text) re-decoded a window growing by one
    token a step: 4,000 of them took 0.46 s of the front end's event loop."""
    tokenizer, pad = byte_level_with_padding
    ids = tokenizer.encode("the fox").ids + [pad] * 2_000 + tokenizer.encode(" jumps").ids
    decode = _CountingDecode(tokenizer)
    pieces = _streamed(IncrementalDetokenizer(decode, (), {pad}), ids)
    assert "".join(pieces) == tokenizer.decode(ids) == "the fox jumps"
    assert decode.decoded < 100  # the pads never reach decode (quadratic: ~4 million)


@pytest.fixture(scope="module")
def byte_level_with_padding(byte_level: Tokenizer) -> tuple[Tokenizer, int]:
    tokenizer = Tokenizer.from_str(byte_level.to_str())
    tokenizer.add_special_tokens(["<pad>"])
    pad = tokenizer.token_to_id("<pad>")
    assert pad is not None
    return tokenizer, pad


def _byte_tokens(tokenizer: Tokenizer, text: str) -> list[int]:
    """One token per byte of `text`'s non-ASCII characters (the tokenizer knows no merge of
    them: this test's premise)."""
    ids = tokenizer.encode(text).ids
    assert len(ids) == len(text.encode())
    return ids


@pytest.mark.parametrize("kind", ["invalid bytes", "replacement characters"])
def test_text_ending_in_a_replacement_character_is_not_held_to_the_end(
    byte_level: Tokenizer, kind: str
) -> None:
    """A window ending in U+FFFD was held (and re-decoded whole at every step) until some
    other text came: a run of lone continuation bytes, or U+FFFD written by the model
    itself, was released only at the end."""
    if kind == "invalid bytes":
        ids = _byte_tokens(byte_level, "é")[1:] * 300  # 0xA9 alone: a U+FFFD each
    else:
        ids = _byte_tokens(byte_level, REPLACEMENT_CHARACTER * 100)
    decode = _CountingDecode(byte_level)
    pieces = _streamed(IncrementalDetokenizer(decode), ids)
    text = byte_level.decode(ids)
    assert "".join(pieces) == text and set(text) == {REPLACEMENT_CHARACTER}
    assert len(pieces[-1]) < 10  # released as it came, not at the flush
    assert decode.decoded < 50 * len(ids)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("step", [1, 2, 3])
def test_pieces_of_any_bytes_concatenate_to_the_full_decode(
    byte_level_with_padding: tuple[Tokenizer, int], seed: int, step: int
) -> None:
    """Valid and invalid UTF-8 mixed, special tokens among them: whatever is held and
    released, the pieces make the text a full decode shows."""
    tokenizer, pad = byte_level_with_padding
    alphabet = [
        *_byte_tokens(tokenizer, "é🚀你"),
        *tokenizer.encode("the fox").ids,
        pad,
    ]
    draw = random.Random(seed)
    ids = [draw.choice(alphabet) for _ in range(200)]
    detokenizer = IncrementalDetokenizer(_decode(tokenizer), (), {pad})  # type: ignore[arg-type]
    pieces = [detokenizer.add(ids[start : start + step]) for start in range(0, len(ids), step)]
    pieces.append(detokenizer.flush())
    assert "".join(pieces) == tokenizer.decode(ids)


def _stream(matcher: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    released = []
    for piece in pieces:
        scan = matcher.feed(piece)
        released.append(scan.text)
        if scan.stopped:
            return "".join(released), True
    return "".join(released) + matcher.flush(), False


@pytest.mark.parametrize(
    ("pieces", "stops", "expected"),
    [
        (["Hello wor", "ld. Bye"], ["."], ("Hello world", True)),
        (["one", " ST", "O", "P two"], ["STOP"], ("one ", True)),  # across three pieces
        (["abc", "def"], ["xyz"], ("abcdef", False)),
        (["a S", "T"], ["STOP"], ("a ST", False)),  # a held prefix released at the end
        (["x\n\ny"], ["\n\n", "y"], ("x", True)),  # the earliest of several stops
        (["ab", "cd"], ["bc", "abcd"], ("", True)),  # earliest start, not first found
        (["xab", "cd"], ["bcd", "abx"], ("xa", True)),
        (["STOP"], ["STOP"], ("", True)),
    ],
)
def test_text_is_cut_before_the_first_stop_string(
    pieces: list[str], stops: list[str], expected: tuple[str, bool]
) -> None:
    assert _stream(StopMatcher(stops), pieces) == expected


def test_nothing_that_could_start_a_stop_string_is_released_early() -> None:
    matcher = StopMatcher(["</end>"])
    assert matcher.feed("answer </e").text == "answer "
    assert matcher.feed("n").text == ""
    assert matcher.feed("d>").stopped


def test_without_stop_strings_everything_is_released_at_once() -> None:
    matcher = StopMatcher([])
    assert matcher.feed("anything").text == "anything"


def test_empty_stop_strings_are_refused() -> None:
    with pytest.raises(ValueError):
        StopMatcher(["ok", ""])


CHATML = (  # shared with tests/integration/test_generation_prompts.py
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
STRICT = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('system messages are not supported') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] | tojson }}{% endfor %}"
)
MESSAGES = [{"role": "user", "content": "Hi <b>"}, {"role": "assistant", "content": "Hello"}]


def test_a_template_that_refuses_the_messages_raises_a_client_error() -> None:
    template = ChatTemplate(STRICT, {})
    with pytest.raises(ChatTemplateError, match="system messages are not supported"):
        template.render([{"role": "system", "content": "be brief"}])


@pytest.mark.parametrize(
    "source,message",
    [
        ("{% for call in messages[0].tool_calls %}{{ call }}{% endfor %}", {"tool_calls": 5}),
        ("{{ messages[0].content + 1 }}", {"content": "text"}),
        ("{{ 10 // messages[0].weight }}", {"weight": 0}),
    ],
)
def test_a_template_failing_on_a_clients_fields_is_a_template_error(
    source: str, message: dict[str, object]
) -> None:
    """Answered 400 like a template's own refusal; a plain TypeError was a 500."""
    with pytest.raises(ChatTemplateError, match="failed on these messages"):
        ChatTemplate(source, {}).render([{"role": "user", **message}])


@pytest.mark.parametrize("field", ["content", "name"])
def test_a_lone_surrogate_in_any_message_field_is_a_template_error(field: str) -> None:
    """JSON lets a client send "\\udc00"; the tokenizer refused the rendered prompt with a
    TypeError, answered 500."""
    source = "{% for m in messages %}{{ m['name'] }}: {{ m['content'] }}{% endfor %}"
    message = {"role": "user", "name": "ann", "content": "hi", field: "a\udc00"}
    with pytest.raises(ChatTemplateError, match="not valid Unicode"):
        ChatTemplate(source, {}).render([message])


ROLES = (  # a template written before OpenAI's `developer` role: it knows these three
    "{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant'] %}"
    "[{{ m['role'] }}] {{ m['content'] }}{% else %}{{ raise_exception('unknown role') }}"
    "{% endif %}{% endfor %}"
)


def test_a_developer_message_is_rendered_as_a_system_message() -> None:
    """OpenAI's `developer` role (its name for instructions since o1) reached templates
    that test `role == 'system'`: refused (400), or its instructions silently dropped."""
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ChatTemplate(ROLES, {}).render(messages) == "[system] Be brief.[user] Hi"
    assert ChatTemplate(CHATML, {}).render(messages).startswith("<|im_start|>system\nBe brief.")
    with pytest.raises(ChatTemplateError, match="system messages are not supported"):
        ChatTemplate(STRICT, {}).render(messages)  # refused as its system message would be


def test_a_template_that_names_the_developer_role_renders_it_itself() -> None:
    source = (
        "{% for m in messages %}{% if m.role == 'developer' %}D: {% elif m.role == 'system' %}"
        "S: {% endif %}{{ m.content }}{% endfor %}"
    )
    messages = [{"role": "developer", "content": "x"}, {"role": "system", "content": "y"}]
    assert ChatTemplate(source, {}).render(messages) == "D: xS: y"


def test_templates_load_from_the_file_or_the_tokenizer_config(tmp_path: Path) -> None:
    assert load_chat_template(tmp_path) is None
    config = {"eos_token": {"content": "</s>"}, "chat_template": "{{ eos_token }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = load_chat_template(tmp_path)
    assert template is not None and template.render([]) == "</s>"
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    template = load_chat_template(tmp_path)
    assert template is not None and template.render([]) == "D"
    (tmp_path / "chat_template.jinja").write_text("file")
    template = load_chat_template(tmp_path)
    assert template is not None and template.render([]) == "file"


def test_a_template_marking_the_assistants_turn_for_training_renders_its_text() -> None:
    # TRL's assistant-only-loss templates wrap the assistant's turn in transformers' own
    # `{% generation %}` tag; jinja2 alone refuses the tag, which stopped the front end.
    source = (
        "{% for m in messages %}{% if m.role == 'assistant' %}"
        "{% generation %}A:{{ m.content }}{% endgeneration %}"
        "{% else %}U:{{ m.content }}{% endif %}{% endfor %}"
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert ChatTemplate(source, {}).render(messages) == "U:hiA:yo"


def test_a_template_that_does_not_compile_leaves_the_model_without_chat(tmp_path: Path) -> None:
    config = {"chat_template": "{% for m in messages %}{{ m.content }}"}  # no endfor
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(tmp_path) is None


def test_special_tokens_only_in_the_legacy_map_still_render(tmp_path: Path) -> None:
    # An older tokenizer directory: `{{ bos_token }}` rendered empty, the prompt lost its BOS.
    config = {"chat_template": "{{ bos_token }}{{ eos_token }}", "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    legacy = {"bos_token": {"content": "<s>"}, "eos_token": "<ignored>"}
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(legacy))
    template = load_chat_template(tmp_path)
    assert template is not None and template.render([]) == "<s></s>"
