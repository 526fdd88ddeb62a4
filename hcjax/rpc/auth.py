"""Who may call hcjax's gRPC services: a shared token checked on every RPC, optional TLS, and
loopback-only binding unless a caller asks for more. Used by every server (hcjax.rpc.server)
and client we build.

Configuration comes from flags or, so that child processes and launchers inherit it, from the
environment: HCJAX_TOKEN (the token itself) or HCJAX_TOKEN_FILE (a file holding it), and
HCJAX_TLS_DIR (a folder with cert.pem and key.pem for servers; clients trust its ca.pem, or
cert.pem for a self-signed certificate). With none of them set, services run as before: no token,
plaintext, which `check_exposure` refuses on anything but a loopback address.
This module must not know about any particular service.
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import ipaddress
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc

__all__ = [
    "TLS_DIR_ENV",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "Security",
    "add_port",
    "check_exposure",
    "is_loopback",
    "open_channel",
]

TOKEN_ENV = "HCJAX_TOKEN"
TOKEN_FILE_ENV = "HCJAX_TOKEN_FILE"
TLS_DIR_ENV = "HCJAX_TLS_DIR"
TLS_NAME_ENV = "HCJAX_TLS_SERVER_NAME"  # name to check the server certificate against
_HEADER = "authorization"
_SCHEME = "Bearer "
_MIN_TOKEN_CHARS = 16


def _read_token_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        raise ValueError(f"token file {path!r} cannot be read: {e.strerror}") from None
    if not token:
        raise ValueError(f"token file {path!r} is empty")
    return token


def _check_token(token: str, where: str) -> str:
    # Metadata values must be printable ASCII; a short token is guessable.
    if not token.isascii() or not token.isprintable() or " " in token:
        raise ValueError(f"the token from {where} must be printable ASCII without spaces")
    if len(token) < _MIN_TOKEN_CHARS:
        raise ValueError(f"the token from {where} has {len(token)} characters; use at least "
                         f"{_MIN_TOKEN_CHARS} (e.g. `openssl rand -hex 32`)")
    return token


@dataclasses.dataclass(frozen=True)
class Security:
    """Token and TLS settings shared by a service and its clients.

    token: every RPC must carry it (None: no authentication).
    tls_dir: folder with cert.pem + key.pem (server side) and ca.pem or cert.pem (client side).
    server_name: the name a client checks the server certificate against (default: the host it
      dials), for certificates issued to a name other than the address used.
    """

    token: str | None = None
    tls_dir: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if self.token is not None:
            _check_token(self.token, "Security(token=...)")
        if self.tls_dir is not None and not os.path.isdir(self.tls_dir):
            raise ValueError(f"tls_dir={self.tls_dir!r} is not a directory")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, token_file: str | None = None,
                 tls_dir: str | None = None) -> Security:
        """Settings from flags (`token_file`, `tls_dir`) where given, else from the environment."""
        env = os.environ if env is None else env
        token = None
        if token_file:
            token = _check_token(_read_token_file(token_file), f"--token_file {token_file}")
        elif env.get(TOKEN_ENV):
            token = _check_token(env[TOKEN_ENV], TOKEN_ENV)
        elif env.get(TOKEN_FILE_ENV):
            path = env[TOKEN_FILE_ENV]
            token = _check_token(_read_token_file(path), f"{TOKEN_FILE_ENV}={path}")
        return cls(token=token, tls_dir=tls_dir or env.get(TLS_DIR_ENV) or None,
                   server_name=env.get(TLS_NAME_ENV) or None)

    @property
    def tls(self) -> bool:
        return self.tls_dir is not None

    def _read(self, name: str) -> bytes:
        path = os.path.join(self.tls_dir, name)
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"TLS file {path!r} cannot be read: {e.strerror}") from None

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self._read("key.pem"), self._read("cert.pem"))])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        name = "ca.pem" if os.path.exists(os.path.join(self.tls_dir, "ca.pem")) else "cert.pem"
        return grpc.ssl_channel_credentials(root_certificates=self._read(name))

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """For `hcjax.rpc.server.RpcServer` (an asyncio gRPC server)."""
        return [] if self.token is None else [_TokenCheck(self.token)]

    def describe(self) -> dict:
        """What a serving line may print: whether a token and TLS are on (never the token)."""
        return {"auth": "token" if self.token else "none", "tls": self.tls}


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, security: Security, *, allow_unauthenticated: bool = False) -> None:
    """Refuse to serve without a token on anything but loopback, unless explicitly allowed."""
    if is_loopback(host) or security.token is not None or allow_unauthenticated:
        return
    raise ValueError(
        f"host={host!r} is not a loopback address and no token is configured: anyone who can "
        f"reach it could use the service. Set {TOKEN_ENV} or {TOKEN_FILE_ENV} (or --token_file), "
        "or pass --allow_unauthenticated to accept that")


def add_port(server: grpc.Server, address: str, security: Security) -> int:
    """Bind `address` on `server` (TLS when configured); returns the bound port."""
    try:
        if security.tls:
            port = server.add_secure_port(address, security.server_credentials())
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as e:  # grpc raises RuntimeError when it cannot bind
        raise OSError(f"could not bind {address}: {e}") from None
    if port == 0:
        raise OSError(f"could not bind {address}")
    return port


def open_channel(address: str, security: Security | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A channel to `address` that sends the token with every call (and speaks TLS if set)."""
    security = Security.from_env() if security is None else security
    options = list(options)
    if security.tls:
        if security.server_name:
            options.append(("grpc.ssl_target_name_override", security.server_name))
        channel = grpc.secure_channel(address, security.channel_credentials(), options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    if security.token is not None:
        channel = grpc.intercept_channel(channel, _TokenSend(security.token))
    return channel


# Server side: check the token ----------------------------------------------------------------


def _deny(message: str) -> Callable:
    async def behaviour(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return behaviour


class _TokenCheck(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED, without running the method, when the token is missing or wrong."""

    def __init__(self, token: str) -> None:
        self._expected = (_SCHEME + token).encode()

    async def intercept_service(self, continuation, handler_call_details):
        sent = dict(handler_call_details.invocation_metadata or ()).get(_HEADER)
        handler = await continuation(handler_call_details)
        if handler is None or (sent is not None and
                               hmac.compare_digest(str(sent).encode(), self._expected)):
            return handler
        why = ("missing 'authorization' metadata: this service needs its shared token"
               if sent is None else "wrong token")
        # Same call shape as the real method, so the client sees a status, not a protocol error.
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(_deny(why))
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(_deny(why))
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(_deny(why))
        return grpc.unary_unary_rpc_method_handler(_deny(why))


# Client side: send the token -----------------------------------------------------------------

_CallDetails = collections.namedtuple(
    "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                     "compression"))


class _TokenSend(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._header = (_HEADER, _SCHEME + token)

    def _details(self, d):
        metadata = [*(d.metadata or ()), self._header]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials,
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)
