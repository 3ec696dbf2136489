"""The OIP codec (omni/api/oip.py): every datatype round trips in JSON and in binary, and
what breaks the protocol is refused with a clear message and the right status."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from omni.api import oip

NUMERIC = [t for t in oip.DTYPES if t != "BYTES"]


def random_tensor(datatype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if datatype == "BYTES":
        words = [rng.bytes(int(rng.integers(0, 9))).hex().encode() for _ in range(np.prod(shape))]
        array = np.empty(len(words), dtype=object)
        array[:] = words
        return array.reshape(shape)
    dtype = oip.DTYPES[datatype]
    if datatype == "BOOL":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(shape).astype(dtype)


def assert_same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.tolist() == b.tolist()


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("datatype", list(oip.DTYPES))
def test_request_round_trip(datatype: str, binary: bool) -> None:
    rng = np.random.default_rng()
    inputs = {"a": random_tensor(datatype, (2, 3), rng), "b": random_tensor(datatype, (4,), rng)}
    body, headers = oip.encode_request(inputs, ["y"], binary_inputs=binary, id="r1")
    assert (oip.HEADER_LENGTH in headers) == binary
    req = oip.decode_request(body, headers)
    assert req.id == "r1" and req.outputs == ["y"] and req.binary_outputs == {"y"}
    for name, array in inputs.items():
        assert_same(req.inputs[name], array)


@pytest.mark.parametrize("datatype", list(oip.DTYPES))
def test_response_round_trip(datatype: str) -> None:
    rng = np.random.default_rng()
    outputs = {"x": random_tensor(datatype, (3, 2), rng), "y": random_tensor(datatype, (0,), rng)}
    body, headers = oip.encode_response("m", outputs, "id7", binary={"x"})
    answer = oip.decode_response(body, headers)
    assert (answer.model_name, answer.model_version, answer.id) == ("m", "1", "id7")
    for name, array in outputs.items():
        assert_same(answer.outputs[name], array)
    header = orjson.loads(body[: int(headers[oip.HEADER_LENGTH])])
    assert "data" in header["outputs"][1] and "parameters" in header["outputs"][0]


def test_json_only_answer_has_no_binary_header() -> None:
    body, headers = oip.encode_response("m", {"x": np.arange(3, dtype=np.int32)}, None, set())
    assert headers == {"Content-Type": "application/json"}
    assert orjson.loads(body)["outputs"][0]["data"] == [0, 1, 2]


def test_nested_json_data_and_strings() -> None:
    body = orjson.dumps(
        {
            "inputs": [
                {"name": "f", "shape": [2, 2], "datatype": "FP32", "data": [[1, 2.5], [3, 4]]},
                {"name": "s", "shape": [2], "datatype": "BYTES", "data": ["héllo", ""]},
            ],
            "parameters": {"binary_data_output": True},
        }
    )
    req = oip.decode_request(body, {})
    assert req.inputs["f"].tolist() == [[1.0, 2.5], [3.0, 4.0]]
    assert req.inputs["s"].tolist() == ["héllo".encode(), b""]
    assert req.outputs is None and req.wants_binary("anything")


def test_binary_and_json_inputs_mixed() -> None:
    raw = np.arange(4, dtype="<i8").tobytes()
    head = orjson.dumps(
        {
            "inputs": [
                {"name": "j", "shape": [1], "datatype": "BOOL", "data": [True]},
                {
                    "name": "b",
                    "shape": [2, 2],
                    "datatype": "INT64",
                    "parameters": {"binary_data_size": len(raw)},
                },
            ]
        }
    )
    req = oip.decode_request(head + raw, {oip.HEADER_LENGTH: str(len(head))})
    assert req.inputs["b"].tolist() == [[0, 1], [2, 3]] and req.inputs["j"].tolist() == [True]


def tensor_body(**tensor) -> bytes:
    return orjson.dumps({"inputs": [{"name": "x", **tensor}]})


@pytest.mark.parametrize(
    ("tensor", "status", "words"),
    [
        ({"shape": [2], "datatype": "FP8", "data": [1, 2]}, 400, "unknown datatype"),
        ({"shape": [3], "datatype": "FP32", "data": [1, 2]}, 400, "2 elements, its shape 3"),
        ({"shape": [2], "datatype": "INT32", "data": [1, 2.5]}, 400, "must be integers"),
        ({"shape": [1], "datatype": "INT32", "data": [True]}, 400, "must be integers"),
        ({"shape": [1], "datatype": "BOOL", "data": [1]}, 400, "must be booleans"),
        ({"shape": [1], "datatype": "BYTES", "data": [1]}, 400, "must be strings"),
        ({"shape": [1], "datatype": "UINT8", "data": [256]}, 400, "out of range"),
        ({"shape": [1], "datatype": "INT8", "data": [-129]}, 400, "out of range"),
        ({"shape": [-1], "datatype": "FP32", "data": [1]}, 400, "shape must be"),
        ({"shape": [1 << 20, 1 << 20], "datatype": "FP32", "data": [1]}, 413, "past the limit"),
        ({"shape": [1], "datatype": "FP32"}, 400, "neither 'data' nor binary"),
    ],
)
def test_bad_json_tensors(tensor: dict, status: int, words: str) -> None:
    with pytest.raises(oip.OipError) as err:
        oip.decode_request(tensor_body(**tensor), {})
    assert err.value.status == status and words in err.value.message
    assert "'x'" in err.value.message


def test_bad_binary_tensors() -> None:
    def decode(size: int, raw: bytes, datatype: str = "FP32", shape=(2,)):
        params = {"binary_data_size": size}
        head = tensor_body(shape=list(shape), datatype=datatype, parameters=params)
        return oip.decode_request(head + raw, {oip.HEADER_LENGTH: str(len(head))})

    with pytest.raises(oip.OipError, match="do not match its shape"):
        decode(4, b"\0" * 4)
    with pytest.raises(oip.OipError, match="runs past"):
        decode(8, b"\0" * 4)
    with pytest.raises(oip.OipError, match="belong to no input"):
        decode(8, b"\0" * 12)
    with pytest.raises(oip.OipError, match="BYTES element runs past"):
        decode(6, b"\x09\0\0\0ab", "BYTES", (1,))
    with pytest.raises(oip.OipError, match="neither 0 nor 1"):
        decode(2, b"\x01\x07", "BOOL")


def test_bad_bodies() -> None:
    with pytest.raises(oip.OipError, match="not valid JSON"):
        oip.decode_request(b"{", {})
    with pytest.raises(oip.OipError, match="non-empty list"):
        oip.decode_request(b'{"inputs": []}', {})
    with pytest.raises(oip.OipError, match="past the body"):
        oip.decode_request(b"{}", {oip.HEADER_LENGTH: "9"})
    with pytest.raises(oip.OipError, match="twice"):
        x = {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}
        oip.decode_request(orjson.dumps({"inputs": [x, x]}), {})
    assert orjson.loads(oip.error_body("no")) == {"error": "no"}


def test_json_output_of_non_utf8_bytes_is_refused() -> None:
    array = np.array([b"\xff"], dtype=object)
    with pytest.raises(oip.OipError, match="binary"):
        oip.encode_response("m", {"x": array}, None, set())
