"""The Open Inference Protocol's (KServe v2) tensors on HTTP: requests and answers to numpy.

One codec for every hop that reads or writes tensors: the instance (its handler's inputs
and outputs), omnid and the edge (which check nothing of them but pass them on), and the
gRPC front (oip_grpc.py), which speaks HTTP's form inside. It covers JSON tensors (data
flat or nested, BYTES as strings) and the binary tensor data extension as
`tritonclient.http` uses it by default: the JSON header's length in
`Inference-Header-Content-Length`, each binary tensor's size in its
`parameters.binary_data_size`, the tensors' bytes after the header in order. A request
is checked strictly (a handler must never see a tensor whose data does not match its
declared type and shape): what fails is an `OipError` with the status to answer.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import orjson

HEADER_LENGTH = "Inference-Header-Content-Length"
JSON_TYPE = "application/json"
BINARY_TYPE = "application/octet-stream"
MAX_ELEMENTS = 1 << 28  # per tensor: a shape past this is refused before anything is built
MAX_NESTING = 32  # levels of nested `data` lists

# OIP datatype -> numpy dtype (BYTES: an object array of `bytes`)
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}
_BY_DTYPE = {dtype: name for name, dtype in DTYPES.items() if name != "BYTES"}


class OipError(Exception):
    """A request or answer that breaks the protocol: `status` is the HTTP status to answer."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class InferRequest:
    """A decoded infer request. `outputs`: the names asked for (None: every output);
    `binary_outputs`: those to answer in binary; `binary_default`: the request asked
    binary for every output (`parameters.binary_data_output`)."""

    inputs: dict[str, np.ndarray]
    outputs: list[str] | None = None
    binary_outputs: set[str] = field(default_factory=set)
    id: str | None = None
    parameters: dict = field(default_factory=dict)
    binary_default: bool = False

    def wants_binary(self, name: str) -> bool:
        return self.binary_default or name in self.binary_outputs


def error_body(message: str) -> bytes:
    """An OIP error body: `{"error": "..."}` (what tritonclient reads as the message)."""
    return orjson.dumps({"error": message})


def datatype_of(array: np.ndarray) -> str:
    """The OIP datatype of a numpy array (object, str and bytes arrays are BYTES)."""
    if array.dtype == object or array.dtype.kind in "SU":
        return "BYTES"
    dtype = array.dtype if array.dtype.isnative else array.dtype.newbyteorder("=")
    name = _BY_DTYPE.get(dtype)
    if name is None:
        raise OipError(500, f"dtype {array.dtype} has no Open Inference Protocol datatype")
    return name


# ---- requests --------------------------------------------------------------------


def decode_request(
    body: bytes, headers: Mapping[str, str], max_elements: int = MAX_ELEMENTS
) -> InferRequest:
    """An infer request's body (JSON, or JSON and binary tensors) as numpy arrays."""
    header, binary = split_body(body, headers)
    if not isinstance(header, dict):
        raise OipError(400, "The request must be a JSON object.")
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise OipError(400, "'inputs' must be a non-empty list of tensors.")
    parameters = _object(header.get("parameters"), "parameters")
    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise OipError(400, "'id' must be a string.")
    tensors = BinaryReader(binary)
    arrays: dict[str, np.ndarray] = {}
    for i, spec in enumerate(inputs):
        name, array = decode_tensor(spec, tensors, f"inputs[{i}]", max_elements)
        if name in arrays:
            raise OipError(400, f"Input '{name}' is given twice.")
        arrays[name] = array
    tensors.check_consumed()
    outputs, binary_outputs = requested_outputs(header.get("outputs"))
    binary_default = parameters.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise OipError(400, "'parameters.binary_data_output' must be a boolean.")
    return InferRequest(arrays, outputs, binary_outputs, request_id, parameters, binary_default)


def requested_outputs(specs: object) -> tuple[list[str] | None, set[str]]:
    """The outputs a request names (None: all) and those it wants in binary."""
    if specs is None:
        return None, set()
    if not isinstance(specs, list):
        raise OipError(400, "'outputs' must be a list.")
    names, binary = [], set()
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise OipError(400, f"outputs[{i}] must be an object with a string 'name'.")
        params = _object(spec.get("parameters"), f"outputs[{i}].parameters")
        if params.get("binary_data") is True:
            binary.add(spec["name"])
        names.append(spec["name"])
    return names, binary


