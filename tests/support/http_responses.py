"""The HTTP/1.1 responses in the bytes a connection received (or a fake transport was
written), parsed by httptools: for tests of what the front end's protocol writes itself."""

from __future__ import annotations

import httptools

Response = tuple[int, dict[str, str], bytes]  # status, headers (names lower-cased), body


def responses(received: bytes | bytearray) -> list[Response]:
    """Every complete response in `received`, in order."""
    parsed: list[Response] = []
    headers: dict[str, str] = {}
    body = bytearray()

    class Callbacks:
        def on_header(self, name: bytes, value: bytes) -> None:
            headers[name.decode().lower()] = value.decode()

        def on_body(self, chunk: bytes) -> None:
            body.extend(chunk)

        def on_message_complete(self) -> None:
            parsed.append((parser.get_status_code(), dict(headers), bytes(body)))
            headers.clear()
            body.clear()

    parser = httptools.HttpResponseParser(Callbacks())
    parser.feed_data(bytes(received))
    return parsed
