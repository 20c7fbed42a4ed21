"""persist's Arrow Flight front end: any Flight client, in any language, reads and writes shards.

``persist serve --blob URI --consensus URI --port N`` (or ``serve(...)``, or ``FlightServer`` on
a running event loop) serves one location. The protocol (commands, tickets, listens, DoPut,
actions, errors, auth, metrics) is ``docs/flight.md``; ``docs/design.md`` says how the
server is built.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import Any

from persist.errors import install_hint

try:
    import prometheus_client  # noqa: F401
except ImportError:  # pragma: no cover - depends on the install
    raise ImportError(
        "persist.flight (and persist serve) need persist's 'flight' extra "
        f"(prometheus_client is not installed): {install_hint('flight')}"
    ) from None

from persist.flight._client import StreamingWriter
from persist.flight._protocol import TicketInvalid
from persist.flight._server import ENV_TOKEN, FlightServer

__all__ = ["ENV_TOKEN", "FlightServer", "StreamingWriter", "TicketInvalid", "serve"]

log = logging.getLogger("persist")


def serve(**kwargs: Any) -> None:
    """Runs a ``FlightServer(**kwargs)`` until SIGTERM or SIGINT, then drains it and returns.

    Prints ``persist flight serving <uri>`` once it accepts calls (the line a supervisor or a
    test waits for). The drain takes at most about ``drain_grace_s`` + 5 s, whatever the
    clients do; when it had to leave a gRPC thread stuck in a call behind
    (``FlightServer.left_behind``), this ends the process with status 0 instead of returning,
    once everything was committed and released."""
    if asyncio.run(_serve(kwargs)):
        # A normal exit would hang: pyarrow's exit-time finalizer of the server calls gRPC's
        # shutdown again, which waits forever behind the stuck one (seen: the main thread
        # blocked in grpc::Server::ShutdownInternal), and were the call to end later, its
        # thread would enter a half-finalized interpreter. Nothing is left to do but exit: the
        # drain committed and released everything; only the log and the streams need flushing.
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(0)


async def _serve(kwargs: dict[str, Any]) -> bool:
    """Serves until a signal, drains; whether the drain left a gRPC thread behind."""
    # The process is the server's: let a gRPC thread that has a write or an ack to pass on
    # take the GIL from a busy loop within half a millisecond, not the default 5 ms (an ack's
    # latency, not throughput, is what the streaming clients wait on).
    sys.setswitchinterval(0.0005)
    server = FlightServer(**kwargs)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        print(f"persist flight serving {server.uri}", flush=True)
        if server.metrics_uri is not None:
            print(f"persist flight metrics at {server.metrics_uri}", flush=True)
        await stop.wait()
        log.info("persist flight: draining")
    finally:
        await server.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return server.left_behind
