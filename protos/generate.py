"""Regenerate the committed Python gRPC package from the .proto files in this folder.

    python protos/generate.py            # rewrite the generated modules
    python protos/generate.py --check    # exit 1 if the committed modules differ from what protoc produces

The protos are compiled from a scratch tree that mirrors the installed package (`expertmesh/protos/*.proto`), so
the generated modules import each other as `expertmesh.protos.x_pb2`: the path every Ray worker can import.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = ["inference.proto", "kserve_v2.proto", "admin.proto", "expert_transport.proto"]
# kserve_v2.proto keeps its messages out of the `inference` package (see the comment there); its service is
# served under the standard KServe v2 path so clients find it.
SERVICE_PATHS = {
    "kserve_v2_pb2_grpc.py": ("expertmesh.kserve.v2.GRPCInferenceService", "inference.GRPCInferenceService"),
}


def generated_files(out_dir: Path) -> dict[str, str]:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        pkg = root / "expertmesh" / "protos"
        pkg.mkdir(parents=True)
        for name in PROTOS:
            shutil.copy(HERE / name, pkg / name)
        args = ["protoc", f"-I{root}", f"--python_out={root}", f"--pyi_out={root}", f"--grpc_python_out={root}"]
        args += [f"expertmesh/protos/{name}" for name in PROTOS]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        files = {p.name: p.read_text() for p in sorted(pkg.iterdir()) if p.suffix in (".py", ".pyi")}
    for name, (generated, served) in SERVICE_PATHS.items():
        files[name] = files[name].replace(f"'{generated}'", f"'{served}'").replace(f"/{generated}/", f"/{served}/")
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    files = generated_files(HERE)
    if args.check:
        stale = [name for name, text in files.items()
                 if not (HERE / name).is_file() or (HERE / name).read_text() != text]
        if stale:
            print(f"generated code is stale: {stale}; run python protos/generate.py", file=sys.stderr)
            return 1
        return 0
    for name, text in files.items():
        (HERE / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
