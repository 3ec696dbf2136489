"""The Open Inference Protocol over gRPC, as a front to the same server's HTTP routes.

Each call is translated into its HTTP form (omni/api/oip.py) and sent to the HTTP
listener of the process that runs the front, on loopback: on the edge it is then
authenticated, rate limited, queued fairly for a permit and relayed like any HTTP
request, and on omnid admitted to its instance the same way. One path, one set of rules.
Tensors go as binary both ways (`raw_input_contents`, `raw_output_contents`, as
`tritonclient.grpc` sends and reads them); typed `contents` are accepted too.

The messages come from grpc_predict_v2.proto beside this file, compiled when this module
is imported into a descriptor pool of its own: a process may also hold Triton's client,
whose generated code puts the same `inference.*` names in protobuf's default pool.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import orjson
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from . import oip

log = logging.getLogger(__name__)

PROTO = Path(__file__).with_name("grpc_predict_v2.proto")
SERVICE = "inference.GRPCInferenceService"
# gRPC metadata passed on to the HTTP route as headers (the rest is dropped)
FORWARDED_METADATA = ("authorization", "x-session-affinity", "x-omni-deadline-ms", "traceparent")
MAX_MESSAGE_BYTES = 64 << 20
STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.UNIMPLEMENTED,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
# typed contents' field per datatype (FP16 has none: it travels raw only)
CONTENTS_FIELDS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def compile_proto(proto: Path = PROTO) -> descriptor_pool.DescriptorPool:
    """The .proto's descriptors, in a pool of their own (protoc run in-process)."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory(prefix="omni-proto-") as tmp:
        out = Path(tmp) / "descriptors.pb"
        argv = ["protoc", f"-I{proto.parent}", f"--descriptor_set_out={out}", proto.name]
        if protoc.main(argv) != 0:
            raise RuntimeError(f"protoc could not compile {proto}")
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for file in files.file:
        pool.Add(file)
    return pool


class Messages:
    """The protocol's message classes, by their names in the .proto."""

    def __init__(self, pool: descriptor_pool.DescriptorPool):
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        descriptor = self._pool.FindMessageTypeByName(f"inference.{name}")
        if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.22
            cls = message_factory.GetMessageClass(descriptor)
        else:
            cls = message_factory.MessageFactory(pool=self._pool).GetPrototype(descriptor)
        setattr(self, name, cls)
        return cls


pb = Messages(compile_proto())
# method -> (request message, response message)
METHODS = {
    "ServerLive": ("ServerLiveRequest", "ServerLiveResponse"),
    "ServerReady": ("ServerReadyRequest", "ServerReadyResponse"),
    "ModelReady": ("ModelReadyRequest", "ModelReadyResponse"),
    "ServerMetadata": ("ServerMetadataRequest", "ServerMetadataResponse"),
    "ModelMetadata": ("ModelMetadataRequest", "ModelMetadataResponse"),
    "ModelInfer": ("ModelInferRequest", "ModelInferResponse"),
}


class HttpAnswer:
    """An HTTP answer as the front reads it."""

    def __init__(self, status: int, headers: Mapping[str, str], body: bytes):
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> dict:
        try:
            data = orjson.loads(self.body)
        except orjson.JSONDecodeError:
            return {}
        return data if isinstance(data, dict) else {}

    def error_message(self) -> str:
        """The message of an OIP error body (or of an OpenAI one, from a /v1 layer)."""
        error = self.json().get("error")
        if isinstance(error, dict):
            error = error.get("message")
        return str(error) if error else f"HTTP status {self.status}"


class ListenError(RuntimeError):
    """The gRPC front's port cannot be listened on."""


