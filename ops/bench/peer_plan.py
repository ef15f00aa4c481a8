"""The pure parts of `expertmesh bench serve --peer`: workloads (prompt texts of measured token lengths), the order
of the alternating rounds, and the medians and ratios of the report. No servers, no network, no Ray.

Workloads (WORKLOADS):
  distinct  every request its own short prompt, none sharing a first block with another (or with any earlier
            round's: a prefix cache never hits), non-streamed completions: tokens/s is what matters.
  shared    one system prompt filling most of the context (about 400 of the embedded model's 512 positions), then a
            short suffix of the request's own, streamed: time to first token is what matters, and a server with a
            prefix cache computes only the suffix.
  long      (optional) as `shared` in length, but every prompt unseen: the same prefill without any cache hit, the
            control that says what the shared prompt saved.
"""

from __future__ import annotations

import random
import statistics
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

SERVERS = ("expertmesh", "peer")

# Words drawn for prompt text: code-like, since the embedded model was trained on Python source (its outputs stay
# ordinary code, not noise), and each word a few tokens at most so lengths can be trimmed finely.
WORDS = ("def", "return", "self", "value", "name", "data", "index", "if", "else", "for", "in", "range", "list",
         "dict", "key", "items", "result", "import", "from", "class", "None", "True", "False", "len", "str", "int",
         "args", "kwargs", "path", "file", "open", "read", "write", "line", "lines", "count", "total", "node", "tree",
         "left", "right", "parent", "child", "error", "raise", "try", "except", "while", "break", "yield", "with",
         "as", "lambda", "map", "filter", "sorted", "min", "max", "sum", "print", "format", "split", "join")


@dataclass(frozen=True)
class Workload:
    """name; streamed: requests are streamed (time to first token measured) or not (tokens/s only); shared_tokens:
    tokens of the prompt every request shares (0: none); own_tokens: tokens of each request's own part."""

    name: str
    streamed: bool
    shared_tokens: int
    own_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return self.shared_tokens + self.own_tokens


def workloads(names: Sequence[str], *, prompt_tokens: int, system_tokens: int, suffix_tokens: int) -> list[Workload]:
    """The named workloads with these lengths (tokens of the model's tokenizer, before any BOS it adds)."""
    known = {
        "distinct": Workload("distinct", streamed=False, shared_tokens=0, own_tokens=prompt_tokens),
        "shared": Workload("shared", streamed=True, shared_tokens=system_tokens, own_tokens=suffix_tokens),
        "long": Workload("long", streamed=True, shared_tokens=0, own_tokens=system_tokens + suffix_tokens),
    }
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"workloads: {unknown or list(names)} not among {sorted(known)}")
    for field, value in (("prompt_tokens", prompt_tokens), ("system_tokens", system_tokens),
                         ("suffix_tokens", suffix_tokens)):
        if value < 1:
            raise ValueError(f"{field}: must be >= 1, got {value}")
    return [known[n] for n in dict.fromkeys(names)]


def text_of_tokens(encode: Callable[[str], list[int]], tokens: int, seed: int) -> str:
    """Words drawn with `seed` whose text encodes to exactly `tokens` tokens (no special tokens), or the longest such
    text below it when no word ends exactly there. Deterministic: the same seed gives the same text."""
    rng = random.Random(seed)
    words: list[str] = []
    text = ""
    while True:
        candidate = " ".join([*words, rng.choice(WORDS)])
        n = len(encode(candidate))
        if n > tokens:
            return text
        words = candidate.split(" ")
        text = candidate
        if n == tokens:
            return text


class PromptBook:
    """Prompt texts for one run: the shared system prompt, and each request's own part, the same text for both
    servers at the same (workload, round, concurrency, request) so they do the same work, and never repeated
    elsewhere in the run so a `distinct` or `long` prompt is never in a prefix cache from an earlier round."""

    def __init__(self, encode: Callable[[str], list[int]], seed: int = 0):
        self.encode = encode
        self.seed = seed
        self._system: dict[int, str] = {}

    def system(self, tokens: int) -> str:
        if tokens not in self._system:
            self._system[tokens] = text_of_tokens(self.encode, tokens, seed=(self.seed << 20) ^ 0xA11CE)
        return self._system[tokens]

    def prompt(self, workload: Workload, round_: int, concurrency: int, index: int) -> str:
        """index: the request's number within its level (stream * requests_per_stream + j)."""
        key = (self.seed, workload.name, round_, concurrency, index)
        own = text_of_tokens(self.encode, workload.own_tokens, seed=zlib.crc32(repr(key).encode()))  # stable per run
        if workload.shared_tokens:
            # A newline between the two keeps the system prompt's last token the same in every request: a BPE merge
            # across the join would change it and move the shared prefix's end.
            return self.system(workload.shared_tokens) + "\n" + own
        return own


