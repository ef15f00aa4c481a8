"""One front over several meshes (router_service/grpc_front.py, http_front.py given {model name: handle}), against
fake router handles, no Ray: each request reaches the mesh its model names, /v1/models lists every model, an unknown
model is a 404 model_not_found (gRPC NOT_FOUND) naming the field, no model with several meshes is a 400
(INVALID_ARGUMENT), server-wide calls answer for every mesh, and a mesh that fails leaves the other's answers alone."""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expertmesh.protos import (
    admin_pb2,
    admin_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    kserve_v2_pb2,
    kserve_v2_pb2_grpc,
)
from expertmesh.router_service.config import ServerConfig
from expertmesh.router_service.grpc_front import MODEL_METADATA, start_front
from expertmesh.router_service.http_front import start_http_front

DONE = {"done": {"finish_reason": "length", "prompt_tokens": 2, "completion_tokens": 1,
                 "tokens_per_expert": {}, "rerouted": 0, "degraded": 0, "dropped": 0}}


class _Awaitable:
    def __init__(self, value):
        self.value = value

    def __await__(self):
        async def get():
            if isinstance(self.value, BaseException):
                raise self.value
            return self.value
        return get().__await__()

    def cancel(self) -> None:
        pass


class _Stream:
    def __init__(self, items: list):
        self.items = items

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for item in self.items:
            await asyncio.sleep(0)
            yield item

    def cancel(self) -> None:
        pass


class _Method:
    def __init__(self, mesh: MeshHandle, name: str):
        self.mesh, self.name = mesh, name

    def remote(self, *args, **_):
        self.mesh.calls.append(self.name)
        if self.mesh.broken:
            return _Awaitable(RuntimeError(f"{self.mesh.model} is down"))
        return self.mesh.answer(self.name, args)


class MeshHandle:
    """One mesh's router deployment: every call is recorded; its answers carry its token id, so a mix-up shows."""

    def __init__(self, model: str, token_id: int, serving: bool = True):
        self.model, self.token_id, self.serving = model, token_id, serving
        self.calls: list[str] = []
        self.broken = False

    def options(self, **_):
        return self

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)

    def answer(self, name: str, args):
        if name == "OpenAIGenerate":
            return _Stream([{"token": {"ids": [self.token_id], "text": self.model, "logprobs": None}}, DONE])
        if name == "Generate":
            return _Stream([inference_pb2.GenerateResponse(token=inference_pb2.TokenChunk(token_ids=[self.token_id]))])
        if name == "GetClusterState":
            return _Awaitable(admin_pb2.ClusterState(model=self.model))
        if name == "GetRouterStats":
            return _Awaitable(admin_pb2.RouterStats(replica=f"r-{self.model}", steps=self.token_id))
        if name == "ServerMetadata":
            return _Awaitable(kserve_v2_pb2.ServerMetadataResponse(name="expertmesh"))
        if name == "ServerReady":
            return _Awaitable(kserve_v2_pb2.ServerReadyResponse(ready=self.serving))
        if name == "ModelReady":
            return _Awaitable(kserve_v2_pb2.ModelReadyResponse(ready=True))
        if name == "Check":
            status = health_pb2.HealthCheckResponse.SERVING if self.serving else \
                health_pb2.HealthCheckResponse.NOT_SERVING
            return _Awaitable(health_pb2.HealthCheckResponse(status=status))
        if name == "OpenAITokenize":
            return _Awaitable([self.token_id])
        if name == "context_length":
            return _Awaitable(64)
        raise AssertionError(f"unexpected call {name}")


@pytest.fixture
def meshes() -> dict[str, MeshHandle]:
    return {"alpha-model": MeshHandle("alpha-model", 11), "beta-model": MeshHandle("beta-model", 22)}


def run_http(handles, check):
    async def main():
        runner, port = await start_http_front(handles, ServerConfig(http_port=0))
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as client:
                await check(client)
        finally:
            await runner.cleanup()

    asyncio.run(main())


def run_grpc(handles, check, by_target: bool = False):
    """`check(channel)` against a front over `handles`; by_target: `check("127.0.0.1:port")` instead."""
    async def main():
        server, port = await start_front(handles, ServerConfig(port=0))
        try:
            if by_target:
                await check(f"127.0.0.1:{port}")
                return
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await check(channel)
        finally:
            await server.stop(None)

    asyncio.run(main())


def completion(model: str | None) -> dict:
    body = {"prompt": "hi", "max_tokens": 1}
    return body if model is None else body | {"model": model}