def encode_request(
    inputs: Mapping[str, np.ndarray],
    outputs: Iterable[str] | None = None,
    *,
    binary_inputs: bool = True,
    binary_outputs: bool = True,
    id: str | None = None,
    parameters: Mapping | None = None,
) -> tuple[bytes, dict[str, str]]:
    """An infer request's body and headers (the gRPC front's way into the HTTP path)."""
    header: dict = {}
    if id:
        header["id"] = id
    params = dict(parameters or {})
    tensors, chunks = [], []
    for name, array in inputs.items():
        tensor, raw = encode_tensor(name, np.asarray(array), binary_inputs)
        tensors.append(tensor)
        chunks.append(raw)
    header["inputs"] = tensors
    if outputs is not None:
        header["outputs"] = [
            {"name": n, "parameters": {"binary_data": binary_outputs}} for n in outputs
        ]
    elif binary_outputs:
        params["binary_data_output"] = True
    if params:
        header["parameters"] = params
    return join_body(header, chunks)


# ---- answers ---------------------------------------------------------------------


def encode_response(
    model: str,
    outputs: Mapping[str, np.ndarray],
    id: str | None,
    binary: set[str],
    version: str = "1",
) -> tuple[bytes, dict[str, str]]:
    """An infer answer's body and headers: the outputs named in `binary` as binary
    tensors after the JSON header, the others as JSON data."""
    header: dict = {"model_name": model, "model_version": version}
    if id:
        header["id"] = id
    tensors, chunks = [], []
    for name, array in outputs.items():
        tensor, raw = encode_tensor(name, np.asarray(array), name in binary)
        tensors.append(tensor)
        chunks.append(raw)
    header["outputs"] = tensors
    return join_body(header, chunks)


@dataclass
class InferResponse:
    """A decoded infer answer."""

    model_name: str
    model_version: str
    id: str | None
    outputs: dict[str, np.ndarray]


def decode_response(body: bytes, headers: Mapping[str, str]) -> InferResponse:
    """An infer answer's body as numpy arrays (the gRPC front reads the HTTP answer so)."""
    header, binary = split_body(body, headers)
    if not isinstance(header, dict) or not isinstance(header.get("outputs"), list):
        raise OipError(500, "The model's answer has no 'outputs' list.")
    tensors = BinaryReader(binary)
    outputs = {}
    for i, spec in enumerate(header["outputs"]):
        name, array = decode_tensor(spec, tensors, f"outputs[{i}]", MAX_ELEMENTS, status=500)
        outputs[name] = array
    return InferResponse(
        str(header.get("model_name", "")),
        str(header.get("model_version", "")),
        header.get("id") if isinstance(header.get("id"), str) else None,
        outputs,
    )


# ---- tensors ---------------------------------------------------------------------


def encode_tensor(name: str, array: np.ndarray, binary: bool) -> tuple[dict, bytes]:
    """A tensor's JSON object, and its raw bytes when it goes in binary (else b"")."""
    datatype = datatype_of(array)
    tensor: dict = {"name": name, "datatype": datatype, "shape": list(array.shape)}
    if binary:
        raw = to_raw(array, datatype)
        tensor["parameters"] = {"binary_data_size": len(raw)}
        return tensor, raw
    tensor["data"] = to_json_data(array, datatype)
    return tensor, b""


def to_raw(array: np.ndarray, datatype: str) -> bytes:
    """A tensor's bytes in the binary extension's layout: row-major, little-endian;
    BYTES as each element's 4-byte little-endian length, then the element."""
    if datatype != "BYTES":
        return np.ascontiguousarray(array, dtype=DTYPES[datatype].newbyteorder("<")).tobytes()
    parts = []
    for item in array.reshape(-1):
        data = as_bytes(item)
        parts.append(struct.pack("<I", len(data)))
        parts.append(data)
    return b"".join(parts)


