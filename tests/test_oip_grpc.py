"""The gRPC front's translation (omni/api/oip_grpc.py), without a server: a
ModelInferRequest becomes the HTTP request the codec reads back to the same tensors, an
HTTP answer becomes raw output contents, and the protocol's messages match the ones
Triton's client was generated from, field for field."""

from __future__ import annotations

import asyncio
import logging
import socket

import numpy as np
import pytest
from click.testing import CliRunner
from tritonclient.grpc import service_pb2

from omni import cli
from omni.api import oip, oip_grpc
from tests.test_oip_codec import assert_same, random_tensor

TYPED = [t for t in oip.DTYPES if t != "FP16"]  # FP16 has no typed contents field


def fields(descriptor, prefix: str = "") -> dict[str, tuple]:
    out = {}
    for field in descriptor.fields:
        kind = field.message_type.full_name if field.message_type else field.type
        out[prefix + field.name] = (field.number, kind)
    for nested in descriptor.nested_types:
        if not nested.GetOptions().map_entry:
            out |= fields(nested, f"{prefix}{nested.name}.")
    return out


@pytest.mark.parametrize("method", list(oip_grpc.METHODS))
def test_messages_match_tritons(method: str) -> None:
    """Same numbers and types as the definitions tritonclient.grpc speaks (in one process
    with it: the front's pool is its own)."""
    for name in oip_grpc.METHODS[method]:
        ours = getattr(oip_grpc.pb, name).DESCRIPTOR
        assert fields(ours) == fields(service_pb2.DESCRIPTOR.message_types_by_name[name])
    service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert service.full_name == oip_grpc.SERVICE
    assert method in service.methods_by_name


def infer_request(arrays: dict[str, np.ndarray], raw: bool, outputs=()):
    request = oip_grpc.pb.ModelInferRequest(model_name="m", id="r")
    for name, array in arrays.items():
        datatype = oip.datatype_of(array)
        tensor = request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        if raw:
            request.raw_input_contents.append(oip.to_raw(array, datatype))
        else:
            contents = getattr(tensor.contents, oip_grpc.CONTENTS_FIELDS[datatype])
            contents.extend(array.reshape(-1).tolist())
    for name in outputs:
        request.outputs.add(name=name)
    return request


@pytest.mark.parametrize("datatype", list(oip.DTYPES))
def test_raw_inputs_reach_http_unchanged(datatype: str) -> None:
    rng = np.random.default_rng()
    arrays = {"a": random_tensor(datatype, (2, 3), rng), "b": random_tensor(datatype, (1,), rng)}
    body, headers = oip_grpc.http_infer_request(infer_request(arrays, raw=True, outputs=["y"]))
    decoded = oip.decode_request(body, headers)
    for name, array in arrays.items():
        assert_same(decoded.inputs[name], array)
    assert decoded.id == "r" and decoded.outputs == ["y"] and decoded.wants_binary("y")


@pytest.mark.parametrize("datatype", TYPED)
def test_typed_contents_reach_http_as_binary(datatype: str) -> None:
    array = random_tensor(datatype, (3, 2), np.random.default_rng())
    body, headers = oip_grpc.http_infer_request(infer_request({"a": array}, raw=False))
    decoded = oip.decode_request(body, headers)
    assert_same(decoded.inputs["a"], array)
    assert decoded.outputs is None and decoded.wants_binary("anything")


def test_requests_the_codec_refuses() -> None:
    fp16 = infer_request({"a": np.zeros(2, np.float16)}, raw=True)
    del fp16.raw_input_contents[:]
    with pytest.raises(oip.OipError, match="raw only"):
        oip_grpc.http_infer_request(fp16)
    two = infer_request({"a": np.zeros(2, np.int32), "b": np.zeros(2, np.int32)}, raw=True)
    del two.raw_input_contents[1]
    with pytest.raises(oip.OipError, match="all or none") as err:
        oip_grpc.http_infer_request(two)
    assert err.value.status == 400
    wide = infer_request({"a": np.zeros(1, np.int8)}, raw=False)
    wide.inputs[0].contents.int_contents[0] = 1000  # no INT8
    with pytest.raises(oip.OipError, match="out of range"):
        oip_grpc.http_infer_request(wide)


@pytest.mark.parametrize("datatype", list(oip.DTYPES))
def test_http_answers_become_raw_outputs(datatype: str) -> None:
    rng = np.random.default_rng()
    outputs = {"x": random_tensor(datatype, (2, 2), rng), "y": random_tensor(datatype, (3,), rng)}
    body, headers = oip.encode_response("m", outputs, "id", binary={"x"})
    response = oip_grpc.infer_response(oip.decode_response(body, headers))
    assert (response.model_name, response.model_version, response.id) == ("m", "1", "id")
    for i, (name, array) in enumerate(outputs.items()):
        tensor = response.outputs[i]
        assert (tensor.name, tensor.datatype, list(tensor.shape)) == (
            name,
            datatype,
            list(array.shape),
        )
        assert response.raw_output_contents[i] == oip.to_raw(array, datatype)


def test_listener_specs() -> None:
    assert oip_grpc.parse_port("off", "127.0.0.1") is None
    assert oip_grpc.parse_port("8001", "0.0.0.0") == "0.0.0.0:8001"
    assert oip_grpc.parse_port("10.0.0.5:9001", "127.0.0.1") == "10.0.0.5:9001"
    assert oip_grpc.parse_port("[::1]:9001", "127.0.0.1") == "[::1]:9001"
    for bad in ("", "http", "70000", "host:"):
        with pytest.raises(ValueError, match="--grpc-port"):
            oip_grpc.parse_port(bad, "127.0.0.1")
    assert oip_grpc.loopback_url("0.0.0.0", 80) == "http://127.0.0.1:80"
    assert oip_grpc.loopback_url("::", 80) == "http://[::1]:80"


def test_a_taken_port_fails_only_when_asked_for(caplog) -> None:
    """A port given with --grpc-port that is taken stops the start; the default one is
    given up with one warning, and HTTP serves on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        bind = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(oip_grpc.ListenError, match=bind):
            asyncio.run(oip_grpc.start_front(bind, "http://127.0.0.1:9", required=True))
        with caplog.at_level(logging.WARNING, logger="omni.api.oip_grpc"):
            front = asyncio.run(oip_grpc.start_front(bind, "http://127.0.0.1:9", required=False))
    assert front is None
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "serving without gRPC" in caplog.records[0].getMessage()


def test_serve_refuses_a_bad_grpc_port() -> None:
    result = CliRunner().invoke(cli.main, ["serve", "--grpc-port", "http"])
    assert result.exit_code == 2 and "--grpc-port" in result.output