def test_http_routes_each_request_to_the_mesh_its_model_names(meshes):
    async def check(client):
        listed = await (await client.get("/v1/models")).json()
        assert [m["id"] for m in listed["data"]] == ["alpha-model", "beta-model"]
        for model, mesh in meshes.items():
            reply = await client.post("/v1/completions", json=completion(model))
            body = await reply.json()
            assert reply.status == 200 and body["model"] == model and body["choices"][0]["text"] == model
            chat = await client.post("/v1/chat/completions",
                                     json={"model": model, "messages": [{"role": "user", "content": "x"}]})
            assert chat.status == 200 and (await chat.json())["model"] == model
            assert (await client.get(f"/v1/models/{model}")).status == 200
            tokens = await (await client.post("/tokenize", json={"model": model, "prompt": "x"})).json()
            assert tokens["tokens"] == [mesh.token_id]
            state = await (await client.get("/api/state", params={"model": model})).json()
            assert state["model"] == model
        assert meshes["alpha-model"].calls.count("OpenAIGenerate") == 2
        assert meshes["beta-model"].calls.count("OpenAIGenerate") == 2

    run_http(meshes, check)


def test_http_unknown_or_missing_model_is_refused_naming_model(meshes):
    async def check(client):
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            reply = await client.post(path, json={"model": "gpt-4", "prompt": "x",
                                                  "messages": [{"role": "user", "content": "x"}]})
            error = (await reply.json())["error"]
            assert reply.status == 404 and error["code"] == "model_not_found" and error["param"] == "model", path
            assert "'gpt-4'" in error["message"] and "'alpha-model', 'beta-model'" in error["message"]
        reply = await client.post("/v1/completions", json=completion(None))
        error = (await reply.json())["error"]
        assert reply.status == 400 and error["param"] == "model" and "several models" in error["message"]
        reply = await client.post("/v1/completions", json=completion(None) | {"model": 5})
        assert reply.status == 400 and "must be a model name" in (await reply.json())["error"]["message"]
        reply = await client.post("/tokenize", json={"prompt": "x"})  # optional with one mesh, not with two
        assert reply.status == 400 and (await reply.json())["error"]["param"] == "model"
        assert (await client.get("/v1/models/gpt-4")).status == 404
        assert (await client.get("/api/state", params={"model": "gpt-4"})).status == 404
        assert not any("OpenAIGenerate" in m.calls for m in meshes.values())

    run_http(meshes, check)


def test_http_a_failing_mesh_leaves_the_other_alone_and_fails_health(meshes):
    meshes["alpha-model"].broken = True

    async def check(client):
        assert (await client.post("/v1/completions", json=completion("alpha-model"))).status == 503
        reply = await client.post("/v1/completions", json=completion("beta-model"))
        assert reply.status == 200 and (await reply.json())["choices"][0]["text"] == "beta-model"
        health = await client.get("/health")
        assert health.status == 503 and "'alpha-model'" in (await health.json())["error"]["message"]

    run_http(meshes, check)


def test_http_metrics_cover_every_mesh_labelled_by_model(meshes):
    meshes["beta-model"].broken = True

    async def check(client):
        text = await (await client.get("/metrics")).text()
        assert 'expertmesh_router_up{model="alpha-model"} 1' in text
        assert 'expertmesh_router_up{model="beta-model"} 0' in text
        assert 'expertmesh_router_steps_total{model="alpha-model",replica="r-alpha-model"} 11' in text
        assert text.count("# TYPE expertmesh_router_steps_total") == 1  # one family, a sample per mesh
        one = await (await client.get("/metrics", params={"model": "alpha-model"})).text()
        assert "beta-model" not in one and 'steps_total{model="alpha-model",replica="r-alpha-model"} 11' in one
        assert (await client.get("/metrics", params={"model": "gpt-4"})).status == 404

    run_http(meshes, check)


def test_http_one_mesh_keeps_its_single_mesh_behaviour():
    mesh = MeshHandle("only", 5)

    async def check(client):
        assert (await (await client.post("/tokenize", json={"prompt": "x"})).json())["tokens"] == [5]
        reply = await client.post("/v1/completions", json=completion("other"))
        assert reply.status == 404 and "this server serves 'only'" in (await reply.json())["error"]["message"]
        text = await (await client.get("/metrics")).text()
        assert "expertmesh_router_up 1" in text and 'steps_total{replica="r-only"} 5' in text  # no model label

    run_http({"only": mesh}, check)


def test_grpc_routes_by_each_requests_model_field(meshes):
    async def check(channel):
        stub = inference_pb2_grpc.InferenceStub(channel)
        for model, mesh in meshes.items():
            request = inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=[1]), max_tokens=1,
                                                    model=model)
            replies = [r async for r in stub.Generate(request, timeout=10)]
            assert [list(r.token.token_ids) for r in replies] == [[mesh.token_id]]
        kserve = kserve_v2_pb2_grpc.GRPCInferenceServiceStub(channel)
        assert (await kserve.ModelReady(kserve_v2_pb2.ModelReadyRequest(name="beta-model"), timeout=10)).ready
        assert meshes["beta-model"].calls == ["Generate", "ModelReady"]
        admin = admin_pb2_grpc.AdminStub(channel)
        state = await admin.GetClusterState(admin_pb2.ClusterStateRequest(), timeout=10,
                                            metadata=((MODEL_METADATA, "beta-model"),))
        assert state.model == "beta-model"

    run_grpc(meshes, check)


