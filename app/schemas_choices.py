"""How many choices an OpenAI generation request may ask for: `n` independent samples per
prompt, up to `MAX_CHOICES`; `best_of` (several drawn, the likeliest returned) is not served."""

from __future__ import annotations

from app.schemas import whole_number

# The most sequences one prompt may ask for (`n`): each is its own engine request, charged
# its prompt and new tokens (`generation/pipeline.py`); pass@k evaluations ask for ~10.
MAX_CHOICES = 16


def best_of_one(value: object) -> object:
    """A `mode="before"` check of completions' `best_of`: a whole number (`whole_number`),
    and 1 only."""
    value = whole_number(value)
    if isinstance(value, int) and value != 1:
        raise ValueError(
            "best_of must be 1 (or null): best_of is not served; ask for several "
            f"independent samples with n (at most {MAX_CHOICES})"
        )
    return value
