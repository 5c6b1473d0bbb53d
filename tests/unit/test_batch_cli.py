"""The batch command's option parsing."""

from __future__ import annotations

import pytest

from app.batchclient.cli import parse_headers


def test_header_option_parsing() -> None:
    assert parse_headers(["Authorization: Bearer t", "X-Job:  7 "]) == {
        "Authorization": "Bearer t",
        "X-Job": "7",
    }
    for bad in ("no colon", ": empty name", "X: a\r\nInjected: 1"):
        with pytest.raises(ValueError):
            parse_headers([bad])