def to_json_data(array: np.ndarray, datatype: str) -> list:
    """A tensor's elements as a flat JSON list (BYTES as UTF-8 strings)."""
    flat = array.reshape(-1)
    if datatype != "BYTES":
        return flat.tolist()
    try:
        return [as_bytes(item).decode() for item in flat]
    except UnicodeDecodeError:
        message = "A BYTES tensor that is not UTF-8 text must be sent in binary."
        raise OipError(400, message) from None


def as_bytes(item: object) -> bytes:
    if isinstance(item, bytes | bytearray | memoryview):
        return bytes(item)
    if isinstance(item, str | np.str_):
        return str(item).encode()
    raise OipError(500, f"BYTES element of type {type(item).__name__} is neither bytes nor str")


def decode_tensor(
    spec: object, tensors: BinaryReader, where: str, max_elements: int, status: int = 400
) -> tuple[str, np.ndarray]:
    """One tensor object (with its binary data, if any) as (name, array)."""
    if not isinstance(spec, dict):
        raise OipError(status, f"{where} must be a tensor object.")
    name, datatype, shape = spec.get("name"), spec.get("datatype"), spec.get("shape")
    if not isinstance(name, str) or not name:
        raise OipError(status, f"{where}.name must be a non-empty string.")
    where = f"tensor '{name}'"
    if datatype not in DTYPES:
        raise OipError(status, f"{where}: unknown datatype {datatype!r} (one of {sorted(DTYPES)}).")
    count = element_count(shape, where, max_elements, status)
    params = _object(spec.get("parameters"), f"{where}.parameters", status)
    size = params.get("binary_data_size")
    if size is not None:
        if "data" in spec:
            raise OipError(status, f"{where} has both 'data' and binary data.")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise OipError(status, f"{where}: binary_data_size must be an integer >= 0.")
        flat = from_raw(tensors.take(size, where), datatype, count, where, status)
    elif "data" in spec:
        flat = from_json_data(spec["data"], datatype, count, where, status)
    else:
        raise OipError(status, f"{where} has neither 'data' nor binary data.")
    return name, flat.reshape(shape)


def element_count(shape: object, where: str, max_elements: int, status: int) -> int:
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise OipError(status, f"{where}: shape must be a list of integers >= 0.")
    count = math.prod(shape)
    if count > max_elements:
        raise OipError(
            413 if status == 400 else status,
            f"{where}: shape {shape} holds {count} elements, past the limit of {max_elements}.",
        )
    return count


def from_raw(raw: bytes, datatype: str, count: int, where: str, status: int) -> np.ndarray:
    """A tensor's elements from its binary bytes, checked against its element count."""
    if datatype == "BYTES":
        return unpack_bytes(raw, count, where, status)
    dtype = DTYPES[datatype].newbyteorder("<")
    if len(raw) != count * dtype.itemsize:
        raise OipError(
            status,
            f"{where}: {len(raw)} bytes of data do not match its shape "
            f"({count} elements of {datatype} take {count * dtype.itemsize}).",
        )
    array = np.frombuffer(raw, dtype=dtype).astype(DTYPES[datatype], copy=True)
    if datatype == "BOOL" and array.view(np.uint8).max(initial=0) > 1:
        raise OipError(status, f"{where}: a BOOL byte is neither 0 nor 1.")
    return array


