"""A thin client library over the PredictionService stubs: numpy in, numpy out, a deadline per
call, and gRPC failures raised as PredictError with the status code and the server's message."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from protos.tensorflow_serving import get_model_metadata_pb2, predict_pb2, prediction_service_pb2_grpc
from server.api import tensor_codec as codec

DEFAULT_TIMEOUT_S = 10.0
_UNLIMITED = 1 << 62  # the client trusts the server's outputs' sizes; the channel caps bytes


class PredictError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


@dataclass(frozen=True)
class Tls:
    """TLS for the channel: the CA that signed the server's certificate (None: system roots), and a
    client certificate and key for mutual TLS."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_file), private_key=read(self.key_file),
            certificate_chain=read(self.cert_file),
        )


def channel_options(max_message_bytes: int = 64 * 1024 * 1024) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def build_predict_request(
    model: str,
    inputs: Mapping[str, np.ndarray],
    *,
    signature: str = "",
    version: int | None = None,
    output_filter: Iterable[str] = (),
) -> Any:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    request.model_spec.signature_name = signature
    if version is not None:
        request.model_spec.version.value = version
    for name, array in inputs.items():
        codec.fill_tensor_proto(request.inputs[name], np.asarray(array))
    request.output_filter.extend(output_filter)
    return request


def decode_outputs(response: Any) -> dict[str, np.ndarray]:
    return {
        name: codec.to_ndarray(tensor, name=name, max_bytes=_UNLIMITED)
        for name, tensor in response.outputs.items()
    }


def build_metadata_request(model: str, version: int | None = None) -> Any:
    request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    request.model_spec.name = model
    if version is not None:
        request.model_spec.version.value = version
    return request


def decode_signature_defs(response: Any) -> dict[str, Any]:
    signature_map = get_model_metadata_pb2.SignatureDefMap()
    response.metadata["signature_def"].Unpack(signature_map)
    return dict(signature_map.signature_def)


class PredictClient:
    """Blocking client. Use as a context manager, or call close()."""

    def __init__(self, target: str, *, options: list[tuple[str, int]] | None = None, tls: Tls | None = None) -> None:
        options = options or channel_options()
        self._channel = (grpc.insecure_channel(target, options=options) if tls is None
                         else grpc.secure_channel(target, tls.credentials(), options=options))
        self.stub = prediction_service_pb2_grpc.PredictionServiceStub(self._channel)

    def predict(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        signature: str = "",
        version: int | None = None,
        output_filter: Iterable[str] = (),
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> dict[str, np.ndarray]:
        request = build_predict_request(
            model, inputs, signature=signature, version=version, output_filter=output_filter
        )
        try:
            response = self.stub.Predict(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise PredictError(exc.code(), exc.details() or "") from None
        return decode_outputs(response)

    def signature_defs(self, model: str, *, version: int | None = None,
                       timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
        """The model's SignatureDefs (tensorflow.SignatureDef protos) by signature name."""
        try:
            response = self.stub.GetModelMetadata(build_metadata_request(model, version), timeout=timeout)
        except grpc.RpcError as exc:
            raise PredictError(exc.code(), exc.details() or "") from None
        return decode_signature_defs(response)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> PredictClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncPredictClient:
    """grpc.aio client, for many concurrent calls from one thread."""

    def __init__(self, target: str, *, options: list[tuple[str, int]] | None = None, tls: Tls | None = None) -> None:
        options = options or channel_options()
        self._channel = (grpc.aio.insecure_channel(target, options=options) if tls is None
                         else grpc.aio.secure_channel(target, tls.credentials(), options=options))
        self.stub = prediction_service_pb2_grpc.PredictionServiceStub(self._channel)

    async def predict(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        signature: str = "",
        version: int | None = None,
        output_filter: Iterable[str] = (),
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> dict[str, np.ndarray]:
        request = build_predict_request(
            model, inputs, signature=signature, version=version, output_filter=output_filter
        )
        try:
            response = await self.stub.Predict(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise PredictError(exc.code(), exc.details() or "") from None
        return decode_outputs(response)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncPredictClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
