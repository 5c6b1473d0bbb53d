"""Thin HTTP routes: parse with pydantic, call the `Service`, render with orjson."""
