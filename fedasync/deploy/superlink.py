"""Our SuperLink: Flower 1.42's ``flower-superlink`` whose public port serves SuperNodes only.

Flower 1.42 serves its Fleet API (SuperNodes), Control API (submit, list and stop runs; register
and unregister SuperNodes) and Runtime API (its SuperExec and ServerApp processes) from one
FastAPI app on the SuperLink's one ``--port``, with no authentication of the Control or Runtime
callers: anyone who can reach the port and holds the CA certificate controls the federation
(``--control-api-address`` is deprecated and ignored).

``python -m fedasync.deploy.superlink [--control-port N] [--control-port-file PATH] -- <flower-superlink args>``
runs Flower's own code (its argument parsing, lifespan, SuperExec and app) and serves that one
app (one uvicorn server, one lifespan) on two listeners:

- the **public** listener, ``--host``/``--port`` (TLS as configured): only Fleet API requests
  (``/v1/fleet/<name>``, the paths a SuperNode sends) reach the app; every other request is
  answered 403 with one line, whoever sends it;
- the **control** listener, ``127.0.0.1:N`` (same TLS): everything. ``fedasync server``'s Control
  API client and ``flwr`` calls use it, and the SuperLink's SuperExec (and the ServerApp it
  starts) is given it as the Runtime API address. ``N`` 0 (the default) takes a free port; the
  port taken is written to ``--control-port-file``.

The two are told apart by the local address a request arrived on (ASGI ``scope["server"]``),
never by the caller's address, so a user on the server host is refused on the public port too.
Who can reach ``127.0.0.1:N`` is every user of the server host: the threat model in
``docs/deploy.md`` says so. If Flower's internals this relies on moved, the launcher exits 1 with
one line naming what is missing.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import socket
import sys
from pathlib import Path

CONTROL_HOST = "127.0.0.1"
FLEET_PATH = re.compile(r"/v1/fleet/[a-z][a-z-]*")  # exactly the Fleet API's routes (Flower 1.42)
REFUSED = (b"fedasync: this SuperLink port serves SuperNodes only (Fleet API); the Control and Runtime APIs "
           b"listen on the server host's loopback only\n")


class PublicFleetOnly:
    """ASGI wrapper: a request that arrived on ``control`` (the loopback listener's (host, port))
    reaches ``app``; on any other listener only a Fleet API path does, the rest get 403."""

    def __init__(self, app, control: tuple[str, int]):
        self.app = app
        self.control = control

    def allowed(self, scope) -> bool:
        server = scope.get("server")
        if server is not None and (server[0], server[1]) == self.control:
            return True
        return scope["type"] == "http" and FLEET_PATH.fullmatch(scope.get("path") or "") is not None

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            await send({"type": "http.response.start", "status": 403,
                        "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                    (b"content-length", str(len(REFUSED)).encode())]})
            await send({"type": "http.response.body", "body": REFUSED})


def bind(host: str, port: int) -> list[socket.socket]:
    """Listening-ready sockets for ``host:port`` (each address it resolves to, as asyncio binds
    them: SO_REUSEADDR, IPv6 sockets IPv6-only); OSError if one cannot be bound."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    try:
        for family, stype, proto, _, addr in dict.fromkeys((i[0], i[1], i[2], None, i[4]) for i in infos):
            s = socket.socket(family, stype, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
            s.set_inheritable(True)
    except OSError:
        for s in socks:
            s.close()
        raise
    return socks


def names_loopback(certfile: Path) -> bool:
    """Whether the TLS certificate ``certfile`` (PEM) holds 127.0.0.1 among its IP addresses (the
    control listener's clients connect to 127.0.0.1 and verify it); ``fedasync certs gen`` adds it."""
    import ipaddress

    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(certfile.read_bytes())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return False
    return ipaddress.ip_address(CONTROL_HOST) in sans.get_values_for_type(x509.IPAddress)


def _flower():
    """Flower 1.42's pieces this launcher wraps; SystemExit (one line) if one moved."""
    try:
        import importlib

        fs = importlib.import_module("flwr.superlink.cli.flower_superlink")  # the package exports a function so named
        from flwr.superlink.main import create_app

        return (fs._parse_superlink_lifespan_config, fs.SuperLinkLifespan, create_app, fs.get_uvicorn_log_config,
                fs.console_handler, fs.log, fs.event, fs.EventType)
    except (ImportError, AttributeError) as e:
        import flwr

        raise SystemExit(f"fedasync SuperLink: Flower {getattr(flwr, '__version__', '?')} lacks what it wraps "
                         f"(written for flwr 1.42.0): {e}") from None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    own, flower_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else ([], argv)
    p = argparse.ArgumentParser(prog="python -m fedasync.deploy.superlink",
                                description="Flower's SuperLink; its public port serves SuperNodes only.")
    p.add_argument("--control-port", type=int, default=0,
                   help="Port of the Control/Runtime listener on 127.0.0.1 (0: a free one).")
    p.add_argument("--control-port-file", type=Path, default=None,
                   help="Write the control listener's port here once it is bound.")
    args = p.parse_args(own)
    if not 0 <= args.control_port < 65536:
        raise SystemExit(f"--control-port: {args.control_port} is not a port")
    parse_config, lifespan_class, create_app, log_config, console_handler, log, event, event_type = _flower()
    import dataclasses
    from logging import INFO

    import uvicorn

    # Flower's own gRPC Control/Fleet servers (env-enabled compatibility paths) would bypass the filter
    for var in ("FLWR_INTERNAL_GRPC_CONTROL_API", "FLWR_INTERNAL_GRPC_FLEET_API"):
        os.environ.pop(var, None)
    sys.argv = ["flower-superlink", *flower_args]
    config = parse_config()
    try:
        public = bind(config.host, config.port)
    except OSError as e:
        in_use = e.errno == errno.EADDRINUSE
        raise SystemExit(f"--port: {config.host}:{config.port} {'is in use' if in_use else f'cannot be bound: {e}'}")
    try:
        control = bind(CONTROL_HOST, args.control_port)
    except OSError as e:
        raise SystemExit(f"--control-port: {CONTROL_HOST}:{args.control_port} cannot be bound: {e.strerror or e}")
    control_addr = control[0].getsockname()[:2]
    # the SuperExec Flower starts takes the Runtime API at config.host:config.port: the loopback listener
    app = create_app(dataclasses.replace(config, host=CONTROL_HOST, port=control_addr[1]), lifespan_class)
    log(INFO, "Starting Flower SuperLink (fedasync): Fleet API on %s:%s (SuperNodes only); Control and Runtime "
        "APIs on %s:%s", config.host, config.port, *control_addr)
    event(event_type.RUN_SUPERLINK_ENTER)
    server = uvicorn.Server(uvicorn.Config(
        app=PublicFleetOnly(app, control_addr), lifespan="on", reload=False, access_log=True,
        log_config=log_config(console_handler.level), ssl_keyfile=config.ssl_keyfile,
        ssl_certfile=config.ssl_certfile, workers=1))
    if args.control_port_file is not None:
        tmp = args.control_port_file.with_name(args.control_port_file.name + ".tmp")
        tmp.write_text(f"{control_addr[1]}\n")
        tmp.replace(args.control_port_file)
    server.run(sockets=public + control)


if __name__ == "__main__":
    main()
