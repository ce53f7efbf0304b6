"""Slow: notebooks/quickstart.ipynb runs top to bottom in a python3 kernel (run with `pytest -m slow`).

The notebook's first code cell (tagged `parameters`) sets WORKDIR, STEPS and OVERRIDES; as papermill does, a cell
inserted after it sets them again: a workdir under tmp_path, a few steps and a smaller corpus, so the run takes
about a minute instead of the notebook's four. Needs nbclient, nbformat, ipykernel and matplotlib (skipped without).
"""

import base64
import json
import os
import re

import pytest
from tiny import rescored_bleu

NOTEBOOK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks", "quickstart.ipynb")
# The default model on a smaller corpus, decoding short outputs: its translations are poor (BLEU ~0), but every
# cell runs and prints what the notebook's reader sees.
STEPS = 60
OVERRIDES = {"data.builtin_train_size": 10_000, "data.builtin_valid_size": 64, "data.builtin_test_size": 64,
             "optimizer.warmup_steps": 30, "train.eval_every_steps": 30, "train.checkpoint_every_steps": 30,
             "decode.max_extra_length": 10}


def notebook_modules():
    for name in ("nbformat", "nbclient", "ipykernel", "matplotlib"):
        pytest.importorskip(name)
    import nbclient
    import nbformat
    return nbformat, nbclient


def cell(notebook, cell_id):
    [found] = [c for c in notebook.cells if c.get("id") == cell_id]
    return found


def stream_text(code_cell, name="stdout") -> str:
    return "".join(o.text for o in code_cell.outputs if o.output_type == "stream" and o.name == name)


@pytest.mark.slow
def test_the_committed_notebook_has_no_outputs_and_a_parameters_cell_first():
    nbformat, _ = notebook_modules()
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "clear the notebook's outputs"
    first = code[0]
    assert "parameters" in first.metadata.get("tags", [])
    for name in ("WORKDIR", "STEPS", "OVERRIDES"):
        assert re.search(rf"^{name} = ", first.source, re.M), name


@pytest.mark.slow
def test_the_quickstart_notebook_trains_scores_translates_and_draws_attention(tmp_path):
    nbformat, nbclient = notebook_modules()
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    index = next(i for i, c in enumerate(notebook.cells) if "parameters" in c.metadata.get("tags", []))
    workdir = str(tmp_path / "quickstart")
    injected = f"WORKDIR = {workdir!r}\nSTEPS = {STEPS}\nOVERRIDES = {OVERRIDES!r}"
    notebook.cells.insert(index + 1, nbformat.v4.new_code_cell(injected, metadata={"tags": ["injected-parameters"]}))
    client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=900,
                                     resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
    client.execute()  # a cell that raises fails the test here (nbclient's CellExecutionError, with its traceback)
    assert not [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]

    scores = dict(re.findall(r"^(\w+) BLEU (\d+\.\d+)  nrefs:", stream_text(cell(notebook, "scores")), re.M))
    assert set(scores) == {"valid", "test"}, stream_text(cell(notebook, "scores"))
    with open(os.path.join(workdir, "scores.json"), encoding="utf-8") as handle:
        recorded = json.load(handle)["bleu"]  # what the run wrote: the cell printed it, of the translations written
    assert scores == {split: f"{score['bleu']:.2f}" for split, score in recorded.items()}, scores
    for split, score in recorded.items():
        rescored = rescored_bleu(workdir, os.path.join(workdir, f"translations_{split}_step{STEPS}.txt"), split)
        assert {key: score[key] for key in rescored} == pytest.approx(rescored), split

    lines = stream_text(cell(notebook, "translate")).splitlines()
    assert lines
    for line in lines:
        source, translation = line.split(" -> ")
        assert source.strip() and translation.strip(), line

    images = [o.data["image/png"] for o in cell(notebook, "attention").outputs
              if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert len(images) == 1 and base64.b64decode(images[0])[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.path.isfile(os.path.join(workdir, "attention", "cross_attention.png"))
    assert os.path.isfile(os.path.join(workdir, "scores.json"))
