"""Start `expertmesh serve` as a user would (a subprocess with its own embedded Ray) and stop it cleanly."""

from __future__ import annotations

import datetime
import ipaddress
import re
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

READY = re.compile(r"expertmesh serving (\S+) on ([\d.]+):(\d+) \((tls|plaintext)\)")


@dataclass
class Served:
    proc: subprocess.Popen
    port: int
    model_name: str
    log_path: Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, timeout: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(*args: str, timeout: float = 300) -> Served:
    log = Path(tempfile.mkstemp(prefix="expertmesh-serve-", suffix=".log")[1])
    proc = subprocess.Popen([sys.executable, "-m", "expertmesh.ops.cli", "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    found: list[re.Match] = []

    def watch() -> None:
        for line in proc.stdout:
            match = READY.search(line)
            if match:
                found.append(match)
                return

    reader = threading.Thread(target=watch, daemon=True)
    reader.start()
    reader.join(timeout)
    if not found:
        proc.kill()
        raise RuntimeError(f"expertmesh serve did not become ready in {timeout}s:\n{log.read_text()[-4000:]}")
    match = found[0]
    return Served(proc=proc, port=int(match.group(3)), model_name=match.group(1), log_path=log)


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
