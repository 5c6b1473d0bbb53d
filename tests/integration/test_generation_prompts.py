"""A generate model's prompts as the front end builds them, without transformers, equal
what transformers builds: chat templates rendered and tokenized the same way, and the
tokenizer's decode the same."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tokenizers import Tokenizer, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from app.generation.chat import ChatTemplate
from app.generation.tokenizer import load_generation_tokenizer
from tests.unit.test_generation_text import CHATML, STRICT

MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Hi <b> 🚀"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "What is tail latency?"},
]


# Tests `tools` without an `is defined` guard: transformers renders it with tools=None.
UNGUARDED_TOOLS = (
    "{% if tools is not none %}[TOOLS] {{ tools | tojson }}{% endif %}"
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
)


def test_templates_render_as_transformers_renders_them() -> None:
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "<s>": 1}, unk_token="[UNK]"))
    reference = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>")
    messages = MESSAGES[1:]  # STRICT refuses system messages
    for source in (CHATML, STRICT, UNGUARDED_TOOLS):
        ours = ChatTemplate(source, {"bos_token": "<s>"}).render(messages)
        theirs = reference.apply_chat_template(
            messages, chat_template=source, tokenize=False, add_generation_prompt=True
        )
        assert ours == theirs


def test_the_tiny_models_chat_prompt_ids_equal_apply_chat_template(tiny_causal_lm: Path) -> None:
    ours = load_generation_tokenizer(str(tiny_causal_lm), None)
    reference = AutoTokenizer.from_pretrained(tiny_causal_lm)
    assert ours.chat_template is not None
    prompt = ours.chat_template.render(MESSAGES)
    expected = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert ours.encode(prompt, add_special_tokens=False) == list(expected)


def test_plain_prompts_and_decoding_match_transformers(tiny_causal_lm: Path) -> None:
    ours = load_generation_tokenizer(str(tiny_causal_lm), None)
    reference = AutoTokenizer.from_pretrained(tiny_causal_lm)
    assert ours.max_input_tokens == 512  # the model's positions
    texts = ["The quick brown fox", "héllo 🚀 wörld", " leading space", "Numbers: 10 128 2048."]
    for text in texts:
        ids = ours.encode(text)
        assert ids == reference(text)["input_ids"]
        generated = [*ids[1:], reference.eos_token_id, *ids[1:]]
        assert ours.decode(generated) == reference.decode(generated, skip_special_tokens=True)


def test_a_model_without_a_template_has_none(tiny_causal_lm_without_chat_template: Path) -> None:
    tokenizer = load_generation_tokenizer(str(tiny_causal_lm_without_chat_template), None)
    assert tokenizer.chat_template is None


def test_a_generation_front_end_never_imports_torch(tiny_causal_lm: Path) -> None:
    """A front end serving a generate model loads its tokenizer, renders a chat prompt,
    encodes it and detokenizes a stream, all without torch or transformers."""
    probe = (
        "import sys\n"
        "from app.main import create_app\n"
        "from app.engine.zmq_client import EngineAddresses\n"
        "from app.generation.detokenize import IncrementalDetokenizer\n"
        "from app.tokenizer_pool import load_model_tokenizer\n"
        "from app.model_specs import ModelSpec\n"
        "from app.settings import Settings\n"
        f"spec = ModelSpec(name='tiny', task='generate', source={str(tiny_causal_lm)!r})\n"
        "create_app(Settings(models=(spec,)), engine_addresses=EngineAddresses('ipc:///x', "
        "'ipc:///y'))\n"
        "tokenizer = load_model_tokenizer(spec, 64)\n"
        "ids = tokenizer.encode(tokenizer.chat_template.render([{'role': 'user', 'content': "
        "'hi'}]), add_special_tokens=False)\n"
        "detokenizer = IncrementalDetokenizer(tokenizer.decode)\n"
        "assert detokenizer.add(ids) + detokenizer.flush() == tokenizer.decode(ids)\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
