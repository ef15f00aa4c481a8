"""A small gRPC client for expertmesh's Inference service (what `expertmesh generate --target` uses)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc

from ..protos import inference_pb2 as pb
from ..protos import inference_pb2_grpc


def channel(target: str, tls_ca: str | None = None, max_message_bytes: int = 64 * 1024 * 1024) -> grpc.Channel:
    options = [("grpc.max_receive_message_length", max_message_bytes)]
    if tls_ca is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
        return grpc.secure_channel(target, creds, options=options)
    return grpc.insecure_channel(target, options=options)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def generate_stream(
    chan: grpc.Channel, request: pb.GenerateRequest, token: str | None = None, timeout: float | None = None
) -> Iterator[pb.GenerateResponse]:
    stub = inference_pb2_grpc.InferenceStub(chan)
    return stub.Generate(request, metadata=auth_metadata(token), timeout=timeout)


def score(chan: grpc.Channel, request: pb.ScoreRequest, token: str | None = None,
          timeout: float | None = None) -> pb.ScoreResponse:
    return inference_pb2_grpc.InferenceStub(chan).Score(request, metadata=auth_metadata(token), timeout=timeout)
