"""Expert transports: how a layer's calls reach the expert actors and their outputs come back.

  base      the `Transport` protocol the dispatcher codes against, and the transport names; no Ray
  refs      `RayRefTransport` (Ray actor calls, object refs) and `NameReviver` (finds restored replicas)
  grpc      `GrpcTransport`: one unary gRPC call per actor per layer
  compiled  `CompiledGraphTransport`: one Ray Compiled Graph execution per layer
  factory   `make_transport` / `close_transport`: pick one by name

This file imports nothing, so `from .transports.base import Transport` stays free of Ray and gRPC.
"""
