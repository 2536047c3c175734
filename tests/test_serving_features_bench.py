"""benchmarks/serving.py's issue-20 workloads, their pure parts: the check of each answer
(benchmarks/served.py), the "not served" verdict, the streamed tool-call reassembly, the
summary's ratios and table, and vllm-mlx's install and start command (no server, no pip)."""

from __future__ import annotations

import base64
import json
import struct
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import served  # noqa: E402
import vllm_mlx_server as vm  # noqa: E402
from serving import (merge_tool_call_deltas, requests_for, round_result,  # noqa: E402
                     summarise, table)

PERSON = {"name": "Ada", "age": 36, "tags": ["red"], "active": True}


@pytest.mark.parametrize(("content", "finish", "verdict"), [
    (json.dumps(PERSON), "stop", "valid"),
    (json.dumps(PERSON), "length", "valid"),
    ("Sure! Here is a person: Ada", "stop", "ignored"),
    ("model weights memory token batch", "length", "ignored"),     # text, cut: still ignored
    (json.dumps(PERSON | {"age": 999}), "stop", "ignored"),         # a bound not applied
    (json.dumps({"name": "Ada"}), "stop", "ignored"),               # required fields missing
    (json.dumps(PERSON | {"extra": 1}), "stop", "ignored"),         # additionalProperties
    ('{"name": "Ada", "age": 3', "length", "truncated"),            # JSON cut by max_tokens
    ('{"name": "Ada", "age": 3', "stop", "ignored"),
])
def test_json_answers(content: str, finish: str, verdict: str) -> None:
    assert served.check_json(content, finish).split(":")[0] == verdict


def call(name: str, arguments: str) -> dict:
    return {"id": "c1", "function": {"name": name, "arguments": arguments}}


@pytest.mark.parametrize(("calls", "finish", "content", "verdict"), [
    ([call("get_weather", '{"city": "Paris", "unit": "celsius"}')], "tool_calls", "", "valid"),
    ([], "stop", "It is sunny.", "ignored"),
    ([], "length", "model weights memory", "ignored"),
    ([], "length", '<tool_call>\n{"name": "get_weather", "argu', "truncated"),
    ([call("get_time", "{}")], "tool_calls", "", "invalid"),
    ([call("get_weather", '{"city": "Paris", "unit": "kelvin"}')], "tool_calls", "", "invalid"),
    ([call("get_weather", '{"city": "Par')], "length", "", "truncated"),
    ([call("get_weather", '{"city": "Par')], "tool_calls", "", "invalid"),
])
def test_tool_call_answers(calls: list, finish: str, content: str, verdict: str) -> None:
    assert served.check_tool_calls(calls, finish, content).split(":")[0] == verdict


def test_embedding_answers() -> None:
    b64 = base64.b64encode(struct.pack("<4f", 0.1, 0.2, 0.3, 0.4)).decode()
    assert served.check_embeddings({"data": [{"embedding": [0.1, 0.2]}] * 2}, 2) == "valid"
    assert served.check_embeddings({"data": [{"embedding": b64}]}, 1) == "valid"
    assert served.check_embeddings({"data": [{"embedding": [0.1]}]}, 2).startswith("invalid")
    assert served.check_embeddings({"data": [{"embedding": []}]}, 1).startswith("invalid")
    assert served.check_embeddings({"object": "list"}, 1).startswith("ignored")


def outcome(status: int | None = 200, error: str = "", check: str | None = "valid") -> dict:
    return {"status": status, "error": error, "check": check}


def test_a_refused_or_ignored_feature_is_not_served() -> None:
    refused = served.classify([outcome(404, "HTTP 404: Not Found", None)] * 3)
    assert refused["not_served"].startswith("refused: HTTP 404")
    ignored = served.classify([outcome(check="ignored: content is not JSON ('x')")] * 2
                              + [outcome(check="truncated")])
    assert ignored["not_served"].startswith("ignored: content is not JSON")