class GrpcFront:
    """GRPCInferenceService, each call sent to `http_url` (this process's HTTP listener)."""

    def __init__(self, http_url: str):
        self.http_url = http_url.rstrip("/")
        self.session: aiohttp.ClientSession | None = None
        self.server: grpc.aio.Server | None = None

    async def start(self, bind: str) -> int:
        """Serve on `bind` (HOST:PORT); returns the port. ListenError if it is taken."""
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),  # as many calls as the clients make
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        )
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),  # a second server on the port fails instead of sharing
        ]
        self.server = grpc.aio.server(options=options)
        self.server.add_generic_rpc_handlers((self.handlers(),))
        port = 0
        if can_listen(bind):  # (else gRPC's own bind failure adds a line of C-core noise)
            with contextlib.suppress(RuntimeError):
                port = self.server.add_insecure_port(bind)
        if port == 0:
            await self.stop()
            raise ListenError(f"gRPC: cannot listen on {bind}")
        await self.server.start()
        return port

    async def stop(self, grace_s: float = 1.0) -> None:
        if self.server is not None:
            await self.server.stop(grace_s)
        if self.session is not None:
            await self.session.close()

    def handlers(self) -> grpc.GenericRpcHandler:
        calls: dict[str, Callable] = {
            "ServerLive": self.server_live,
            "ServerReady": self.server_ready,
            "ModelReady": self.model_ready,
            "ServerMetadata": self.server_metadata,
            "ModelMetadata": self.model_metadata,
            "ModelInfer": self.model_infer,
        }
        handlers = {}
        for method, call in calls.items():
            request, response = (getattr(pb, name) for name in METHODS[method])
            handlers[method] = grpc.unary_unary_rpc_method_handler(
                call,
                request_deserializer=request.FromString,
                response_serializer=response.SerializeToString,
            )
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    # ---- calls ---------------------------------------------------------------

    async def server_live(self, _request, context) -> Any:
        answer = await self.http(context, "GET", "/v2/health/live")
        return pb.ServerLiveResponse(live=answer.status == 200)

    async def server_ready(self, _request, context) -> Any:
        answer = await self.http(context, "GET", "/v2/health/ready")
        return pb.ServerReadyResponse(ready=answer.status == 200)

    async def model_ready(self, request, context) -> Any:
        answer = await self.http(
            context, "GET", model_path(request.name, request.version, "/ready")
        )
        if answer.status in (401, 403, 429):  # not an answer about the model
            await abort(context, answer)
        return pb.ModelReadyResponse(ready=answer.status == 200)

    async def server_metadata(self, _request, context) -> Any:
        answer = await self.checked(context, "GET", "/v2")
        data = answer.json()
        return pb.ServerMetadataResponse(
            name=str(data.get("name", "")),
            version=str(data.get("version", "")),
            extensions=[str(e) for e in data.get("extensions", [])],
        )

    async def model_metadata(self, request, context) -> Any:
        answer = await self.checked(context, "GET", model_path(request.name, request.version))
        data = answer.json()
        return pb.ModelMetadataResponse(
            name=str(data.get("name", "")),
            versions=[str(v) for v in data.get("versions", [])],
            platform=str(data.get("platform", "")),
            inputs=[tensor_metadata(t) for t in data.get("inputs", [])],
            outputs=[tensor_metadata(t) for t in data.get("outputs", [])],
        )

    async def model_infer(self, request, context) -> Any:
        try:
            body, headers = http_infer_request(request)
        except oip.OipError as exc:
            await context.abort(STATUS_CODES.get(exc.status, grpc.StatusCode.INTERNAL), exc.message)
        path = model_path(request.model_name, request.model_version, "/infer")
        answer = await self.checked(context, "POST", path, body, headers)
        try:
            result = oip.decode_response(answer.body, answer.headers)
        except oip.OipError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"malformed answer: {exc.message}")
        return infer_response(result)

    # ---- HTTP ----------------------------------------------------------------

    async def checked(self, context, method: str, path: str, body=None, headers=None):
        """The HTTP answer, or the call aborted with the status its error maps to."""
        answer = await self.http(context, method, path, body, headers)
        if answer.status != 200:
            await abort(context, answer)
        return answer

    async def http(
        self, context, method: str, path: str, body: bytes | None = None, headers=None
    ) -> HttpAnswer:
        assert self.session is not None
        sent = {**forwarded_headers(context), **(headers or {})}
        try:
            async with self.session.request(
                method, self.http_url + path, data=body, headers=sent
            ) as resp:
                return HttpAnswer(resp.status, resp.headers, await resp.read())
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.warning("gRPC front: HTTP listener %s unreachable: %s", self.http_url, exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "The server is unavailable.")
            raise  # (abort raises)


async def abort(context, answer: HttpAnswer) -> None:
    """End the call with the gRPC status of the HTTP one, its message, and its
    Retry-After as trailing metadata (`retry-after`)."""
    code = STATUS_CODES.get(answer.status, grpc.StatusCode.INTERNAL)
    retry_after = answer.headers.get("Retry-After")
    trailers = (("retry-after", retry_after),) if retry_after else ()
    await context.abort(code, answer.error_message(), trailing_metadata=trailers)


def model_path(name: str, version: str, suffix: str = "") -> str:
    from urllib.parse import quote

    path = f"/v2/models/{quote(name, safe='')}"
    if version:
        path += f"/versions/{quote(version, safe='')}"
    return path + suffix


def forwarded_headers(context) -> dict[str, str]:
    """The call's metadata that the HTTP route reads, and its deadline as the edge's
    deadline header when the client set one and no header says otherwise."""
    headers = {}
    for key, value in context.invocation_metadata() or ():
        if key.lower() in FORWARDED_METADATA and isinstance(value, str):
            headers[key.lower()] = value
    remaining = context.time_remaining()
    if remaining is not None and "x-omni-deadline-ms" not in headers:
        headers["x-omni-deadline-ms"] = str(max(1, int(remaining * 1000)))
    return headers


