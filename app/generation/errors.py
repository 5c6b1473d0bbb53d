"""The generation pipeline's refusals of a request, raised before its answer starts
(`pipeline.TextGeneration.prepare`) and answered by the edge (`app/api/errors.py`) as 4xx."""

from __future__ import annotations


class NoChatTemplate(Exception):
    """Chat was asked of a model whose tokenizer has no chat template (400)."""

    def __init__(self, model: str) -> None:
        super().__init__(
            f"model {model!r} has no chat template (tokenizer_config.json `chat_template` or "
            "chat_template.jinja); use /v1/completions with a prompt instead"
        )


class StopHoldsSpecialToken(Exception):
    """A stop string that holds a special token's text beside other text (400, `stop`): the
    generated text leaves special tokens out, so it could never be found, and no token ends
    the sequence at it (a stop string that is the token's text alone does)."""

    def __init__(self, stop: str, token: str) -> None:
        super().__init__(
            f"stop string {stop!r} holds the special token {token!r}, which the generated "
            "text never shows (special tokens are left out of it), so it could never match; "
            f"to stop at that token, send {token!r} alone as a stop string"
        )


class ContextTooLong(Exception):
    """A prompt plus the tokens asked for exceed what one sequence may hold (400). Its text
    names the prompt by index; the edge, which knows how it was sent, words it `described`."""

    def __init__(
        self, index: int, prompt_tokens: int, new_tokens: int, limit: int, echo_only: bool = False
    ) -> None:
        """`echo_only`: the client asked for no new token (`max_tokens` 0, with `echo`), and
        the engine still makes one (dropped), which the prompt leaves no room for."""
        self.index, self.sizes = index, (prompt_tokens, new_tokens, limit)
        self.echo_only = echo_only
        super().__init__(self.described(f"prompt {index}"))

    def described(self, prompt: str) -> str:
        """The message, naming the prompt `prompt` (`the prompt`: one sent alone)."""
        prompt_tokens, new_tokens, limit = self.sizes
        if self.echo_only:
            return (
                f"{prompt} has {prompt_tokens} tokens; echo with max_tokens 0 needs room for "
                f"one token after the prompt (computed, then dropped); a sequence holds at "
                f"most {limit} tokens (prompt + new tokens)"
            )
        return (
            f"{prompt} has {prompt_tokens} tokens and asks for {new_tokens} more; a sequence "
            f"holds at most {limit} tokens (prompt + new tokens)"
        )


class PromptTooManyCharacters(ContextTooLong):
    """A prompt with more characters than the sequence's limit allows (`MAX_CHARS_PER_TOKEN`
    per token), refused before a tokenizer pass: the same refusal as the token check's, 400
    `context_length_exceeded`, however long the prompt (a client's handler of an overflow
    keys on it)."""

    def __init__(self, index: int, characters: int, max_characters: int, limit: int) -> None:
        # Not the parent's `sizes` (tokens): characters, the most taken, the token limit.
        self.index, self.characters = index, (characters, max_characters, limit)
        Exception.__init__(self, self.described(f"prompt {index}"))

    def described(self, prompt: str) -> str:
        characters, max_characters, limit = self.characters
        return (
            f"{prompt} has {characters} characters; a sequence holds at most {limit} tokens "
            f"(prompt + new tokens), and a prompt over {max_characters} characters is refused "
            "before it is tokenized"
        )


class TooManyTokens(Exception):
    """The whole request needs more tokens than the admission bucket can ever hold (413)."""

    def __init__(self, tokens: int, limit: int, n: int = 1) -> None:
        counted = "prompts + new tokens" if n == 1 else f"n={n} x (prompts + new tokens)"
        super().__init__(
            f"the request needs {tokens} tokens ({counted}); at most {limit} per request "
            "(STEADY_RATE_LIMIT_BURST)"
        )


class TokenIdOutOfVocabulary(Exception):
    """A token-id prompt holding an id the model's tokenizer has no token for (400). Its
    text names the prompt by index; the edge words it `described`, as `ContextTooLong`'s."""

    def __init__(self, index: int, token_id: int, vocabulary_size: int) -> None:
        self.index, self.token_id, self.vocabulary_size = index, token_id, vocabulary_size
        super().__init__(self.described(f"prompt {index}"))

    def described(self, prompt: str) -> str:
        return (
            f"{prompt} holds token id {self.token_id}; the model's vocabulary has "
            f"{self.vocabulary_size} tokens (ids 0 to {self.vocabulary_size - 1})"
        )


class ModelNotChosen(Exception):
    """A tokenizer route (/tokenize, /detokenize, /tokenizer_info) without `model` on a
    server where no model is the default for it (400, `model`): several generate models,
    or no generate model and several with a tokenizer, and STEADY_DEFAULT_MODEL unset."""

    def __init__(self, models: list[str]) -> None:
        if not models:
            super().__init__("no served model has a tokenizer")
            return
        super().__init__(
            "model is required: STEADY_DEFAULT_MODEL is unset and this server serves "
            f"several models this route could serve ({', '.join(models)}); name one of them"
        )
