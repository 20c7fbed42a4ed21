"""Keeping a location's credentials out of everything persist says.

A location URI may carry a password (``postgresql://user:password@host/db``) or a secret query
parameter (``?password=``, ``?sslpassword=``, ``?aws_secret_access_key=``...). Every error,
log line, repr and label that shows a location, or a message of a library that was handed
one, goes through ``redact`` first.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

__all__ = ["HIDDEN", "redact"]

HIDDEN = "***"

# The password of a URI's userinfo. It runs to the last "@" before the authority ends, as
# urlsplit reads it: a raw "@" in a password is common, and must not leave its tail showing.
_USERINFO = re.compile(
    r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^\s/?#@:'\"]*:)(?P<secret>[^\s/?#'\"]*)@"
)

# A parameter whose name says it holds a secret, in a URI's query or a libpq "key=value"
# string; its value runs to the next separator, or is quoted.
_SECRET_PARAM = re.compile(
    r"(?P<head>(?<![\w.\-])[\w.\-]*"
    r"(?:passw(?:or)?d|passphrase|pwd|secret|token|credential|signature"
    r"|api_?key|access_?key|private_?key)"
    r"[\w.\-]*\s*=\s*)"
    r"(?P<secret>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^\s&;#'\"]+)",
    re.IGNORECASE,
)


def redact(text: str, *uris: str) -> str:
    """``text`` with every credential it shows replaced by ``***``: the password of each URI in
    it (``user:***@host``) and the value of each secret parameter (``password=***``).

    Each of ``uris`` is a location whose secrets are also hidden wherever they appear in
    ``text`` on their own (a library's message may quote a password it could not parse).
    Anything else in ``text`` is left as it was, so a redacted location still says which
    host, database or bucket it is."""
    secrets: set[str] = set()
    for uri in uris:
        for found in (*_USERINFO.finditer(uri), *_SECRET_PARAM.finditer(uri)):
            raw = found.group("secret").strip("'\"")
            secrets.update(s for s in (raw, unquote(raw)) if s)
    # Longest first: a secret that contains another must go whole.
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, HIDDEN)
    text = _USERINFO.sub(rf"\g<head>{HIDDEN}@", text)
    return _SECRET_PARAM.sub(rf"\g<head>{HIDDEN}", text)
