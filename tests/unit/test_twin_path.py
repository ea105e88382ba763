"""The serving path's measured CPU per request (``carpool_twin.path``) and the ceilings it
sets: a synthetic path benchmark file read field by field, and bounds that follow from
cores x 1000 / CPU-ms per request."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from carpool_twin.cli import main as twin_cli
from carpool_twin.path import (
    DEFAULT_PATH_PROFILE,
    PathProfileError,
    ServingPath,
    extract_path,
    ingress_deployments,
    ingress_nodes,
    load_path_profile,
    tier_units,
    with_replicas,
)
from carpool_twin.traffic import parse_traffic

ROOT = Path(__file__).resolve().parents[2]
CLASSES = ("ray_proxy", "haproxy", "ingress", "router", "model", "engine", "ray_system", "peer")


def row(answered: int, window_s: float, **cpu_ms: float) -> dict[str, Any]:
    """One benchmark row as ``python -m benchmarks path`` writes it (the fields read here)."""
    cpu = {c: float(cpu_ms.get(c, 0.0)) for c in CLASSES}
    path = sum(v for c, v in cpu.items() if c not in ("model", "engine", "peer"))
    return {
        "answered": answered,
        "window_s": window_s,
        "cpu_ms": cpu,
        "cpu_ms_per_req": {c: v / answered for c, v in cpu.items()},
        "path_cpu_ms_per_req": path / answered,
    }


def bench(scale: float = 1.0) -> dict[str, Any]:
    """One round; ``scale`` multiplies every CPU figure (a second, slower round)."""
    carpool = {
        "embed": row(1000, 10.0, haproxy=100 * scale, ingress=2000 * scale, model=3000),
        "rerank": row(10, 10.0, haproxy=5, ingress=500),  # idle-dominated: not read
        # Router off the path (model small): 20 ms over 10 s is its idle CPU, 2 ms/s.
        "completion": row(500, 10.0, haproxy=60 * scale, ingress=1250 * scale, router=20),
        # 100 answers in 20 s: 340 ms of router CPU, 40 of it idle: 3 ms per answer.
        "auto": row(100, 20.0, haproxy=10, ingress=400, router=40 + 300 * scale),
    }
    python = copy.deepcopy(carpool)
    for body in python.values():
        body["cpu_ms_per_req"]["ray_proxy"] = 3.0 * scale
    return {
        "command": "python -m benchmarks path --rounds 1",
        "finished": "2026-11-28 15:18:35",
        "machine": {"nproc": 2},
        "rounds": [{"carpool": carpool, "carpool-python-proxy": python}],
    }


def test_extraction_reads_each_components_cpu_ms_per_request() -> None:
    doc = extract_path(bench(), "x.json", "python -m carpool_twin path-profile x.json")
    ms = doc["modes"]["haproxy"]["cpu_ms_per_request"]
    assert ms["http"] == {"embed": 0.1, "rank": 0.1, "generate": 0.12}  # rank: embed's row
    assert ms["ingress"] == {"embed": 2.0, "rank": 2.0, "generate": 2.5}
    assert ms["router"] == {"generate": pytest.approx(3.0)}  # idle CPU taken out, not 3.4
    python = doc["modes"]["python-proxy"]["cpu_ms_per_request"]
    assert python["http"] == {"embed": 3.0, "rank": 3.0, "generate": 3.0}
    assert doc["benchmark"]["file"] == "x.json" and doc["name"] == "path-cpu-2core"
    assert doc["benchmark"]["command"] == "python -m benchmarks path --rounds 1"
    assert doc["default_mode"] == "haproxy"


def test_without_a_router_process_its_cost_is_auto_less_chat_path_cpu() -> None:
    """The router runs in the generate ingress: row auto's path CPU per answer (all but model
    and engine) less row chat's, the same request naming small."""
    doc = bench()
    rnd = doc["rounds"][0]
    for system in ("carpool", "carpool-python-proxy"):
        rnd[system]["chat"] = row(200, 20.0, haproxy=40, ingress=500, model=9000)
        rnd[system]["auto"] = row(100, 20.0, haproxy=20, ingress=300, model=9000, engine=800)
    ms = extract_path(doc, "x.json", "cmd")["modes"]["haproxy"]["cpu_ms_per_request"]
    assert ms["router"]["generate"] == pytest.approx((0.2 + 3.0) - (0.2 + 2.5))
    rnd["carpool"]["auto"] = row(100, 20.0, haproxy=20, ingress=200, model=9000)
    ms = extract_path(doc, "x.json", "cmd")["modes"]["haproxy"]["cpu_ms_per_request"]
    assert ms["router"]["generate"] == 0.0  # cheaper than chat: no negative cost
    del rnd["carpool"]["chat"]
    with pytest.raises(PathProfileError, match="'carpool' row 'chat'"):
        extract_path(doc, "x.json", "cmd")


