"""The conformance kit fails a deliberately broken plugin with the message for the
contract it breaks (and says how to fix it).

Each broken plugin is the scaffold (``titan-plugins new``) with one mistake an
author could make, registered as an extra plugin module without installing it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan_plugins.cli.scaffold import scaffold
from titan_plugins.testing.conformance import (
    ContractError,
    Session,
    Target,
    check_loss_parity,
    check_parallelize,
    check_plugin_import,
    check_state_dict,
)


def _broken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, file: str, old: str, new: str) -> Target:
    root, _ = scaffold(name, tmp_path / name)
    path = root / f"titan_{name}" / file
    text = path.read_text()
    assert old in text, f"the scaffold changed: {old!r} not in {file}"
    path.write_text(text.replace(old, new, 1))
    monkeypatch.syspath_prepend(str(root))
    return Target(name, overrides=("model.n_layers=2",), plugins=(f"titan_{name}.plugin",))


def test_persistent_rope_cache_fails_state_dict(tmp_path, monkeypatch):
    target = _broken(tmp_path, monkeypatch, "kitrope", "model.py", "persistent=False", "persistent=True")
    with pytest.raises(ContractError) as info:
        check_state_dict(target)
    message = str(info.value)
    assert message.startswith("state-dict: buffer 'rope_cache' is saved in state_dict()")
    assert "Fix: register it with self.register_buffer('rope_cache', ..., persistent=False)" in message


def test_plugin_importing_torch_fails_plugin_import(tmp_path, monkeypatch):
    target = _broken(tmp_path, monkeypatch, "kittorch", "plugin.py", "from titan_plugins import",
                     "import torch  # noqa: F401\nfrom titan_plugins import")
    with pytest.raises(ContractError) as info:
        check_plugin_import(target)
    message = str(info.value)
    assert message.startswith("plugin-import: importing titan_kittorch.plugin imported torch")
    assert "plugin.py:8 `import torch" in message  # where it happened
    assert "Fix: keep titan_kittorch.plugin" in message


# The scaffold's apply_decoder_tp, spelled out with tok_embeddings parallelized even where
# the stage does not own it (None on a later pipeline stage).
_TOK_EMBEDDINGS_ALWAYS = """    from torch.distributed.tensor.parallel import parallelize_module

    sp = sequence_parallel
    plan = tpp.root_plan(sequence_parallel=sp, loss_parallel=loss_parallel)
    parallelize_module(model, tp_mesh, {"tok_embeddings": plan.pop("tok_embeddings")})
    tpp.apply_tp_plan(model, tp_mesh, plan)
    for block in tpp.owned_blocks(model.layers):
        tpp.apply_tp_plan(block, tp_mesh, _block_plan(block, sp))
    tpp.apply_tp_plan(model, tp_mesh, tpp.stage_boundary_plan(model, sequence_parallel=sp))"""


def test_tp_plan_touching_tok_embeddings_on_a_later_stage_fails_parallelize_pp(tmp_path, monkeypatch):
    target = _broken(
        tmp_path, monkeypatch, "kittp", "parallelize.py",
        "    tpp.apply_decoder_tp(model, tp_mesh, _block_plan, sequence_parallel=sequence_parallel, "
        "loss_parallel=loss_parallel)",
        _TOK_EMBEDDINGS_ALWAYS,
    )
    session = Session.open(target)  # both kinds in one fake-process-group subprocess
    # Without a pipeline the plan is fine ...
    assert check_parallelize(session, "tp") is None
    # ... on stage 1 of 2 tok_embeddings is None, and the plan still names it.
    with pytest.raises(ContractError) as info:
        check_parallelize(session, "pp")
    message = str(info.value)
    assert message.startswith("parallelize-pp: the TP plan names 'tok_embeddings', which matches no module")
    assert "stage 1 of 2 (where tok_embeddings is None)" in message
    assert "Fix: the hook runs once per pipeline stage" in message


def test_a_broken_contract_reads_as_one_line_in_pytest(tmp_path):
    """Through the pytest plugin: the contract and the fix, no traceback."""
    root, _ = scaffold("kitline", tmp_path / "kitline")
    model = root / "titan_kitline" / "model.py"
    model.write_text(model.read_text().replace("persistent=False", "persistent=True"))
    test_file = root / "tests" / "test_kitline.py"
    line = '    overrides = ["model.n_layers=2"]\n'
    assert line in test_file.read_text(), "the scaffold's test changed"
    test_file.write_text(test_file.read_text().replace(line, line + '    plugins = ["titan_kitline.plugin"]\n'))
    # A check called as a plain function: the kit's pytest plugin shortens the report.
    (root / "tests" / "test_raw.py").write_text(
        "from titan_plugins.testing import ContractError\n\n\n"
        "def test_raw():\n"
        "    raise ContractError('meta-build', 'a made-up problem', 'a made-up fix')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file), str(root / "tests" / "test_raw.py"),
         "-k", "state_dict or schema or raw"],
        capture_output=True, text=True, cwd=root, env=env, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "2 failed, 1 passed" in out, out
    assert "state-dict: buffer 'rope_cache' is saved in state_dict()" in out, out
    assert "Fix: register it with self.register_buffer" in out, out
    assert "meta-build: a made-up problem. Fix: a made-up fix." in out, out
    assert "Traceback" not in out and "conformance.py" not in out and "raise ContractError" not in out, out


def test_stage_inputs_naming_no_model_method_fails_pipeline_split(tmp_path, monkeypatch):
    from titan_plugins.testing.conformance import check_pipeline_split

    target = _broken(tmp_path, monkeypatch, "kitstage", "plugin.py",
                     'last_stage_modules=("norm", "output"),',
                     'last_stage_modules=("norm", "output"), stage_inputs="doc_ids_for",')
    with pytest.raises(ContractError) as info:
        check_pipeline_split(target)
    message = str(info.value)
    assert message.startswith("pipeline-split: PipelineInfo.stage_inputs='doc_ids_for' is not a method of the model")
    assert "Fix: define it as (tokens) -> dict[str, Tensor]" in message


@pytest.mark.slow
def test_cp_declared_by_a_model_whose_attention_sees_only_its_rows_fails_loss_parity(tmp_path, monkeypatch):
    # The scaffold's attention is its own SDPA over the rows a rank holds, its rotary table
    # indexed from 0: under cp=2 each rank attends within its half at the wrong positions.
    target = _broken(tmp_path, monkeypatch, "kitcp", "plugin.py", "Capabilities(fsdp=True, tp=True, pp=True)",
                     "Capabilities(fsdp=True, tp=True, pp=True, cp=True)")
    with pytest.raises(ContractError) as info:
        check_loss_parity(target, "cp", run_dir=tmp_path / "runs")
    message = str(info.value)
    # (step 1 may still agree: at initialisation the logits hardly depend on attention)
    assert message.startswith("loss-parity: step ") and " under cp (2 ranks) vs " in message, message
    assert "\n" not in message.split("Fix:")[0].strip()
    assert "cp_attention.rope_rows" in message
