"""The wheel: it carries the tokenizer, the base policy and the configs, and the quickstart
runs from a fresh virtual environment outside the checkout (`--config quickstart`).

The wheel is built from a copy of the package sources (pyproject.toml, README.md,
jaxrl_llm/), so no build/ or egg-info directory lands in the checkout; the environment
installs it with the pinned dependencies of constraints.txt from the package index.
"""

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from jaxrl_llm import configs

ROOT = pathlib.Path(__file__).resolve().parents[1]
ASSETS = ("jaxrl_llm/assets/base_arithmetic.safetensors", "jaxrl_llm/assets/tokenizer.model")
# The quickstart at test size: the shipped model and base policy, a smaller batch and eval.
SHRUNK = (
    "--config.train.steps=2",
    "--config.rl.prompts_per_step=8",
    "--config.data.eval_prompts=8",
    "--config.train.eval_every=2",
    "--config.train.eval_samples=2",
    "--config.train.pass_k=2",
    "--config.train.checkpoint_every=0",
    "--config.train.progress=False",
)


def _tools_missing() -> str | None:
    for module in ("build", "venv", "ensurepip"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not available to {sys.executable}"
    return None


pytestmark = pytest.mark.skipif(_tools_missing() is not None, reason=str(_tools_missing()))


def _run(args, *, timeout: int, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw)
    assert proc.returncode == 0, f"{args}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "jaxrl_llm", src / "jaxrl_llm", ignore=shutil.ignore_patterns("__pycache__")
    )
    out = tmp_path_factory.mktemp("dist")
    _run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", out, src],
        timeout=300,
    )
    (whl,) = out.glob("jaxrl_llm-*.whl")
    return whl


def test_wheel_has_assets_and_configs(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for asset in ASSETS:
        assert asset in names, f"{asset} is not in {wheel.name}"
    assert "jaxrl_llm/configs/__init__.py" in names
    for name in configs.NAMES:
        assert f"jaxrl_llm/configs/{name}.py" in names, f"config {name} is not in {wheel.name}"
    assert not [n for n in names if n.startswith(("tests/", "configs/", "benchmarks/"))]


def test_installed_quickstart_runs_outside_checkout(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", env_dir], timeout=300)
    python = env_dir / "bin" / "python"
    _run(
        [python, "-m", "pip", "install", "-q", wheel, "-c", ROOT / "constraints.txt"],
        timeout=600,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["JAX_PLATFORMS"] = "cpu"
    where = _run(
        [
            python,
            "-c",
            "import jaxrl_llm; from jaxrl_llm.configs import quickstart; quickstart.get_config();"
            " print(jaxrl_llm.__file__)",
        ],
        cwd=elsewhere,
        env=env,
        timeout=120,
    )
    assert pathlib.Path(where.stdout.strip()).is_relative_to(env_dir), where.stdout

    workdir = elsewhere / "run"
    proc = _run(
        [
            python,
            "-m",
            "jaxrl_llm.train",
            "--config",
            "quickstart",
            f"--workdir={workdir}",
            f"--config.data.data_dir={tmp_path / 'tfds'}",
            *SHRUNK,
        ],
        cwd=elsewhere,
        env=env,
        timeout=600,
    )
    final = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 0.0 <= final["eval/accuracy"] <= 1.0, final
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"] for r in records}
    assert steps == {0, 1, 2}, steps
    last = {k: v for r in records if r["step"] == 2 for k, v in r.items()}
    for key in ("train/loss", "reward/correct/mean", "eval/accuracy"):
        assert key in last, sorted(last)
    # The base policy was loaded: a random init never answers 1-2 digit additions.
    assert max(r.get("eval/accuracy", 0.0) for r in records) > 0, records
    assert (workdir / "checkpoints" / "2").is_dir()
