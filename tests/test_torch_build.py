"""scripts/torch-build.sh: which torch build set-up installs (CUDA where `nvidia-smi` answers, else CPU,
PFEC_TORCH to choose) and the pip arguments for it. Driven with stand-ins for nvidia-smi and pip on PATH."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "torch-build.sh"


def _stub(folder: Path, name: str, rc: int) -> Path:
    path = folder / name
    path.write_text(f"#!/bin/sh\nexit {rc}\n")
    path.chmod(0o755)
    return path


def _run(tmp_path: Path, *, gpu: bool, local_cpu_wheel: bool, choice: str | None = None,
         ) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    _stub(bin_dir, "nvidia-smi", 0 if gpu else 9)
    pip = _stub(bin_dir, "pip", 0 if local_cpu_wheel else 1)
    env = {k: v for k, v in os.environ.items() if k not in ("PFEC_TORCH", "PFEC_TORCH_INDEX", "PIP_CERT")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", PIP=str(pip))
    if choice is not None:
        env["PFEC_TORCH"] = choice
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=30)


def test_a_gpu_gets_the_cuda_build_from_an_index_that_ignores_local_cpu_wheels(tmp_path: Path) -> None:
    out = _run(tmp_path, gpu=True, local_cpu_wheel=True)
    assert out.returncode == 0, out.stderr
    build, args = out.stdout.splitlines()
    assert build == "cuda"
    assert args.split() == ["--isolated", "--index-url", "https://pypi.org/simple", "torch==2.13.0"]


@pytest.mark.parametrize("local", [True, False])
def test_no_gpu_gets_the_cpu_build_local_wheel_first(tmp_path: Path, local: bool) -> None:
    out = _run(tmp_path, gpu=False, local_cpu_wheel=local)
    assert out.returncode == 0, out.stderr
    build, args = out.stdout.splitlines()
    assert build == "cpu"
    assert args.endswith("torch==2.13.0+cpu")
    assert ("--no-index" in args) == local
    assert ("download.pytorch.org/whl/cpu" in args) == (not local)


@pytest.mark.parametrize(("choice", "gpu", "want"), [("cpu", True, "cpu"), ("cuda", False, "cuda")])
def test_pfec_torch_overrides_the_probe(tmp_path: Path, choice: str, gpu: bool, want: str) -> None:
    out = _run(tmp_path, gpu=gpu, local_cpu_wheel=True, choice=choice)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == want


def test_a_bad_choice_is_refused_by_name(tmp_path: Path) -> None:
    out = _run(tmp_path, gpu=False, local_cpu_wheel=True, choice="rocm")
    assert out.returncode == 2
    assert "PFEC_TORCH=rocm: expected cpu, cuda or auto" in out.stderr
