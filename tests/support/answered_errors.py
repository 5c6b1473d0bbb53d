"""Every error the app's code answers, found by reading the code: the one list that the
README's error table and the OpenAPI document are checked against."""

from __future__ import annotations

import ast
from pathlib import Path

from app.api import errors
from app.api.errors import REJECTION_STATUS

APP = Path(__file__).resolve().parents[2] / "app"


def answered_error_types() -> set[tuple[int, str]]:
    """(status, error.type) of every error the app's code answers: each `error_response`
    call with a literal type (its status a literal or a name in app.api.errors), the
    rejections by reason (the HTTP protocol's connection cap too), and the HTTP exceptions'
    types."""
    answered = {(status, reason.value) for reason, status in REJECTION_STATUS.items()}
    answered |= set(errors.HTTP_ERROR_TYPES.items()) | {(400, errors.HTTP_ERROR)}
    for path in APP.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "error_response"
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
            ):
                continue
            status = node.args[0]
            if isinstance(status, ast.Constant):
                answered.add((status.value, node.args[1].value))
            elif isinstance(status, ast.Name) and hasattr(errors, status.id):
                answered.add((getattr(errors, status.id), node.args[1].value))
    return answered