def test_extraction_takes_the_median_over_rounds() -> None:
    three = bench()
    three["rounds"] += bench(2.0)["rounds"] + bench(3.0)["rounds"]
    ms = extract_path(three, "x.json", "cmd")["modes"]["haproxy"]["cpu_ms_per_request"]
    assert ms["ingress"]["embed"] == pytest.approx(4.0)
    assert ms["router"]["generate"] == pytest.approx(6.0)


def test_extraction_names_the_missing_row() -> None:
    doc = bench()
    del doc["rounds"][0]["carpool"]["auto"]
    with pytest.raises(PathProfileError, match="'carpool' row 'auto'"):
        extract_path(doc, "x.json", "cmd")
    with pytest.raises(PathProfileError, match="no rounds"):
        extract_path({"rounds": []}, "x.json", "cmd")


def test_the_cli_writes_a_profile_the_twin_loads(tmp_path: Path) -> None:
    source = tmp_path / "path.json"
    source.write_text(json.dumps(bench()))
    out = tmp_path / "path-profile.json"
    assert twin_cli(["path-profile", str(source), "--out", str(out)]) == 0
    doc = load_path_profile(out)
    assert doc["command"].startswith("python -m carpool_twin path-profile")
    assert ServingPath.load(out, "python-proxy").ms["http"]["embed"] == 3.0


GPU_CONFIG = yaml.safe_load((ROOT / "serve-gpu.yaml").read_text())
MIX = parse_traffic("embed=3,rank=1,generate=1")


def scales(path: ServingPath, config: dict[str, Any] = GPU_CONFIG, gpus: float = 64) -> dict:
    return {b.name: b.scale for b in path.bounds(config, MIX, gpus)}


def haproxy(ingress_embed: float = 2.0, head_cores: float | None = None) -> ServingPath:
    ms = {
        "http": {"embed": 0.1, "rank": 0.1, "generate": 0.1},
        "ingress": {"embed": ingress_embed, "rank": 2.0, "generate": 2.5},
        "router": {"generate": 4.0},
    }
    return ServingPath("haproxy", ms, http_threads=4, head_cores=head_cores)


def test_each_ceiling_is_cores_times_1000_over_measured_cpu_ms() -> None:
    got = scales(haproxy())
    # 64 GPUs: 8 nodes and the head, 4 HAProxy threads each, 0.1 ms x 5 requests per mix.
    assert got["HTTP (HAProxy)"] == pytest.approx(9 * 4 * 1000 / 0.5)
    # serve-gpu.yaml: 2 embed ingress replicas (3 embeds per mix), 2 generate ingress replicas.
    assert got["ingress embed_ingress"] == pytest.approx(2 * 1000 / (3 * 2.0))
    # The router runs in the generate ingress's 2 replicas: its 4 ms per auto joins theirs.
    assert got["ingress generate_ingress"] == pytest.approx(2 * 1000 / (2.5 + 4.0))
    assert "router" not in got  # no router process of its own


def test_halving_the_measured_ingress_cpu_doubles_its_bound() -> None:
    assert scales(haproxy(1.0))["ingress embed_ingress"] == pytest.approx(
        2 * scales(haproxy(2.0))["ingress embed_ingress"]
    )