@dataclass(frozen=True)
class Slot:
    """One measured level: round, workload name, concurrency and which server."""

    round: int
    workload: str
    concurrency: int
    server: str


def schedule(rounds: int, workload_names: Sequence[str], concurrencies: Sequence[int],
             servers: Sequence[str] = SERVERS) -> Iterator[Slot]:
    """Every (workload, concurrency) level of every round, each run on both servers back to back, the server that
    goes first swapping from one level to the next (and from round to round), so neither always runs right after
    the other's burst, and load that comes and goes on a shared machine falls on both alike."""
    if rounds < 1:
        raise ValueError(f"rounds: must be >= 1, got {rounds}")
    flip = 0
    for r in range(rounds):
        for workload in workload_names:
            for c in concurrencies:
                order = list(servers) if flip % 2 == 0 else list(servers)[::-1]
                flip += 1
                for server in order:
                    yield Slot(r, workload, c, server)
        if len(workload_names) * len(concurrencies) % 2 == 0:
            flip += 1  # an even count per round would otherwise give every level the same first server each round


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return None if ours is None or theirs is None or theirs == 0 else ours / theirs


def summarize(levels: Sequence[dict]) -> dict:
    """levels: one dict per measured slot: {"round", "workload", "concurrency", "server", "tokens_per_s",
    "ttft_p50_ms" (None when not streamed), "errors", optionally "cpu_s" and "other_server_cpu_s"}. Returns per
    workload and concurrency: each server's median (and range) of tokens/s and of TTFT p50 across rounds, and
    expertmesh ÷ peer of the medians, plus the median of the per-round ratios (each round's pair measured back to
    back, so this one cancels slower drift)."""
    out: dict = {}
    order = list(dict.fromkeys(lv["workload"] for lv in levels))  # workloads in the run's order
    keys = sorted({(lv["workload"], lv["concurrency"]) for lv in levels}, key=lambda k: (order.index(k[0]), k[1]))
    for workload, c in keys:
        mine = [lv for lv in levels if lv["workload"] == workload and lv["concurrency"] == c]
        entry: dict = {}
        for server in SERVERS:
            runs = sorted((lv for lv in mine if lv["server"] == server), key=lambda lv: lv["round"])
            tps = [lv["tokens_per_s"] for lv in runs]
            ttft = [lv.get("ttft_p50_ms") for lv in runs]
            entry[server] = {
                "tokens_per_s": _spread(tps),
                "ttft_p50_ms": _spread(ttft),
                # CPU seconds of this server's process tree during its level, and of the other (idle) server's
                "cpu_s": _spread([lv.get("cpu_s") for lv in runs]),
                "other_server_cpu_s": _spread([lv.get("other_server_cpu_s") for lv in runs]),
                "errors": sum(sum(lv.get("errors", {}).values()) for lv in runs),
            }
        by_round: dict[int, dict[str, dict]] = {}
        for lv in mine:
            by_round.setdefault(lv["round"], {})[lv["server"]] = lv
        pairs = [r for r in by_round.values() if all(s in r for s in SERVERS)]
        tps_pairs = [_ratio(p["expertmesh"]["tokens_per_s"], p["peer"]["tokens_per_s"]) for p in pairs]
        ttft_pairs = [_ratio(p["expertmesh"].get("ttft_p50_ms"), p["peer"].get("ttft_p50_ms")) for p in pairs]
        ours, theirs = entry["expertmesh"], entry["peer"]
        entry["ratio"] = {
            # > 1: expertmesh faster
            "tokens_per_s": _round(_ratio(ours["tokens_per_s"]["median"], theirs["tokens_per_s"]["median"])),
            "tokens_per_s_paired_median": _round(_median(tps_pairs)),
            # < 1: expertmesh's first token sooner
            "ttft": _round(_ratio(ours["ttft_p50_ms"]["median"], theirs["ttft_p50_ms"]["median"])),
            "ttft_paired_median": _round(_median(ttft_pairs)),
            "rounds_paired": len(pairs),
        }
        out.setdefault(workload, {})[str(c)] = entry
    return out


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def _spread(values: Sequence[float | None]) -> dict:
    present = [v for v in values if v is not None]
    return {"median": _round(_median(present)), "min": _round(min(present)) if present else None,
            "max": _round(max(present)) if present else None, "rounds": [_round(v) for v in values]}


def check_fits(workloads_: Sequence[Workload], max_tokens: int, context: int | None) -> None:
    """Refuse lengths the model cannot hold: prompt + max_tokens (+ 1 for a BOS) must fit its positions."""
    if context is None:
        return
    for w in workloads_:
        need = w.prompt_tokens + max_tokens + 1
        if need > context:
            field = "system_tokens + suffix_tokens" if w.streamed else "prompt_tokens"
            raise ValueError(f"{field} + max_tokens: the {w.name} workload needs {need} positions, the model has "
                             f"{context}")
