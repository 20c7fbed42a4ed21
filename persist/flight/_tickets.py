"""Tickets: opaque bytes a client hands back to ``DoGet``, signed so that only this server's own,
unaltered and unexpired tickets are honoured.

A ticket is ``VERSION + body + HMAC-SHA256(key, VERSION + body)``, with the body a msgpack
``TicketBody``. The MAC covers the exact bytes a client holds (there is no base64 layer, whose
padding bits would let two encodings verify), and it is checked before anything in the body is
decoded. The key is random per server process: a ticket from another server, or from this
server before a restart, fails the check. The body names a grant the server holds in memory
(its reader and splits), so a ticket stays small however many parts its split reads.
"""

from __future__ import annotations

import hashlib
import hmac
import os

import msgspec

from persist.flight._protocol import TicketInvalid

__all__ = ["TicketBody", "TicketSigner"]

VERSION = b"PT\x01"
MAC_BYTES = 32


class TicketBody(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    grant: str
    # Which of the grant's endpoints (a snapshot's split; 0 for a listen).
    index: int
    expires_ms: int


class TicketSigner:
    """Signs and verifies tickets with a key made when the server starts."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key if key is not None else os.urandom(32)
        self._decoder = msgspec.msgpack.Decoder(TicketBody)

    def _mac(self, signed: bytes) -> bytes:
        return hmac.new(self._key, signed, hashlib.sha256).digest()

    def sign(self, body: TicketBody) -> bytes:
        signed = VERSION + msgspec.msgpack.encode(body)
        return signed + self._mac(signed)

    def verify(self, ticket: bytes, now_ms: int) -> TicketBody:
        """The body of a ticket this signer made, unaltered and unexpired; else ``TicketInvalid``."""
        if len(ticket) <= len(VERSION) + MAC_BYTES or not ticket.startswith(VERSION):
            raise TicketInvalid("not a persist ticket")
        signed, mac = ticket[:-MAC_BYTES], ticket[-MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(signed)):
            raise TicketInvalid(
                "the ticket's signature does not match: altered, forged, or from another server "
                "or an earlier run of this one"
            )
        try:
            body = self._decoder.decode(signed[len(VERSION) :])
        except msgspec.DecodeError:
            # Only a holder of the key could have signed this: a bug, but still not a ticket.
            raise TicketInvalid("the ticket's body does not decode") from None
        if now_ms >= body.expires_ms:
            raise TicketInvalid(
                f"the ticket expired {(now_ms - body.expires_ms) / 1000:.1f} s ago; "
                "ask GetFlightInfo again"
            )
        return body