def test_failures_are_errors_not_a_refusal() -> None:
    # every request failed inside the server (vllm-mlx's constrained decoding off Metal): the
    # server takes the feature and fails it, which is errors with their reason
    v = served.classify([outcome(500, "HTTP 500: Internal server error", None)] * 2)
    assert v["not_served"] is None and v["errors"] == 2
    assert v["error_samples"] == ["HTTP 500: Internal server error"]
    # some answers applied the feature: served, the others are errors
    v = served.classify([outcome(), outcome(check="ignored: no tool call ('')"),
                         outcome(check="truncated")])
    assert v["not_served"] is None and v["errors"] == 2
    assert served.classify([outcome(check=None)] * 2) == {
        "not_served": None, "errors": 0, "error_samples": []}


def test_round_counts_only_checked_answers() -> None:
    ok = {"ttft": 0.1, "gaps": [0.01], "tokens": 40, "error": "", "status": 200,
          "check": "valid", "seconds": 1.0}
    r = round_result("json", [ok, ok | {"check": "ignored: x", "tokens": 100}], 2.0)
    assert r["output_tokens_per_second"] == 20 and r["errors"] == 1
    assert r["not_served"] is None
    r = round_result("embeddings", [{"error": "", "status": 200, "inputs": 32,
                                     "check": "valid", "seconds": 0.5}] * 2, 1.0)
    assert r["inputs_per_second"] == 64 and r["latency_p50_seconds"] == 0.5


def test_streamed_tool_call_deltas_reassemble() -> None:
    calls: dict = {}
    merge_tool_call_deltas(calls, [{"index": 0, "id": "call_1", "type": "function",
                                    "function": {"name": "get_weather", "arguments": ""}}])
    merge_tool_call_deltas(calls, [{"index": 0, "function": {"arguments": '{"city": '}}])
    merge_tool_call_deltas(calls, [{"index": 0, "function": {"arguments": '"Oslo"}'}},
                                   {"index": 1, "id": "call_2",
                                    "function": {"name": "get_weather", "arguments": "{}"}}])
    assert calls[0] == {"id": "call_1", "function": {"name": "get_weather",
                                                     "arguments": '{"city": "Oslo"}'}}
    assert calls[1]["id"] == "call_2"


def test_json_and_its_plain_twin_send_the_same_prompts() -> None:
    constrained = requests_for("json", 4, 32, 1)
    plain = requests_for("json-plain", 4, 32, 1)
    assert [b["messages"] for b in constrained] == [b["messages"] for b in plain]
    assert all(b["response_format"]["json_schema"]["schema"] == served.JSON_SCHEMA
               for b in constrained)
    assert not any("response_format" in b for b in plain)
    assert all(b["max_tokens"] >= 256 for b in constrained + plain)
    tools = requests_for("tools", 2, 32, 0)
    assert all(b["tool_choice"] == "required" and b["tools"] == [served.TOOL] for b in tools)


def rnd(workload: str, server: str, tps: float, errors: int = 0, not_served: str | None = None,
        concurrency: object = 8) -> dict:
    return {"workload": workload, "concurrency": concurrency, "server": server,
            "output_tokens_per_second": tps, "requests_per_second": 1.0,
            "ttft_p50_seconds": 0.1, "ttft_p95_seconds": 0.1, "itl_p50_seconds": None,
            "itl_p95_seconds": None, "errors": errors, "not_served": not_served,
            "error_samples": ["HTTP 500: x"] if errors else []}


def test_summary_not_served_and_constrained_over_plain() -> None:
    rounds = [rnd("json", "ours", 60), rnd("json-plain", "ours", 100),
              rnd("json", "reference", 0, errors=0, not_served="ignored: content is not JSON"),
              rnd("json-plain", "reference", 80),
              rnd("json", "vllm-mlx", 0, errors=8), rnd("json-plain", "vllm-mlx", 50)]
    s = summarise(rounds)
    cell = s["json"]["8"]
    assert cell["reference"] == {"not_served": "ignored: content is not JSON"}
    assert cell["tokens_per_second_ratio"] is None and "reference" in cell["not_served"]
    assert cell["vllm_mlx_tokens_per_second_ratio"] is None and cell["vllm_mlx_invalid"]
    assert cell["constrained_over_plain"] == {"ours": pytest.approx(0.6), "reference": None,
                                              "vllm-mlx": None}
    assert s["json-plain"]["8"]["vllm_mlx_tokens_per_second_ratio"] == pytest.approx(2.0)
    lines = "\n".join(table(s))
    assert "reference not served (ignored: content is not JSON)" in lines
    assert "ours constrained÷plain ×0.60" in lines and "vllm-mlx 8 errors" in lines


