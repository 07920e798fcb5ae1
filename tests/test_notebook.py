"""The Colab notebook runs top to bottom on CPU (tiny model), through library calls only."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "launch" / "colab" / "kvgraft_tpu.ipynb"


def test_notebook_has_no_logic_of_its_own():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "def " not in code and "class " not in code and "lambda" not in code
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code")  # shipped clean


def test_notebook_executes_on_cpu_with_the_tiny_model(tmp_path, monkeypatch):
    monkeypatch.setenv("KVGRAFT_NOTEBOOK_MODEL", "tiny")
    monkeypatch.setenv("KVGRAFT_NOTEBOOK_DIR", str(tmp_path / "runs"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()  # raises CellExecutionError on any failing cell
    text = "\n".join(
        out.get("text", "") for c in nb.cells if c.cell_type == "code" for out in c.outputs
    )
    assert "cpu 8 devices" in text  # the kernel saw the 8 forced host devices
    assert "intact: True" in text and "BIT-IDENTICAL" in text
    assert "reference: a" in text
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 1
    assert (tmp_path / "runs" / "verify.json").exists()
