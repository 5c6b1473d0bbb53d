"""A model's chat template, rendered with jinja2 the way transformers renders it (a sandboxed,
immutable environment with the same filters and globals), without importing transformers.

The template comes from `chat_template.jinja` in the model's directory, else from
`chat_template` in `tokenizer_config.json` (a string, or a list of named templates of which
`default` is used). Rendering is pure and thread-safe.

A message's text may not hold the text of one of the tokenizer's special tokens: the
tokenizer reads such text as the token itself, whatever `add_special_tokens` says, so a
client's `<|im_end|><|im_start|>system` would end its turn and open a system turn of its
own. Such messages are refused (`SpecialTokenInMessage`, 400), every string of the message
checked (content, name, any other field a template may render).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger(__name__)

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")
# OpenAI's `developer` role, its name for the instructions `system` gave (since its o1
# models; the openai client and its wrappers send it). Templates written before it test
# `role == 'system'` and refuse any other role, or drop it: a developer message is rendered
# as a system one, unless the template names the role itself (it then renders it as it
# means to, as gpt-oss's does).
_NAMES_DEVELOPER = re.compile(r"""["']developer["']""")


class ChatTemplateError(Exception):
    """The messages cannot be rendered by this model's template (a client mistake: the
    template itself refused them, e.g. roles that do not alternate)."""


class SpecialTokenInMessage(ChatTemplateError):
    """A message holds the text of one of the tokenizer's special tokens (400)."""

    def __init__(self, index: int, field: str, token: str) -> None:
        self.index, self.field, self.token = index, field, token
        super().__init__(
            f"message {index} holds {token!r} (in {field}), the text of one of the model's "
            "special tokens, which the tokenizer would read as that token (a turn's end or "
            "another role's start), not as text; remove it from the message"
        )


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: jinja2's own escapes HTML, which chat templates must not do.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which transformers' renderer knows (it marks
    the assistant's tokens for assistant-only training losses; TRL fine-tunes ship such
    templates). Rendering a prompt needs only the block's text, so it renders as written."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it an instance variable)

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_as_written")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    @staticmethod
    def _as_written(caller: Callable[[], str]) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


_Trie = dict[str, "_Trie"]


def _trie_regex(node: _Trie) -> str:
    """The regex of the texts below `node` (`""` marks one's end), a text's longest
    continuation first: a shared start is matched once, not once per text."""
    written = ""
    while True:
        ends = "" in node
        branches = sorted(key for key in node if key)
        if len(branches) == 1 and not ends:  # a run of single characters
            written += re.escape(branches[0])
            node = node[branches[0]]
            continue
        if not branches:
            return written
        body = "|".join(re.escape(key) + _trie_regex(node[key]) for key in branches)
        return f"{written}(?:{body}){'?' if ends else ''}"


class SpecialTokenTexts:
    """Finds the texts of special tokens in a string: per first character (`<`, `[`), a
    regex starting with it (which the regex engine scans for as fast as a substring test)
    then the trie of the texts that start with it. A regex alternating all of Llama 3's 256
    was tried at every `<` of a message (~5 ms for 100 kB of markup); one trie of several
    first characters at every character."""

    def __init__(self, texts: Collection[str]) -> None:
        tries: dict[str, _Trie] = {}
        for text in texts:
            if text:
                node = tries.setdefault(text[0], {})
                for character in text[1:]:
                    node = node.setdefault(character, {})
                node[""] = {}
        self._starts = [self._compiled(start, trie) for start, trie in sorted(tries.items())]

    @staticmethod
    def _compiled(start: str, trie: _Trie) -> re.Pattern[str]:
        try:
            return re.compile(re.escape(start) + _trie_regex(trie))
        except (RecursionError, re.error):  # nested past the stack: its texts one by one
            ends: list[str] = []
            pending: list[tuple[str, _Trie]] = [(start, trie)]
            while pending:
                written, node = pending.pop()
                ends += [written] if "" in node else []
                pending += [(written + key, child) for key, child in node.items() if key]
            return re.compile("|".join(map(re.escape, sorted(ends, key=len, reverse=True))))

    def __bool__(self) -> bool:
        return bool(self._starts)

    def find(self, text: str) -> str | None:
        """One of the texts `text` holds (the longest at its place), or None."""
        for pattern in self._starts:
            if (found := pattern.search(text)) is not None:
                return found.group()
        return None


def _refuse_special_token_texts(
    messages: Sequence[Mapping[str, Any]], special: SpecialTokenTexts
) -> None:
    """Raise `SpecialTokenInMessage` for the first message whose strings (values and keys,
    however nested) hold one of the `special` texts."""
    for index, message in enumerate(messages):
        pending: list[tuple[str, object]] = [(f"messages[{index}]", message)]
        while pending:  # no recursion: a client decides how deep a field nests
            field, value = pending.pop()
            if isinstance(value, str):
                if (found := special.find(value)) is not None:
                    raise SpecialTokenInMessage(index, field, found)
                continue
            inner: list[tuple[str, object]] = []
            if isinstance(value, Mapping):
                for key, item in value.items():  # a template may render keys (`items()`)
                    inner += [(field, key), (f"{field}.{key}", item)]
            elif isinstance(value, (list, tuple)):
                inner = [(f"{field}[{i}]", item) for i, item in enumerate(value)]
            pending.extend(reversed(inner))  # in the order sent


class ChatTemplate:
    def __init__(
        self,
        source: str,
        special_tokens: Mapping[str, str],
        special_token_texts: Collection[str] = (),
    ) -> None:
        """`special_tokens`: the names templates read (`bos_token`...) and their texts;
        `special_token_texts`: the texts of all the tokenizer's special tokens, which no
        message may hold."""
        self._template = _environment().from_string(source)
        self.source = source  # as the model ships it (/tokenizer_info's `chat_template`)
        self._special_tokens = dict(special_tokens)
        self._developer_as_system = _NAMES_DEVELOPER.search(source) is None
        self._special_texts = SpecialTokenTexts(special_token_texts)

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for `messages`, ending with the assistant's turn opened unless
        `add_generation_prompt` is false (/tokenize's chat form may ask so) (a
        `developer` message as a `system` one, unless the template names that role).
        Raises `SpecialTokenInMessage` for a message holding a special token's text, and
        `ChatTemplateError` when the template refuses them or fails on them."""
        if self._special_texts:
            _refuse_special_token_texts(messages, self._special_texts)
        rendered_messages = [dict(message) for message in messages]
        if self._developer_as_system:
            for message in rendered_messages:
                if message.get("role") == "developer":
                    message["role"] = "system"
        try:
            rendered = self._template.render(
                messages=rendered_messages,
                # As transformers renders them: templates test `tools is not none`, and
                # an undefined name is not none.
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )
            # JSON may escape a lone surrogate ("\udc00"), which no tokenizer takes.
            rendered.encode("utf-8")
            return rendered
        except UnicodeEncodeError as error:
            raise ChatTemplateError(
                f"the messages hold text that is not valid Unicode: {error.reason} at "
                f"{error.object[error.start : error.end]!a}"
            ) from None
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the chat template failed: {error}") from error
        except (TypeError, ValueError, LookupError, ArithmeticError) as error:
            # Messages may carry any field (templates read `name`, `tool_calls`...): one of
            # the wrong type fails inside the template, and that is the client's mistake.
            raise ChatTemplateError(
                f"the chat template failed on these messages: {error}"
            ) from error


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_source(config: Mapping[str, Any], directory: Path) -> str | None:
    file = directory / TEMPLATE_FILE
    if file.is_file():
        return file.read_text()
    declared = config.get("chat_template")
    if isinstance(declared, str):
        return declared
    if isinstance(declared, list):
        named = {entry.get("name"): entry.get("template") for entry in declared}
        default = named.get("default")
        return default if isinstance(default, str) else None
    return None


def _json_object(path: Path) -> dict[str, Any]:
    found: object = json.loads(path.read_text()) if path.is_file() else {}
    return found if isinstance(found, dict) else {}


def tokenizer_configuration(directory: Path) -> dict[str, Any]:
    """The tokenizer's configuration: tokenizer_config.json (empty without one) with
    special_tokens_map.json's entries under it. Older tokenizer directories keep their
    special tokens in special_tokens_map.json alone; transformers reads both,
    tokenizer_config.json's winning where it holds a token (not where it holds null).
    Read for the chat template's special tokens and for /tokenizer_info."""
    config = _json_object(directory / TOKENIZER_CONFIG)
    legacy = _json_object(directory / SPECIAL_TOKENS_MAP)
    return {**config, **{key: value for key, value in legacy.items() if not config.get(key)}}


def load_chat_template(
    directory: Path, special_token_texts: Collection[str] = ()
) -> ChatTemplate | None:
    """The model's chat template, or None when it has none, or one this renderer cannot
    compile (logged): completions must still be served, and chat gets its clear 400.
    `special_token_texts`: the tokenizer's special tokens, which no message may hold."""
    config = tokenizer_configuration(directory)
    source = _template_source(config, directory)
    if source is None:
        return None
    special = {key: text for key in _SPECIAL_TOKEN_KEYS if (text := _token_text(config.get(key)))}
    try:
        return ChatTemplate(source, special, special_token_texts)
    except jinja2.TemplateSyntaxError as error:
        log.error("%s: chat template does not compile (%s); chat not served", directory, error)
        return None
