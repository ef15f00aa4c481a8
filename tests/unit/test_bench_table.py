"""`expertmesh bench X` is dispatched from one table (ops/commands/bench.py BENCHMARKS): every row names a module of
ops/bench/ with that entry function and parameters dataclass, and every subcommand's flags build its parameters.
The quick in-process benchmarks also run end to end through the CLI at a tiny size (timing is not checked)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json

from expertmesh.ops.cli import build_parser, main
from expertmesh.ops.commands.bench import BENCHMARKS


def test_every_row_names_a_module_entry_and_parameters_that_the_flags_build():
    parser = build_parser()
    bench_parser = _subcommands(parser)["bench"]
    # every subcommand has a row, every row a subcommand
    assert {name.split()[0] for name in BENCHMARKS} == set(_subcommands(bench_parser))
    for name, bench in BENCHMARKS.items():
        module = importlib.import_module(f"expertmesh.ops.bench.{bench.module}")
        assert callable(getattr(module, bench.entry)), name
        argv = ["bench", "dispatch", "--context", "64"] if name == "dispatch --context" else ["bench", *name.split()]
        params = getattr(module, bench.params).from_args(parser.parse_args(argv))
        assert dataclasses.is_dataclass(params), name
        # The flags' defaults are the parameters' defaults: the CLI and a test's params object run the same thing.
        default = getattr(module, bench.params)()
        differs = {f.name for f in dataclasses.fields(params) if getattr(params, f.name) != getattr(default, f.name)}
        assert differs <= {"context"}, (name, differs)


def test_quick_benchmarks_run_through_the_cli(tmp_path, capsys):
    runs = {
        "dispatch-overhead": ["--tokens", "8", "--hidden", "16", "--repeats", "2"],
        "observability": ["--sequences", "4"],
        "grouped-ffn": ["--hidden", "16", "--inter", "8", "--repeats", "1"],
    }
    for name, flags in runs.items():
        out = tmp_path / f"{name}.json"
        assert main(["bench", name, *flags, "--json", "--out", str(out)]) == 0
        printed = json.loads(capsys.readouterr().out)
        assert printed == json.loads(out.read_text()), name
    assert json.loads((tmp_path / "dispatch-overhead.json").read_text())["machine"]["torch_threads"] == 1
    cases = json.loads((tmp_path / "grouped-ffn.json").read_text())["cases"]
    assert cases and all(c["grouped_mm_bit_identical"] for c in cases)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_chunked_bench_runs_on_a_params_object_with_a_small_model():
    """A benchmark runs smaller by its parameters alone (here the model dict), no module globals patched."""
    from expertmesh.ops.bench.checkpoints import MIXTRAL
    from expertmesh.ops.bench.chunked import ChunkedParams, run_chunked_bench

    small = dict(MIXTRAL, hidden=64, inter=128, heads=4, kv_heads=2, vocab=256, layers=2)
    result = run_chunked_bench(ChunkedParams(prompt_tokens=64, streams=2, chunks=(16,), model=small), verbose=False)
    assert result["model"] == small
    assert set(result["scenarios"]) == {"baseline", "unchunked", "chunked_16"}
    assert result["scenarios"]["baseline"]["p99_vs_baseline"] == 1.0
