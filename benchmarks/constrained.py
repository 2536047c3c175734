"""The cost of constrained decoding (issue 20): the two libraries' per-token mask cost, and
constrained vs unconstrained tokens/s inside continuous batching, in one run.

**Masks** (``masks`` in the results): for each schema of :data:`SCHEMAS`, on the generated test
model's tokenizer, llguidance (what the agent uses, :mod:`node_agent.serving.constrain`, with
its grammar from :mod:`node_agent.serving.grammar`) and outlines-core (its JSON-schema regex and
token index) each

* compile the schema (``compile_ms``: llguidance's grammar + matcher; outlines-core's regex +
  ``Index`` over the vocabulary — built per schema, so it grows with the vocabulary),
* walk the tokens of a valid instance, computing the allowed-token bitmask before every token
  and advancing by it (``mask_us_per_token``: the median over ``--mask-rounds`` walks),
* and are asked whether they accept an instance that breaks only a bound or pattern of the
  schema (``enforces``: False when the library lets it through — a keyword it does not
  enforce; llguidance refuses what it cannot enforce at compile time instead).

**Throughput** (``throughput``): an in-process :class:`~node_agent.serving.ServingCore` with a
generated model; at each ``--streams`` count (8 and 32 by default) three modes with the same
prompts and ``--max-tokens``: ``plain`` (every stream unconstrained), ``constrained`` (every
stream under a JSON-schema grammar that cannot end before ``--max-tokens``: an integer array
with a huge ``minItems``) and ``mixed`` (one constrained stream among unconstrained ones: the
cost a constrained request puts on the others, reported for the unconstrained streams). Greedy,
coalescing and the prompt cache off (every round pays the same prefill). ``in_engine_us_per_token``:
the mean time :class:`~node_agent.serving.constrain.GrammarProcessor` spent per constrained token
inside the batch step advancing its matcher, computing the mask and applying it;
``in_engine_wait_us_per_token``: its wait for the previous step's token (the overlap lost). Aggregate completion tokens/s (tokens
of the counted streams ÷ the round's wall time), rounds alternating mode order; medians and
the ratios ``constrained ÷ plain`` and ``mixed ÷ plain`` side by side.

    python benchmarks/constrained.py --help
    python benchmarks/constrained.py --smoke                # a few seconds (CI, the 2-core box)
    python benchmarks/constrained.py --hidden-size 2048 --num-layers 16 --max-tokens 128 \\
        --streams 8 32 --rounds 3                            # a GPU

Results: ``benchmarks/results/constrained-<device>.json`` (machine, versions, every round).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from common import machine
from mlx_fleet.devcluster.binaries import cache_dir
from mlx_fleet.testmodel import make_test_model

RESULTS = Path(__file__).resolve().parent / "results"
MODEL_ID = "bench"

#: ``name: (schema, a valid instance, an instance breaking only a bound or pattern)``.
SCHEMAS: dict[str, tuple[dict[str, Any], Any, Any]] = {
    "flat": ({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False},
        {"name": "Ada", "age": 36}, {"name": "Ada", "age": 999}),
    "nested": ({"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
            "required": ["id", "zip", "tags"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
        {"user": {"id": 7, "zip": "12345", "tags": ["a", "c"]}},
        {"user": {"id": 7, "zip": "12345", "tags": ["a", "c", "b", "a"]}}),
    "anyOf": ({"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5},
                            {"type": "string", "maxLength": 4}]}},
        "required": ["value"], "additionalProperties": False},
        {"value": "abc"}, {"value": 50}),
    "long-text": ({"type": "object", "properties": {
        "summary": {"type": "string", "maxLength": 400}},
        "required": ["summary"], "additionalProperties": False},
        {"summary": "The quick brown fox jumps over the lazy dog. " * 6},
        {"summary": "x" * 401}),
}

#: The throughput grammar's schema: JSON that cannot end before max_tokens.
ENDLESS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
           "minItems": 100000}


# ---------------------------------------------------------------------------------------------
# masks
# ---------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte ↔ printable-character table of byte-level BPE vocabularies (what the
    generated tokenizer's ``ByteLevel`` pre-tokenizer uses)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def outlines_vocabulary(hf: Any) -> Any:
    """outlines-core's ``Vocabulary`` of a byte-level BPE Hugging Face tokenizer (token bytes →
    ids; special tokens but EOS left out)."""
    import outlines_core

    decode = {v: k for k, v in _bytes_to_unicode().items()}
    special = set(hf.all_special_tokens)
    tokens: dict[bytes, list[int]] = {}
    for text, i in hf.get_vocab().items():
        if i == hf.eos_token_id or text in special:
            continue
        try:
            tokens.setdefault(bytes(decode[c] for c in text), []).append(i)
        except KeyError:
            continue
    return outlines_core.Vocabulary(hf.eos_token_id, tokens)


class _LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any) -> None:
        from node_agent.serving.constrain import ll_tokenizer

        self.tok = ll_tokenizer(tokenizer)

    def compile(self, schema: dict[str, Any]) -> Any:
        from llguidance import LLMatcher

        from node_agent.serving.grammar import json_schema_grammar

        m = LLMatcher(self.tok, json_schema_grammar(schema), log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def walk(self, compiled: Any, tokens: list[int]) -> float:
        import llguidance.numpy as llnp

        m = compiled.deep_copy()
        mask = llnp.allocate_token_bitmask(1, self.tok.vocab_size)
        t0 = time.perf_counter()
        for t in tokens:
            llnp.fill_next_token_bitmask(m, mask)
            if not m.consume_token(t):
                raise AssertionError("llguidance refused a valid instance")
        return (time.perf_counter() - t0) / len(tokens)

    def accepts(self, compiled: Any, tokens: list[int]) -> bool:
        m = compiled.deep_copy()
        return m.consume_tokens(tokens) and m.is_accepting()


class _Outlines:
    name = "outlines-core"

    def __init__(self, tokenizer: Any) -> None:
        self.vocab = outlines_vocabulary(tokenizer._tokenizer)
        self.n = len(tokenizer._tokenizer.get_vocab())

    def compile(self, schema: dict[str, Any]) -> Any:
        import outlines_core

        regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(schema), None)
        return outlines_core.Index(regex, self.vocab)

    def walk(self, compiled: Any, tokens: list[int]) -> float:
        import numpy as np
        import outlines_core

        guide = outlines_core.Guide(compiled)
        mask = np.full((1, (self.n + 31) // 32), -1, dtype=np.int32)
        t0 = time.perf_counter()
        for t in tokens:
            guide.write_mask_into(mask.ctypes.data, mask.size, 4)
            guide.advance(t, return_tokens=False)
        return (time.perf_counter() - t0) / len(tokens)

    def accepts(self, compiled: Any, tokens: list[int]) -> bool:
        import outlines_core

        guide = outlines_core.Guide(compiled)
        try:
            for t in tokens:
                guide.advance(t, return_tokens=False)
        except Exception:  # noqa: BLE001 - outlines-core raises on a refused token
            return False
        return guide.is_finished()


def measure_masks(model_dir: Path, rounds: int) -> dict[str, Any]:
    from mlx_lm import load

    _, tokenizer = load(model_dir)
    compact = {"separators": (",", ":")}
    out: dict[str, Any] = {}
    libs = [_LLGuidance(tokenizer), _Outlines(tokenizer)]
    for name, (schema, valid, invalid) in SCHEMAS.items():
        good = tokenizer.encode(json.dumps(valid, **compact), add_special_tokens=False)
        bad = tokenizer.encode(json.dumps(invalid, **compact), add_special_tokens=False)
        row: dict[str, Any] = {"tokens": len(good)}
        for lib in libs:
            t0 = time.perf_counter()
            compiled = lib.compile(schema)
            compile_ms = 1000 * (time.perf_counter() - t0)
            per_token = statistics.median(lib.walk(compiled, good) for _ in range(rounds))
            row[lib.name] = {"compile_ms": compile_ms, "mask_us_per_token": 1e6 * per_token,
                             "accepts_valid": lib.accepts(compiled, good),
                             "enforces": not lib.accepts(compiled, bad)}
        row["mask_cost_ratio_llguidance_over_outlines"] = (
            row["llguidance"]["mask_us_per_token"] / row["outlines-core"]["mask_us_per_token"])
        out[name] = row
        print(f"{name:>10}: llguidance {row['llguidance']['mask_us_per_token']:7.1f} µs/token "
              f"(compile {row['llguidance']['compile_ms']:.1f} ms, enforces "
              f"{row['llguidance']['enforces']}), outlines-core "
              f"{row['outlines-core']['mask_us_per_token']:7.1f} µs/token (compile "
              f"{row['outlines-core']['compile_ms']:.1f} ms, enforces "
              f"{row['outlines-core']['enforces']})", file=sys.stderr)
    return out


# ---------------------------------------------------------------------------------------------
# throughput
# ---------------------------------------------------------------------------------------------


async def _round(core: Any, mode: str, streams: int, max_tokens: int, grammar: str
                 ) -> dict[str, Any]:
    constrained = {"plain": set(), "constrained": set(range(streams)), "mixed": {0}}[mode]

    async def one(i: int) -> int:
        gen = await core.generate(
            MODEL_ID, messages=[{"role": "user", "content": f"Request {i}: list numbers"}],
            max_tokens=max_tokens, temperature=0.0,
            grammar=grammar if i in constrained else None)
        async with gen:
            async for _ in gen:
                pass
        return gen.completion_tokens

    t0 = time.perf_counter()
    tokens = await asyncio.gather(*(one(i) for i in range(streams)))
    wall = time.perf_counter() - t0
    # mixed: what the unconstrained streams got; else every stream
    counted = [t for i, t in enumerate(tokens) if mode != "mixed" or i not in constrained]
    return {"mode": mode, "streams": streams, "wall_s": wall, "tokens": sum(counted),
            "tokens_per_s": sum(counted) / wall}


async def measure_throughput(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry

    from node_agent.serving import ServingCore, ServingOptions
    from node_agent.serving.grammar import json_schema_grammar

    grammar = json_schema_grammar(ENDLESS)
    from node_agent.serving import constrain

    processors: list[Any] = []
    make = constrain.Constraint.processor

    def recorded(self: Any) -> Any:   # the processors the engine makes, to read their timing
        processors.append(make(self))
        return processors[-1]

    constrain.Constraint.processor = recorded  # type: ignore[method-assign]
    core = ServingCore(registry=CollectorRegistry(), max_queued_requests=4 * max(args.streams),
                       options=ServingOptions(request_coalescing=False, prompt_cache=False))
    await core.start()
    rounds: list[dict[str, Any]] = []
    in_engine: dict[str, tuple[float, float]] = {}
    try:
        await core.load_model(MODEL_ID, model_dir, revision="bench",
                              max_concurrent_sequences=max(args.streams),
                              max_context_tokens=4096)
        modes = ("plain", "constrained", "mixed")
        for streams in args.streams:
            for mode in modes:   # warm-up: kernels of this batch size, the tokenizer adapter
                await _round(core, mode, streams, 4, grammar)
            processors.clear()
            for r in range(args.rounds):
                for mode in modes if r % 2 == 0 else tuple(reversed(modes)):
                    rounds.append(await _round(core, mode, streams, args.max_tokens, grammar))
                    print(f"{streams:3d} streams {mode:>11}: "
                          f"{rounds[-1]['tokens_per_s']:8.1f} tok/s", file=sys.stderr)
            calls = sum(p.calls for p in processors)
            in_engine[str(streams)] = (
                1e6 * sum(p.seconds for p in processors) / max(1, calls),
                1e6 * sum(p.wait_seconds for p in processors) / max(1, calls))
    finally:
        constrain.Constraint.processor = make  # type: ignore[method-assign]
        await core.close()
    summary: dict[str, Any] = {}
    for streams in args.streams:
        med = {m: statistics.median(x["tokens_per_s"] for x in rounds
                                    if x["streams"] == streams and x["mode"] == m)
               for m in ("plain", "constrained", "mixed")}
        summary[str(streams)] = {
            **{f"{m}_tokens_per_s": v for m, v in med.items()},
            "constrained_over_plain": med["constrained"] / med["plain"],
            "mixed_unconstrained_over_plain": med["mixed"] / med["plain"],
            "in_engine_us_per_token": in_engine[str(streams)][0],
            "in_engine_wait_us_per_token": in_engine[str(streams)][1]}
    return {"rounds": rounds, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, nargs="+", default=[8, 32])
    p.add_argument("--max-tokens", type=int, default=64, help="completion tokens per stream")
    p.add_argument("--rounds", type=int, default=3, help="rounds per streams count")
    p.add_argument("--mask-rounds", type=int, default=20, help="walks per schema and library")
    p.add_argument("--hidden-size", type=int, default=256, help="generated model width")
    p.add_argument("--num-layers", type=int, default=4, help="generated model depth")
    p.add_argument("--vocab-size", type=int, default=1024, help="generated tokenizer vocabulary")
    p.add_argument("--smoke", action="store_true",
                   help="a few seconds: the default test model, 32 tokens, 2 rounds")
    p.add_argument("--output", type=Path, default=None,
                   help="result JSON (default benchmarks/results/constrained-<device>.json)")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden_size, args.num_layers, args.vocab_size = 64, 2, 512
        args.max_tokens, args.rounds, args.mask_rounds = 32, 2, 5
    model_dir = make_test_model(
        cache_dir() / "models" / f"bench-h{args.hidden_size}-l{args.num_layers}"
        f"-v{args.vocab_size}", hidden_size=args.hidden_size, num_layers=args.num_layers,
        vocab_size=args.vocab_size)
    masks = measure_masks(model_dir, args.mask_rounds)
    throughput = asyncio.run(measure_throughput(model_dir, args))
    device = machine()
    result = {
        "benchmark": "constrained",
        "machine": device,
        "versions": {p: metadata.version(p) for p in ("mlx", "mlx-lm", "llguidance",
                                                      "outlines-core")},
        "params": vars(args) | {"output": str(args.output)},
        "masks": masks,
        "throughput": throughput,
    }
    name = device["mlx_device"].split("(")[-1].split(",")[0]
    out = args.output or RESULTS / f"constrained-{name}{'-smoke' if args.smoke else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for streams, s in throughput["summary"].items():
        print(f"{streams} streams: constrained/plain ×{s['constrained_over_plain']:.2f}, "
              f"mixed (unconstrained streams)/plain ×{s['mixed_unconstrained_over_plain']:.2f}, "
              f"{s['in_engine_us_per_token']:.0f} µs per constrained token in the step "
              f"(+{s['in_engine_wait_us_per_token']:.0f} µs waiting for its token)",
              file=sys.stderr)
    print(f"→ {out} ({device['cpu']}, {device['mlx_device']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
