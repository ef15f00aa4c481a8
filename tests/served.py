"""Start `expertmesh serve` as a user would (a subprocess with its own embedded Ray), and TLS material for tests."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from expertmesh.cluster.naming import NAMESPACE
from expertmesh.ops.server_process import ServerProcess
from expertmesh.ops.server_process import start_server as _start
from expertmesh.protos import inference_pb2 as pb
from expertmesh.protos import inference_pb2_grpc
from tests.clusters import init_local_ray

# The test servers keep the one-actor-per-expert layout (expert-e{E}-r{R} hosts expert E) that their kills, replica
# counts and per-actor assertions name; on the 2-CPU test Rays the default (auto) would pick one actor per node.
# A test of the default layout passes --expert-layout itself.
PER_EXPERT = ("--expert-layout", "per-expert")
# What a user gets by default on a small CPU Ray (auto: one actor per node hosting every expert): a module that names
# no actor passes it, and its server starts one actor process instead of eight (CI time on 2 cores) and serves each
# step with one call a layer instead of up to eight.
ONE_ACTOR = ("--expert-layout", "auto")


def start_server(*args: str, timeout: float = 300) -> ServerProcess:
    layout = () if "--expert-layout" in args else PER_EXPERT
    return _start([*layout, *args], timeout=timeout)


@contextmanager
def server_on_own_ray(*args: str, num_cpus: int = 4) -> Iterator[ServerProcess]:
    """`expertmesh serve --address <a local Ray this process started>`: this driver is on the same cluster, so a
    test can kill the server's actors (experts, controller, router replicas) directly. Stops both on exit."""
    import ray

    init_local_ray(num_cpus=num_cpus, namespace=NAMESPACE, include_dashboard=False)
    try:
        server = start_server("--address", ray.get_runtime_context().gcs_address, *args)
        try:
            yield server
        finally:
            assert server.stop() == 0, server.log()
    finally:
        ray.shutdown()


def router_replicas() -> list[tuple[str, str]]:
    """(name, namespace) of the router deployment's Serve replicas on the connected cluster."""
    import ray

    return [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
            if "SERVE_REPLICA" in a["name"] and "router" in a["name"]]


def generate_ids(channel, prompt: list[int], max_tokens: int, timeout: float = 60) -> list[int]:
    """Greedy Generate over `channel`: the token ids it streamed."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_tokens=max_tokens)
    ids: list[int] = []
    for message in inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=timeout):
        if message.HasField("token"):
            ids.extend(message.token.token_ids)
    return ids


def self_signed_cert(folder: Path) -> tuple[Path, Path]:
    """A certificate for localhost / 127.0.0.1 and its key (PEM), for TLS tests."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path
