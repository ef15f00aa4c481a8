"""INVALID_ARGUMENT, not UNKNOWN, for request bytes that do not parse as the method's request message.

grpc.aio parses a request with the handler's request_deserializer before the handler runs; when that raises
(protobuf's DecodeError), grpcio answers UNKNOWN with its own text ("Unexpected <class 'DecodeError'>: ...") and logs
a traceback. This interceptor hands every handler the raw bytes instead and parses them inside the call, where a
failure can be answered properly: INVALID_ARGUMENT naming the expected message type, and no traceback.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import grpc


def _message_name(parse: Callable[[bytes], Any]) -> str:
    descriptor = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)  # Message.FromString is bound
    return descriptor.full_name if descriptor is not None else "request"


async def _parse(parse: Callable[[bytes], Any], raw: bytes, context: grpc.aio.ServicerContext) -> Any:
    try:
        return parse(raw)
    except Exception:  # protobuf's DecodeError, or whatever a message type's parser raises on bad bytes
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request: {len(raw)} bytes that are not a valid {_message_name(parse)} message")


class RefuseMalformedRequests(grpc.aio.ServerInterceptor):
    """Wraps every async unary-request handler (all of the front's: coroutines, and streaming ones that yield or
    write their messages); others are left as they are."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        if handler.response_streaming:
            behaviour = handler.unary_stream
            if inspect.isasyncgenfunction(behaviour):  # yields its messages (Health.Watch)
                async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext):
                    request = await _parse(parse, raw, context)
                    async for message in behaviour(request, context):
                        yield message
            elif inspect.iscoroutinefunction(behaviour):  # writes its messages itself (the front's Generate)
                async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext):
                    await behaviour(await _parse(parse, raw, context), context)
            else:
                return handler
            return handler._replace(request_deserializer=None, unary_stream=unary_stream)
        behaviour = handler.unary_unary
        if not inspect.iscoroutinefunction(behaviour):
            return handler

        async def unary_unary(raw: bytes, context: grpc.aio.ServicerContext):
            return await behaviour(await _parse(parse, raw, context), context)

        return handler._replace(request_deserializer=None, unary_unary=unary_unary)