def unpack_bytes(raw: bytes, count: int, where: str, status: int) -> np.ndarray:
    """BYTES elements, each a 4-byte little-endian length then its bytes."""
    items, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise OipError(status, f"{where}: BYTES data ends inside an element's length.")
        (size,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + size > len(raw):
            raise OipError(status, f"{where}: a BYTES element runs past the tensor's data.")
        items.append(raw[offset : offset + size])
        offset += size
        if len(items) > count:
            break
    if len(items) != count:
        raise OipError(
            status, f"{where}: its data holds {len(items)}+ elements, its shape {count}."
        )
    array = np.empty(count, dtype=object)
    array[:] = items
    return array


def from_json_data(data: object, datatype: str, count: int, where: str, status: int):
    """A tensor's elements from JSON `data` (flat or nested), each of the datatype's
    base type: no bool for a number, no float for an integer, strings for BYTES."""
    flat = flatten(data, where, status)
    if len(flat) != count:
        raise OipError(status, f"{where}: data holds {len(flat)} elements, its shape {count}.")
    check_base_type(flat, datatype, where, status)
    if datatype == "BYTES":
        array = np.empty(count, dtype=object)
        array[:] = [item.encode() for item in flat]
        return array
    try:
        return np.array(flat, dtype=DTYPES[datatype])
    except (OverflowError, ValueError):
        raise OipError(status, f"{where}: a value is out of range for {datatype}.") from None


def flatten(data: object, where: str, status: int) -> list:
    """Nested lists' scalars in row-major order (without recursion)."""
    if not isinstance(data, list):
        return [data]
    out: list = []
    stack = [(iter(data), 0)]
    while stack:
        items, depth = stack[-1]
        item = next(items, _END)
        if item is _END:
            stack.pop()
        elif isinstance(item, list):
            if depth + 1 >= MAX_NESTING:
                raise OipError(status, f"{where}: data nests deeper than {MAX_NESTING} levels.")
            stack.append((iter(item), depth + 1))
        else:
            out.append(item)
    return out


_END = object()


def check_base_type(flat: list, datatype: str, where: str, status: int) -> None:
    if datatype == "BYTES":
        ok = all(isinstance(v, str) for v in flat)
        expected = "strings"
    elif datatype == "BOOL":
        ok = all(isinstance(v, bool) for v in flat)
        expected = "booleans"
    elif datatype.startswith(("INT", "UINT")):
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in flat)
        expected = "integers"
    else:
        ok = all(isinstance(v, int | float) and not isinstance(v, bool) for v in flat)
        expected = "numbers"
    if not ok:
        raise OipError(status, f"{where}: {datatype} data must be {expected}.")


# ---- framing ---------------------------------------------------------------------


class BinaryReader:
    """The binary part of a body, handed out to tensors in order."""

    def __init__(self, data: bytes):
        self.data, self.offset = data, 0

    def take(self, size: int, where: str) -> bytes:
        if self.offset + size > len(self.data):
            raise OipError(
                400,
                f"{where}: binary_data_size {size} runs past the body's binary data "
                f"({len(self.data) - self.offset} bytes left).",
            )
        chunk = self.data[self.offset : self.offset + size]
        self.offset += size
        return chunk

    def check_consumed(self) -> None:
        if self.offset != len(self.data):
            raise OipError(
                400, f"{len(self.data) - self.offset} bytes of binary data belong to no input."
            )


def split_body(body: bytes, headers: Mapping[str, str]) -> tuple[object, bytes]:
    """The JSON header (parsed) and the binary data after it."""
    length = header_length(headers)
    if length is None:
        length = len(body)
    elif length > len(body):
        raise OipError(400, f"{HEADER_LENGTH} {length} is past the body's {len(body)} bytes.")
    try:
        return orjson.loads(body[:length]), body[length:]
    except orjson.JSONDecodeError:
        raise OipError(400, "The request's JSON header is not valid JSON.") from None


def header_length(headers: Mapping[str, str]) -> int | None:
    value = next((v for k, v in headers.items() if k.lower() == HEADER_LENGTH.lower()), None)
    if value is None:
        return None
    if not value.strip().isdigit():
        raise OipError(400, f"{HEADER_LENGTH} must be a number of bytes, not {value!r}.")
    return int(value)


def join_body(header: dict, chunks: list[bytes]) -> tuple[bytes, dict[str, str]]:
    """A body of the JSON header then the binary chunks, with the headers that say so."""
    head = orjson.dumps(header)
    if not any("binary_data_size" in t.get("parameters", {}) for t in _tensors(header)):
        return head, {"Content-Type": JSON_TYPE}
    return head + b"".join(chunks), {
        "Content-Type": BINARY_TYPE,
        HEADER_LENGTH: str(len(head)),
    }


def _tensors(header: dict) -> list[dict]:
    return [*header.get("inputs", []), *header.get("outputs", [])]


def _object(value: object, where: str, status: int = 400) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise OipError(status, f"'{where}' must be an object.")
    return value