def test_grpc_unknown_or_missing_model_names_the_field(meshes):
    async def check(channel):
        stub = inference_pb2_grpc.InferenceStub(channel)
        cases = [
            (stub.Generate(inference_pb2.GenerateRequest(max_tokens=1, model="gpt-4"), timeout=10),
             grpc.StatusCode.NOT_FOUND, "model: unknown model 'gpt-4'"),
            (stub.Generate(inference_pb2.GenerateRequest(max_tokens=1), timeout=10),
             grpc.StatusCode.INVALID_ARGUMENT, "model: required"),
        ]
        for call, code, message in cases:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [r async for r in call]
            assert err.value.code() == code and err.value.details().startswith(message)
        kserve = kserve_v2_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await kserve.ModelInfer(kserve_v2_pb2.ModelInferRequest(model_name="nope"), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and err.value.details().startswith("model_name:")
        admin = admin_pb2_grpc.AdminStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await admin.GetClusterState(admin_pb2.ClusterStateRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and MODEL_METADATA in err.value.details()
        assert not any(m.calls for m in meshes.values())

    run_grpc(meshes, check)


def test_grpc_server_wide_calls_answer_for_every_mesh(meshes):
    async def check(channel):
        kserve = kserve_v2_pb2_grpc.GRPCInferenceServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert (await kserve.ServerReady(kserve_v2_pb2.ServerReadyRequest(), timeout=10)).ready
        meta = await kserve.ServerMetadata(kserve_v2_pb2.ServerMetadataRequest(), timeout=10)  # no model needed
        assert meta.name == "expertmesh" and meshes["alpha-model"].calls[-1] == "ServerMetadata"
        assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == serving
        meshes["beta-model"].serving = False
        assert not (await kserve.ServerReady(kserve_v2_pb2.ServerReadyRequest(), timeout=10)).ready
        assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status != serving
        # alpha still answers its own model's requests
        request = inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=[1]), max_tokens=1,
                                                model="alpha-model")
        stub = inference_pb2_grpc.InferenceStub(channel)
        assert [list(r.token.token_ids) async for r in stub.Generate(request, timeout=10)] == [[11]]

    run_grpc(meshes, check)


@pytest.mark.parametrize(("flags", "field", "message"), [
    (["--mesh-id", "a", "--mesh-id", "b", "--model-name", "x"], "model.name", "several meshes"),
    (["--mesh-id", "a", "--all-meshes"], "mesh.id", "not both"),
    (["--mesh-id", "Bad", "--mesh-id", "b"], "mesh.id", "'Bad'"),
])
def test_front_command_refuses_bad_mesh_sets_before_joining_ray(flags, field, message):
    import argparse

    from expertmesh.ops.commands import front
    from expertmesh.ops.commands.mesh_flags import mesh_config_from_args
    from expertmesh.router_service.config import ConfigError
    from expertmesh.router_service.front_only import front_forever

    parser = argparse.ArgumentParser()
    front.add_parser(parser.add_subparsers())
    args = parser.parse_args(["front", "--address", "127.0.0.1:1", "--port", "0", *flags])
    with pytest.raises(ConfigError) as err:  # an address nothing listens on: the refusal comes before joining
        asyncio.run(front_forever(mesh_config_from_args(args), mesh_ids=args.front_mesh_ids or (),
                                  all_meshes=args.all_meshes))
    assert err.value.field == field and message in str(err.value)


def test_front_command_takes_repeated_mesh_ids():
    import argparse

    from expertmesh.ops.commands import front

    parser = argparse.ArgumentParser()
    front.add_parser(parser.add_subparsers())
    args = parser.parse_args(["front", "--mesh-id", "alpha", "--mesh-id", "beta"])
    assert args.front_mesh_ids == ["alpha", "beta"] and not args.all_meshes
    assert parser.parse_args(["front"]).front_mesh_ids is None


def test_cli_clients_name_the_model_on_a_front_over_several_meshes(meshes, capsys):
    """`expertmesh generate/score/status --target FRONT --model-name M` reach M's mesh; without it they get the
    front's INVALID_ARGUMENT naming the field (exit 1, no traceback)."""
    import json

    from expertmesh.ops.cli import main

    async def check(target):
        def cli(*argv: str) -> int:
            return main([*argv, "--target", target, "--timeout", "10"])

        assert await asyncio.to_thread(cli, "generate", "--token-ids", "1,2", "--max-tokens", "1", "--json",
                                       "--model-name", "beta-model") == 0
        assert json.loads(capsys.readouterr().out)["token_ids"] == [22]
        assert await asyncio.to_thread(cli, "status", "--json", "--model-name", "alpha-model") == 0
        assert json.loads(capsys.readouterr().out)["model"] == "alpha-model"
        assert await asyncio.to_thread(cli, "generate", "--token-ids", "1,2", "--max-tokens", "1") != 0
        assert "model: required" in capsys.readouterr().err

    run_grpc(meshes, check, by_target=True)
