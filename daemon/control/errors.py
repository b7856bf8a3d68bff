"""Typed request errors: raised by handlers, answered as an ``Error`` reply by the server."""

from __future__ import annotations

from kvoffload.daemon.control import protocol as p

# Longest block hash or key accepted (sha256 keys are 36 bytes; leave room for others).
MAX_KEY_BYTES = 128


class RequestError(Exception):
    def __init__(self, code: p.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def bad_request(message: str) -> RequestError:
    return RequestError(p.ErrorCode.BAD_REQUEST, message)