def test_the_head_bound_counts_everything_the_head_runs() -> None:
    # Per mix: ingress 3x2 + 2 + 2.5, router 4, and the head's ninth of HTTP's 0.5 ms.
    head = scales(haproxy(head_cores=8.0))["head node CPU"]
    assert head == pytest.approx(8000 / (6 + 2 + 2.5 + 4 + 0.5 / 9))


def test_ingress_replicas_come_from_the_serve_config() -> None:
    assert ingress_deployments(GPU_CONFIG)["embed"] == ("embed_ingress", 2)  # serve-gpu.yaml
    config = copy.deepcopy(GPU_CONFIG)
    embed = next(a for a in config["applications"] if a["name"] == "embed")
    entry = next(d for d in embed["deployments"] if d["name"] == "embed_ingress")
    entry["num_replicas"] = 3
    rank = next(a for a in config["applications"] if a["name"] == "rank")
    rank["deployments"].append(
        {"name": "rank_ingress", "autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}
    )
    got = scales(haproxy(), config)
    assert got["ingress embed_ingress"] == pytest.approx(3 * 1000 / 6.0)
    assert got["ingress rank_ingress"] == pytest.approx(4 * 1000 / 2.0)
    # direct_ingress: the embedder's replicas take the embed pipeline's HTTP themselves.
    embed["args"]["direct_ingress"] = True
    assert ingress_deployments(config)["embed"] == ("embedder", 4)  # autoscaling's max


def test_the_python_proxy_mode_is_one_core_per_node() -> None:
    ms = {**haproxy().ms, "http": {"embed": 3.0, "rank": 3.0, "generate": 3.0}}
    path = ServingPath("python-proxy", ms, http_threads=1, head_cores=None)
    assert scales(path, gpus=16)["HTTP (Serve proxy)"] == pytest.approx(3 * 1000 / 15.0)


def test_the_whole_cluster_twin_gets_the_path_as_stages() -> None:
    over = haproxy().overheads(GPU_CONFIG, 16)
    stages = {s.name: (s.servers, s.ms) for s in over.path}
    assert stages["HTTP (HAProxy)"][0] == 3 * 4
    assert stages["ingress embed_ingress"] == (2, {"embed": 2.0})
    assert over.router_rps == pytest.approx(1000 / 4.0) and over.router_replicas == 2


def test_the_shipped_path_profile_loads_and_names_its_source() -> None:
    doc = load_path_profile(DEFAULT_PATH_PROFILE)
    assert (ROOT / doc["benchmark"]["file"]).exists()
    assert "benchmarks path" in doc["benchmark"]["command"]
    assert set(doc["modes"]) == {"haproxy", "python-proxy"}


def test_ingress_names_are_the_pipelines_own() -> None:
    from carpool_twin.path import DIRECT, INGRESS
    from pipelines import embed, generate, rank
    from pipelines.embed import EmbedArgs
    from pipelines.generate import GenerateArgs

    assert INGRESS == {
        "embed": embed.EMBED_INGRESS,
        "rank": rank.RANK_INGRESS,
        "generate": generate.GENERATE_INGRESS,
    }
    assert DIRECT["embed"] == ("direct_ingress", embed.EMBEDDER_DEPLOYMENT)
    assert DIRECT["generate"] == ("direct_streaming", generate.DIRECT_INGRESS)
    assert "direct_ingress" in EmbedArgs.model_fields
    assert "direct_streaming" in GenerateArgs.model_fields


# The ingress tier (issue 42): ingresses on carpool_ingress, which the head and ingress_cpu
# workers offer, sized for the load.

CLUSTER = yaml.safe_load((ROOT / "cluster.yaml").read_text())


def test_the_twins_ingress_tier_is_cluster_yamls() -> None:
    from carpool_twin.path import (
        HEAD_INGRESS_UNITS,
        INGRESS_NODE_TYPE,
        INGRESS_NODE_UNITS,
        INGRESS_RESOURCE,
    )

    types = CLUSTER["available_node_types"]
    head = types[CLUSTER["head_node_type"]]["resources"]
    node = types[INGRESS_NODE_TYPE]
    assert head[INGRESS_RESOURCE] == HEAD_INGRESS_UNITS
    assert node["resources"][INGRESS_RESOURCE] == INGRESS_NODE_UNITS
    # A CPU node that scales from zero: no GPU, and none of the GPU workers' docker options.
    assert "GPU" not in node["resources"] and node["min_workers"] == 0
    assert node["docker"]["worker_run_options"] == [] and node["worker_setup_commands"] == []
    for name, t in types.items():  # no GPU node offers it: a lost GPU node takes no ingress
        if "GPU" in t["resources"]:
            assert INGRESS_RESOURCE not in t["resources"], name
    # Every ingress takes one unit; the shipped replicas fit the head.
    for app in GPU_CONFIG["applications"]:
        assert app["args"]["ingress"]["resources"] == {INGRESS_RESOURCE: 1}, app["name"]
    assert tier_units(GPU_CONFIG) == 8 <= HEAD_INGRESS_UNITS
    assert ingress_nodes(tier_units(GPU_CONFIG)) == 0
    assert CLUSTER["max_workers"] >= sum(
        t.get("max_workers", 0) for n, t in types.items() if n != CLUSTER["head_node_type"]
    )


def test_ingress_replicas_are_sized_for_the_load_and_spill_to_ingress_nodes() -> None:
    path = haproxy()
    # 100x the mix: embed 300/s x 2 ms = 0.6 of a core, generate 100/s x (2.5 + 4) = 0.65.
    sized = path.size_ingress(GPU_CONFIG, MIX.scaled(100))
    assert sized == {"embed_ingress": 1, "rank_ingress": 1, "generate_ingress": 1}
    # 2000x: embed 6000/s x 2 ms = 12 cores -> 15 replicas; generate 2000/s x (2.5 + 4) -> 17.
    sized = path.size_ingress(GPU_CONFIG, MIX.scaled(2000))
    assert sized == {"embed_ingress": 15, "rank_ingress": 5, "generate_ingress": 17}
    config = with_replicas(GPU_CONFIG, sized)
    assert tier_units(config) == 15 + 5 + 17 + 3  # search, rag and openai: one each
    lay = path.layout(config, 64, 8)
    assert lay.ingress_nodes == 4  # (40 - 8 on the head) / 8
    assert lay.nodes == 8 + 1 + 4  # each ingress node brings its own HAProxy
    got = {b.name: b.scale for b in haproxy(head_cores=8.0).bounds(config, MIX, 64)}
    # Every ingress deployment now allows 2000 / 0.8, and the head holds its 8 busiest
    # replicas (Ray picks which) plus its HAProxy share: above 2000 too.
    for name in ("embed_ingress", "rank_ingress", "generate_ingress"):
        assert got[f"ingress {name}"] >= 2000 / 0.8 - 1e-6
    # The busiest replicas, per mix a second: an embed one's 3 x 2 / 15 = 0.4 ms (a rank
    # one's 2 / 5 too; a generate one's 6.5 / 17 less); the head's HAProxy: 0.5 ms over 13.
    head = 8000 / (8 * 0.4 + 0.5 / 13)
    assert got["head node CPU"] == pytest.approx(head) and head > 2000
    # The planned config keeps the rest: a deployment the app does not list gets an entry.
    assert "autoscaling_config" not in next(
        d for a in config["applications"] for d in a["deployments"] if d["name"] == "embed_ingress"
    )


def test_pinned_to_the_head_every_ingress_shares_its_cores() -> None:
    config = copy.deepcopy(GPU_CONFIG)
    for app in config["applications"]:
        app["args"]["ingress"]["resources"] = {"carpool_head_node": 0.01}
    config = with_replicas(config, haproxy().size_ingress(config, MIX.scaled(2000)))
    assert tier_units(config) is None and haproxy().layout(config, 64, 8).ingress_nodes == 0
    head = {b.name: b.scale for b in haproxy(head_cores=8.0).bounds(config, MIX, 64)}
    # All 37 replicas' CPU on the head's 8 cores: 8000 / (6 + 2 + 2.5 + 4 + 0.5 / 9).
    assert head["head node CPU"] == pytest.approx(8000 / (14.5 + 0.5 / 9))
    assert head["head node CPU"] < 2000  # the load the replicas were sized for
