"""The committed generated gRPC code is exactly what protos/generate.py produces, and imports by package path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PROTOS = Path(__file__).resolve().parents[2] / "protos"


def test_committed_generated_code_is_current():
    proc = subprocess.run([sys.executable, str(PROTOS / "generate.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_generated_modules_import_by_package_path():
    from expertmesh.protos import inference_pb2, inference_pb2_grpc, kserve_v2_pb2, kserve_v2_pb2_grpc

    assert inference_pb2.DESCRIPTOR.package == "expertmesh.v1"
    assert kserve_v2_pb2.DESCRIPTOR.package == "expertmesh.kserve.v2"
    assert hasattr(inference_pb2_grpc, "add_InferenceServicer_to_server")
    assert hasattr(kserve_v2_pb2_grpc, "add_GRPCInferenceServiceServicer_to_server")
    # Served under the standard path that tritonclient calls.
    source = Path(kserve_v2_pb2_grpc.__file__).read_text()
    assert "'/inference.GRPCInferenceService/ModelInfer'" in source
    assert "expertmesh.kserve.v2.GRPCInference" not in source


def test_kserve_messages_are_wire_compatible_with_tritonclient():
    """Bytes written by tritonclient's own ModelInferRequest parse into ours field for field (and back), with both
    imported in one process (no descriptor-pool clash)."""
    from tritonclient.grpc import service_pb2 as triton

    from expertmesh.protos import kserve_v2_pb2 as ours

    req = triton.ModelInferRequest(model_name="m", id="7")
    tensor = req.inputs.add(name="input_ids", datatype="INT64", shape=[1, 3])
    tensor.parameters["x"].int64_param = 5
    req.raw_input_contents.append(b"\x01" * 24)
    mine = ours.ModelInferRequest.FromString(req.SerializeToString())
    assert mine.model_name == "m" and mine.id == "7"
    assert mine.inputs[0].name == "input_ids" and list(mine.inputs[0].shape) == [1, 3]
    assert mine.inputs[0].parameters["x"].int64_param == 5 and mine.raw_input_contents[0] == b"\x01" * 24
    resp = ours.ModelInferResponse(model_name="m")
    resp.outputs.add(name="logits", datatype="FP32", shape=[1, 3, 4])
    resp.raw_output_contents.append(b"\x00" * 48)
    back = triton.ModelInferResponse.FromString(resp.SerializeToString())
    assert back.outputs[0].name == "logits" and list(back.outputs[0].shape) == [1, 3, 4]
