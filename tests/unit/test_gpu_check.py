"""``make gpu-check`` (benchmarks/gpu_check.py) without a GPU: its arguments, the config it
deploys, the JSON it writes, and its refusal on a machine with no GPU (this one)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from benchmarks import gpu_check
from carpool import cuda_driver

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_fit_the_ten_minutes_and_sixteen_streaming_clients() -> None:
    args = gpu_check.parse_args([])
    assert args.clients == 16
    assert args.budget_s < 600
    assert args.config == ROOT / "serve-gpu.yaml"
    assert args.out.name.endswith(".json")


@pytest.mark.parametrize(
    "argv",
    [["--clients", "0"], ["--load-s", "-1"], ["--load-s", "200", "--budget-s", "540"]],
)
def test_bad_arguments_are_refused_by_value(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        gpu_check.parse_args(argv)
    assert exited.value.code == 2
    assert argv[1] in capsys.readouterr().err


def test_the_deployed_config_is_serve_gpu_yaml_on_one_machine(tmp_path: Path) -> None:
    from ray.serve.schema import ServeDeploySchema

    text = (ROOT / "serve-gpu.yaml").read_text()
    config = gpu_check.prepare_config(text, str(tmp_path / "index"), 8123)
    ServeDeploySchema.model_validate(config)
    original = yaml.safe_load(text)
    assert [a["name"] for a in config["applications"]] == [
        a["name"] for a in original["applications"]
    ]
    assert config["http_options"] == {**original["http_options"], "host": "127.0.0.1", "port": 8123}
    (search,) = [a for a in config["applications"] if a["name"] == "search"]
    assert search["args"]["retriever"]["index_dir"] == str(tmp_path / "index")
    (generate,) = [a for a in config["applications"] if a["name"] == "generate"]
    (large,) = [d for d in generate["deployments"] if d["name"] == "large"]
    assert large["autoscaling_config"]["min_replicas"] == 1
    # Every replica asks only for resources the check's one-node Ray offers.
    for app in config["applications"]:
        for section in app.get("args", {}).values():
            if isinstance(section, dict):
                block = section.get("replica", section)
                assert set(block.get("resources") or {}) <= set(gpu_check.RESOURCES)
    # The GPU fractions fit one GPU.
    gpus = sum(
        section["replica"]["num_gpus"]
        for app in config["applications"]
        for section in app.get("args", {}).values()
        if isinstance(section, dict) and "replica" in section
    )
    assert 0 < gpus <= 1


def test_summaries_and_percentiles() -> None:
    assert gpu_check.percentile([], 50) is None
    assert gpu_check.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert gpu_check.percentile([float(i) for i in range(100)], 99) == 98.0
    items = gpu_check.summarize_items(320, 10.0, 1)
    assert items == {"items": 320, "seconds": 10.0, "items_per_s": 32.0, "errors": 1}
    stream = gpu_check.summarize_stream(1280, 10.0, [0.1, 0.2, 0.3], 0)
    assert stream["tokens_per_s"] == 128.0 and stream["requests"] == 3
    assert stream["ttft_p50_ms"] == 200.0 and stream["ttft_p99_ms"] == 300.0


def test_no_gpu_is_refused_clearly_with_a_json_of_the_same_shape(tmp_path: Path) -> None:
    if cuda_driver.driver_version() is not None:
        pytest.skip("this machine has an NVIDIA driver: the refusal is not what runs")
    out = tmp_path / "gpu-check.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "refused: no NVIDIA driver" in done.stderr
    result = json.loads(out.read_text())
    skeleton = gpu_check.result_skeleton(gpu_check.parse_args([]), "refused", "x")
    assert set(result) == set(skeleton)
    assert result["status"] == "refused" and "no NVIDIA driver" in result["reason"]
    assert result["load"] == {} and result["gpu"] is None


def test_make_gpu_check_installs_first_and_writes_one_json() -> None:
    makefile = (ROOT / "Makefile").read_text()
    phony = next(line for line in makefile.splitlines() if line.startswith(".PHONY:"))
    assert "gpu-check" in phony.split()
    header = makefile.split("\ngpu-check:", 1)[1].split("\n", 2)
    assert header[0].split() == ["gpu-node"]
    assert "-m benchmarks.gpu_check --out" in header[1]


# The torch-only part (benchmarks/gpu_torch_check.py): runs where Ray and vLLM cannot (issue 52).

# What a lent GPU machine lacks: nothing of these may be imported on the torch-only path.
BLOCKED = ("ray", "vllm", "pydantic", "fastapi")


def _torch_only(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python -m benchmarks.gpu_torch_check`` in a Python where importing any of BLOCKED
    fails, as on a machine without them."""
    script = (
        "import runpy, sys\n"
        f"for name in {BLOCKED!r}:\n"
        "    sys.modules[name] = None\n"
        f"sys.argv = ['gpu_torch_check', *{list(argv)!r}]\n"
        "runpy.run_module('benchmarks.gpu_torch_check', run_name='__main__', alter_sys=True)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from tests.factories import build_tiny_models

    return build_tiny_models(tmp_path_factory.mktemp("tiny-torch-check"))


def test_the_torch_only_check_runs_without_ray_vllm_or_pydantic(
    tiny: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "torch.json"
    done = _torch_only(
        "--device", "cpu", "--embedder", tiny["encoder"], "--generator", tiny["causal_lm"],
        "--texts", "300", "--requests", "4", "--max-tokens", "8", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["status"] == "ok", result["reason"]
    assert result["versions"]["ray"]  # recorded, never imported
    encoder, engine = result["encoder"], result["engine"]
    # serve-gpu.yaml's splitter cut 300 mixed texts into several passes, and no vector moved.
    assert encoder["passes"] >= 2 and encoder["padded_tokens"] >= encoder["real_tokens"]
    assert encoder["min_cosine_to_alone"] >= 0.9999
    # carpool's engine batched the four requests per step, each as it would be alone (fp32).
    assert engine["tokens"] == 4 * 8 and engine["engine_steps"] < engine["tokens"]
    assert engine["same_as_alone"] == 4


def test_the_torch_only_check_refuses_a_machine_without_cuda(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is not what runs")
    out = tmp_path / "torch.json"
    done = _torch_only("--out", str(out))
    assert done.returncode == 1
    assert "refused: torch" in done.stderr and "--device cpu" in done.stderr
    result = json.loads(out.read_text())
    assert result["status"] == "refused" and result["encoder"] is None


def test_the_torch_only_embed_pass_is_the_embedders(tiny: dict[str, str]) -> None:
    """gpu_torch_check keeps a copy of TextEmbedder.embed_ids (deployments/embedder.py imports
    Ray); both must give the same vectors."""
    import numpy as np

    from benchmarks.gpu_torch_check import embed_pass, texts
    from deployments.embedder import EmbedderConfig, TextEmbedder

    embedder = TextEmbedder(
        EmbedderConfig.model_validate({"source": {"model": tiny["encoder"], "device": "cpu"}})
    )
    assert embedder.pooling == "mean" and embedder.normalize
    batch = embedder.tokenize(texts(6))
    ours = embed_pass(embedder.model, batch, embedder.pad_id, "cpu").numpy()
    np.testing.assert_allclose(ours, np.stack(embedder.embed_ids(batch)), atol=1e-6)


def test_gpu_check_itself_imports_no_ray_at_module_import() -> None:
    script = (
        f"import sys\nfor name in {BLOCKED!r}:\n    sys.modules[name] = None\n"
        "import benchmarks.gpu_check, benchmarks.gpu_torch_check\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
