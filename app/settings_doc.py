"""The settings as documentation: the Markdown table `steadyserve settings` prints and the
README carries (a test keeps the README's copy equal to it). Pure; any thread."""

from __future__ import annotations

from pydantic import BaseModel

from app.settings import Settings


def settings_table() -> str:
    """Every setting as a Markdown table (the README's copy is checked against this)."""
    rows = ["| environment variable | default | meaning |", "|---|---|---|"]
    # Settings' own fields first, in their order, then those it inherits (the generation
    # task's, `settings_generation.py`), which pydantic would list first.
    own = [name for name in Settings.model_fields if name in Settings.__annotations__]
    inherited = [name for name in Settings.model_fields if name not in own]
    for name in own + inherited:
        field = Settings.model_fields[name]
        default = field.get_default(call_default_factory=True)
        if isinstance(default, tuple):
            default = list(default)
        if isinstance(default, list) and default and isinstance(default[0], BaseModel):
            default = [d.model_dump() for d in default]
        shown = "unset" if default is None else f"`{default}`"
        description = (field.description or "").replace("|", "\\|")
        rows.append(f"| `STEADY_{name.upper()}` | {shown} | {description} |")
    return "\n".join(rows)
