"""The notebooks in notebooks/: committed without outputs, and each runs top to bottom.

Each notebook runs under nbclient in a kernel of this interpreter (a kernelspec written to
a temporary directory, so an installed `python3` kernel of another Python is never used),
in a temporary working directory, with its `parameters` cell replaced by test sizes.
"""

import ast
import json
import math
import pathlib
import re
import sys

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "jaxrl-llm-tests"
# Test sizes, by notebook; every notebook's parameters cell must define exactly these names
# (data_dir is added per test module: the task's TFDS files are built once).
PARAMETERS = {
    "quickstart.ipynb": dict(
        steps=2,
        prompts_per_step=8,
        eval_prompts=8,
        eval_every=2,
        eval_samples=2,
        workdir="run",
    ),
    "compose_transforms.ipynb": dict(
        token_fraction=0.5,
        steps=2,
        prompts_per_step=4,
        group_size=5,
        workdir="run",
    ),
    "bring_your_checkpoint.ipynb": dict(
        make_tiny_checkpoint=True,
        checkpoint="tiny_qwen2",
        steps=2,
        prompts_per_step=4,
        group_size=2,
        prompt_len=12,
        max_new_tokens=8,
        eval_prompts=4,
        workdir="run",
        export_dir="exported",
    ),
}


def parameters_cell(nb):
    cells = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, "expected exactly one cell tagged 'parameters'"
    return cells[0]


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("kernels")
    (root / KERNEL).mkdir()
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "jaxrl_llm tests",
        "language": "python",
        "env": {"JAX_PLATFORMS": "cpu"},
    }
    (root / KERNEL / "kernel.json").write_text(json.dumps(spec))
    return root


def execute(name: str, cwd: pathlib.Path, kernel_dir: pathlib.Path, data_dir: str):
    """Runs notebooks/NAME with the test parameters in `cwd`; returns the executed notebook
    and the text it printed (streams and plain-text results)."""
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    params = {**PARAMETERS[name], "data_dir": data_dir}
    parameters_cell(nb).source = "\n".join(f"{k} = {v!r}" for k, v in params.items())
    km = KernelManager(
        kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_dir)])
    )
    try:
        NotebookClient(nb, km=km, timeout=300, resources={"metadata": {"path": str(cwd)}}).execute()
    finally:  # nbclient leaves a kernel it did not create running (about 1 GB each)
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    text = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream" and out.name == "stdout":
                text.append(out.text)
            elif out.output_type in ("execute_result", "display_data"):
                text.append(out.data.get("text/plain", ""))
    return nb, "\n".join(text)


def metrics_by_step(workdir: pathlib.Path) -> dict[int, dict]:
    merged: dict[int, dict] = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        merged.setdefault(record.pop("step"), {}).update(record)
    return merged


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_stripped(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has outputs"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"
    # The test sizes name exactly the notebook's parameters (no stale or missing names).
    tree = ast.parse(parameters_cell(nb).source)
    names = {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets}
    assert names == {*PARAMETERS[path.name], "data_dir"}


def test_every_notebook_is_tested():
    assert {p.name for p in NOTEBOOKS} == set(PARAMETERS)


def test_quickstart(tmp_path, kernel_dir, data_dir):
    nb, text = execute("quickstart.ipynb", tmp_path, kernel_dir, data_dir)
    steps = metrics_by_step(tmp_path / "run")
    assert set(steps) == {0, 1, 2}
    assert "train/loss" in steps[2] and "eval/accuracy" in steps[2]
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 1, "expected one inline figure"
    assert "the policy after 2 steps:" in text
    answers = re.findall(r"^(\d+)\+(\d+)=\s+'(.*)'\s+expected (\d+)$", text, re.M)
    assert len(answers) == 5, text
    for a, b, _, expected in answers:
        assert int(a) + int(b) == int(expected)


def test_compose_transforms(tmp_path, kernel_dir, data_dir):
    _, text = execute("compose_transforms.ipynb", tmp_path, kernel_dir, data_dir)
    assert "pivots per group: [1 1 1]" in text
    assert "members above / below the median per group: [2 2 2] / [2 2 2]" in text
    assert "chain == the three functions" in text
    steps = metrics_by_step(tmp_path / "run")
    assert set(steps) == {1, 2}
    g = PARAMETERS["compose_transforms.ipynb"]["group_size"]
    for step in (1, 2):
        r = steps[step]
        # The median pivot of every group is out of the loss; D3S keeps about half of the
        # remaining tokens.
        assert math.isclose(r["rollouts/kept"], (g - 1) / g, rel_tol=1e-6), r
        assert 0 < r["tokens/kept"] < r["rollouts/kept"], r
        assert "reward/length/mean" in r


def test_bring_your_checkpoint(tmp_path, kernel_dir, data_dir):
    models = pytest.importorskip("jaxrl_llm.models")
    if not hasattr(models, "load_pretrained"):
        pytest.skip("jaxrl_llm.models.load_pretrained is not there yet")
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    _, text = execute("bring_your_checkpoint.ipynb", tmp_path, kernel_dir, data_dir)
    (diff,) = re.findall(r"max \|jax - transformers\| logit: (\S+)", text)
    assert float(diff) < 1e-4, text
    assert set(metrics_by_step(tmp_path / "run")) == {0, 1, 2}
    exported = tmp_path / "exported"
    assert (exported / "config.json").is_file()
    assert list(exported.glob("*.safetensors"))
    assert "reloaded: True" in text