def tensor_metadata(data: object) -> Any:
    if not isinstance(data, dict):
        return pb.ModelMetadataResponse.TensorMetadata()
    return pb.ModelMetadataResponse.TensorMetadata(
        name=str(data.get("name", "")),
        datatype=str(data.get("datatype", "")),
        shape=[int(d) for d in data.get("shape", []) if isinstance(d, int)],
    )


# ---- ModelInfer <-> HTTP -------------------------------------------------------------


def http_infer_request(request) -> tuple[bytes, dict[str, str]]:
    """A ModelInferRequest as an HTTP infer request, every tensor in binary."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise oip.OipError(
            400,
            f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs: give all or none.",
        )
    tensors, chunks = [], []
    for i, tensor in enumerate(request.inputs):
        data = raw[i] if raw else contents_bytes(tensor)
        params = {**parameters(tensor.parameters), "binary_data_size": len(data)}
        tensors.append(
            {
                "name": tensor.name,
                "datatype": tensor.datatype,
                "shape": list(tensor.shape),
                "parameters": params,
            }
        )
        chunks.append(data)
    header: dict = {"inputs": tensors}
    if request.id:
        header["id"] = request.id
    params = parameters(request.parameters)
    if request.outputs:
        header["outputs"] = [
            {"name": o.name, "parameters": {**parameters(o.parameters), "binary_data": True}}
            for o in request.outputs
        ]
    else:
        params["binary_data_output"] = True
    header["parameters"] = params
    return oip.join_body(header, chunks)


def contents_bytes(tensor) -> bytes:
    """An input's typed `contents` in the binary layout (checked against its shape by
    the HTTP route, like any binary tensor)."""
    field = CONTENTS_FIELDS.get(tensor.datatype)
    if field is None:
        if tensor.datatype in oip.DTYPES:
            raise oip.OipError(400, f"tensor '{tensor.name}': {tensor.datatype} goes raw only.")
        raise oip.OipError(400, f"tensor '{tensor.name}': unknown datatype {tensor.datatype!r}.")
    values = list(getattr(tensor.contents, field))
    if tensor.datatype == "BYTES":
        array = np.empty(len(values), dtype=object)
        array[:] = values
    else:
        try:
            array = np.array(values, dtype=oip.DTYPES[tensor.datatype])
        except OverflowError:
            raise oip.OipError(
                400, f"tensor '{tensor.name}': a value is out of range for {tensor.datatype}."
            ) from None
    return oip.to_raw(array, tensor.datatype)


def parameters(params) -> dict:
    """A protobuf parameter map as JSON values."""
    out = {}
    for key, value in params.items():
        kind = value.WhichOneof("parameter_choice")
        if kind is not None:
            out[key] = getattr(value, kind)
    return out


def infer_response(result: oip.InferResponse) -> Any:
    """An HTTP infer answer as a ModelInferResponse, every output raw."""
    response = pb.ModelInferResponse(
        model_name=result.model_name, model_version=result.model_version, id=result.id or ""
    )
    for name, array in result.outputs.items():
        datatype = oip.datatype_of(array)
        response.outputs.add(name=name, datatype=datatype, shape=list(array.shape))
        response.raw_output_contents.append(oip.to_raw(array, datatype))
    return response


def parse_port(value: str, default_host: str) -> str | None:
    """`--grpc-port`: PORT (on `default_host`), HOST:PORT, or `off` (None)."""
    text = str(value).strip()
    if text.lower() == "off":
        return None
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = default_host, text
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--grpc-port: expected PORT, HOST:PORT or off, not {value!r}")
    host = host.strip("[]") or default_host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def can_listen(bind: str) -> bool:
    """Whether HOST:PORT (IPv6 in brackets) may be listened on now."""
    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, int(port)))
        except OSError:
            return False
    return True


def loopback_url(host: str, port: int) -> str:
    """The URL this process's own HTTP listener, bound to `host`, is reached at."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def start_front(bind: str | None, http_url: str, required: bool) -> GrpcFront | None:
    """The gRPC front on `bind` (None: off). A port that is taken fails the start when it
    was asked for (`required`); a default one is given up with a warning, HTTP serves on."""
    if bind is None:
        return None
    front = GrpcFront(http_url)
    try:
        await front.start(bind)
    except ListenError as exc:
        if required:
            raise
        log.warning("%s: serving without gRPC (choose one with --grpc-port)", exc)
        return None
    log.info("Open Inference Protocol over gRPC on %s", bind)
    return front