def test_embeddings_are_compared_by_inputs_per_second() -> None:
    rounds = [rnd("embeddings", "ours", 0, concurrency="1x32") | {"inputs_per_second": 300},
              rnd("embeddings", "vllm-mlx", 0, concurrency="1x32") | {"inputs_per_second": 100},
              rnd("embeddings", "reference", 0, concurrency="1x32",
                  not_served="refused: HTTP 404: Not Found")]
    cell = summarise(rounds)["embeddings"]["1x32"]
    assert cell["vllm_mlx_tokens_per_second_ratio"] == pytest.approx(3.0)
    assert cell["tokens_per_second_ratio"] is None
    assert cell["reference"]["not_served"].startswith("refused")
    assert "ours 300.0 inputs/s" in table({"embeddings": {"1x32": cell}})[0]


def test_vllm_mlx_install_and_start(tmp_path: Path) -> None:
    offline = vm.install_argv("python3", tmp_path / "site", tmp_path / "wheels")
    assert offline[offline.index("--find-links") + 1] == str(tmp_path / "wheels")
    assert "--no-index" in offline and "--no-deps" in offline
    assert "vllm-mlx==0.6.0" in offline and "mlx-lm==0.31.3" in offline
    assert "--no-index" not in vm.install_argv("python3", tmp_path / "site", None)
    env = vm.environment(tmp_path / "site", {"PYTHONPATH": "/a:/b", "X": "1"}, tmp_path)
    assert env["PYTHONPATH"].split(":") == [str(tmp_path / "site"), "/a", "/b"]
    assert env["X"] == "1" and env["HOME"] == str(tmp_path)
    argv = vm.serve_argv("python3", Path("/m"), 4321, 32, 8.0, "bench", Path("/e"))
    assert argv[argv.index("--port") + 1] == "4321"
    assert argv[argv.index("--max-num-seqs") + 1] == "32"
    assert "--continuous-batching" in argv and argv[argv.index("--embedding-model") + 1] == "/e"
    assert "--embedding-model" not in vm.serve_argv("python3", Path("/m"), 1, 8, 8.0, "b")


def test_a_built_site_is_reused(tmp_path: Path) -> None:
    site = tmp_path / f"site-{vm.VERSION}"
    site.mkdir()
    (site / ".mlx-fleet-requirements.json").write_text(json.dumps(list(vm.REQUIREMENTS)))
    assert vm.site(root=tmp_path) == site          # no pip: a run would fail offline here


def test_plot_panels_show_why_a_ratio_is_missing() -> None:
    from serving import plot_bars

    rounds = [rnd("json", "ours", 60), rnd("json-plain", "ours", 100),
              rnd("json", "reference", 0, not_served="ignored: content is not JSON"),
              rnd("json-plain", "reference", 80),
              rnd("json", "vllm-mlx", 0, errors=8), rnd("json-plain", "vllm-mlx", 50)]
    panels = {name: series for name, _, series in plot_bars(summarise(rounds))}
    assert panels["json"] == {"ours ÷ reference": ["not served"], "ours ÷ vllm-mlx": ["errors"]}
    assert panels["json: constrained ÷ plain"] == {
        "ours": [pytest.approx(0.6)], "reference": ["not served"], "vllm-mlx": ["errors"]}
    assert panels["json-plain"]["ours ÷ vllm-mlx"] == [pytest.approx(2.0)]


def test_plain_twin_decodes_as_many_tokens_as_the_constrained_answers() -> None:
    from serving import twin_max_tokens

    warm = {"ours": {"tokens_per_request": 52.4, "not_served": None},
            "reference": {"tokens_per_request": 256.0, "not_served": "ignored: not JSON"},
            "vllm-mlx": {"tokens_per_request": None, "not_served": None},   # 500s only
            "baseline": {"tokens_per_request": 60.6, "not_served": None}}
    assert twin_max_tokens(warm) == {"ours": 52, "reference": 52, "vllm-mlx": 52,
                                     "baseline": 61}
    warm["ours"] = {"tokens_per_request": None, "not_served": "refused: HTTP 400"}
    assert twin_max_tokens(warm)["ours"] == 61
    assert twin_max_tokens({"reference": warm["reference"]}) == {"reference": None}
