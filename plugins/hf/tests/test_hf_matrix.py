"""The compatibility matrix (``titan-hf-matrix``, issue 46.6): a sample of
``model_type``s equal to transformers on one rank and on the multi-rank layouts
(``make test``), the table and its summary from the command, and the whole matrix
(``make test-all``): every type equal, refused in one line, or stopped by
``model.verify``; none trains silently wrong, on one rank or on a layout."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from titan_hf.matrix import main  # noqa: E402
from titan_hf.matrix_runs import EQUAL_LOSS, one_rank  # noqa: E402

# per-expert checkpoint layout (OLMoE), logit_scale after the head (Cohere), soft-capping
# and sliding + full layers (Gemma 2), a plain dense model (Qwen2)
SAMPLE = ["qwen2", "olmoe", "cohere", "gemma2"]


@pytest.mark.parametrize("model_type", SAMPLE)
def test_sample_equals_transformers(tmp_path, model_type):
    row = one_rank(model_type, tmp_path)
    assert row["status"] == "equal", row
    assert row["builds"] is True and row["diff"] <= EQUAL_LOSS, row
    assert row["checks"] == {"generation": "equal", "export": "equal", "lora": "equal"}, row


@pytest.mark.parametrize("model_type, want", [
    ("minicpm3", "equal"),  # work on the hidden states before the head (logits_scaling)
    ("olmo", "equal"),  # a final norm without weights
    ("youtu", "equal"),  # sliding_window in its config, full masks in its forward
    ("beam", "refused: build: model=hf: BeamModel.forward hands its decoder layers attention_scaling"),
])
def test_what_the_forward_does_is_found(tmp_path, model_type, want):
    row = one_rank(model_type, tmp_path)
    assert f"{row['status']}: {row['reason']}".startswith(want), row


def test_tiny_folder_sets_the_scales_it_finds(tmp_path):
    """Scales left at 1.0 / None get values that change the loss; dropout is off; the
    per-expert layout is what the folder holds on disk."""
    from safetensors import safe_open
    from titan_hf.matrix_folders import tiny_folder

    granite = json.loads((tiny_folder("granite", tmp_path / "granite") / "config.json").read_text())
    assert granite["embedding_multiplier"] != 1.0 and granite["logits_scaling"] != 1.0
    assert granite["num_hidden_layers"] == 2 and granite["vocab_size"] == 256
    gemma = json.loads((tiny_folder("gemma2", tmp_path / "gemma2") / "config.json").read_text())
    assert gemma["final_logit_softcapping"] == 5.0 and gemma["attention_dropout"] == 0.0
    assert sorted(set(gemma["layer_types"])) == ["full_attention", "sliding_attention"]
    with safe_open(tiny_folder("olmoe", tmp_path / "olmoe") / "model.safetensors", "pt") as f:
        assert any(".experts.3." in k for k in f.keys())  # noqa: SIM118 - safe_open has no __iter__


def test_tiny_folder_turns_training_noise_off():
    """PhiMoE samples its experts in training (within transformers' default
    router_jitter_noise 0.01 of the best one): each layout would draw other numbers than
    one rank (fsdp2 differed by 2.5e-02). The tiny folder sets it to 0; the row says so."""
    from titan_hf.matrix import _noise_note, render
    from titan_hf.matrix_folders import tiny_config, zeroed_noise

    assert tiny_config("phimoe").router_jitter_noise == 0.0
    assert zeroed_noise("phimoe") == ["router_jitter_noise"] and zeroed_noise("mixtral") == []
    row = {"type": "phimoe", "class": "PhimoeForCausalLM", "builds": True, "status": "equal", "reason": "",
           "diff": 0.0}
    row.update(_noise_note("phimoe", row))
    assert row["noise_zeroed"] == ["router_jitter_noise"]
    assert _noise_note("phimoe", {**row, "status": "untested"}) == {}
    text = render({"phimoe": row}, [], "titan-hf-matrix --types phimoe")
    assert "| phimoe | PhimoeForCausalLM | yes | equal (router_jitter_noise=0: training-time noise off) |" in text


def test_command_writes_the_table(tmp_path, capsys):
    out = tmp_path / "matrix.md"
    assert main(["--types", "qwen2,t5", "--layouts", "none", "--out", str(out), "--work", str(tmp_path / "work"),
                 "--json", str(tmp_path / "rows.json")]) == 0
    text = out.read_text()
    assert "transformers 5." in text and "    titan-hf-matrix --types qwen2,t5 --layouts none --out " in text
    assert "--json" not in text
    assert "| qwen2 | Qwen2ForCausalLM | yes | equal | 0.0e+00 | equal | equal | equal |" in text
    assert "| t5 |  |  | refused: config.json: model_type='t5': " in text
    said = capsys.readouterr().out
    assert "2 types: 1 equal, 1 refused, 0 differ" in said
    assert "  export: 1 equal, 0 refused, 0 differ, 0 error" in said
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert rows["t5"]["status"] == "refused" and "\n" not in rows["t5"]["reason"]


@pytest.mark.slow
@pytest.mark.extended
def test_whole_matrix_nothing_silently_wrong(tmp_path):
    """Every causal-LM type of the installed transformers: equal, refused in one line,
    or (differing) stopped by model.verify before launch."""
    assert main(["--out", str(tmp_path / "matrix.md"), "--work", str(tmp_path / "work"), "--jobs", "2",
                 "--json", str(tmp_path / "rows.json")]) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())
    silent = [f"{t}: {r['reason']}" for t, r in rows.items() if r["status"] == "differ" and not r["verify_stops"]]
    assert not silent, silent
    assert all("\n" not in r["reason"] for r in rows.values())
    equal = [t for t, r in rows.items() if r["status"] == "equal"]
    assert len(equal) >= 80, len(equal)  # 85 with transformers 5.25 (docs/hf-matrix.md)
    wrong = [f"{t} {x}: {c}" for t in equal for x, c in rows[t]["layouts"].items() if c.startswith("differ")]
    assert not wrong, wrong


@pytest.mark.slow
def test_layout_cells_sample(tmp_path):
    """The multi-rank columns on a sample, the 2-rank jobs of both types in one launch:
    Llama (dense, untied) equal on fsdp2 and pp2, ep2 n/a; OLMoE (per-expert folder,
    transformers' expert-parallel plan) equal on fsdp2, pp2 and ep2."""
    from titan_hf.matrix_folders import tiny_folder
    from titan_hf.matrix_layouts import layout_cells

    folders = {t: tiny_folder(t, tmp_path / t) for t in ("llama", "olmoe")}
    cells = layout_cells(folders, ["fsdp2", "pp2", "ep2"], tmp_path / "runs")
    assert cells == {"llama": {"fsdp2": "equal", "pp2": "equal", "ep2": "n/a"},
                     "olmoe": {"fsdp2": "equal", "pp2": "equal", "ep2": "equal"}}, cells


@pytest.mark.slow
@pytest.mark.extended
def test_layout_cells_of_a_model_that_samples_in_training(tmp_path):
    """PhiMoE's tiny folder (training-time noise off) equals one rank on fsdp2."""
    from titan_hf.matrix_folders import tiny_folder
    from titan_hf.matrix_layouts import layout_cells

    cells = layout_cells({"phimoe": tiny_folder("phimoe", tmp_path / "phimoe")}, ["fsdp2"], tmp_path / "runs")
    assert cells == {"phimoe": {"fsdp2": "equal"}}, cells


def test_layout_refusals_are_cells(tmp_path):
    """Before any rank starts: a layout that does not apply is ``n/a`` (tied embeddings on
    pp2, no experts on ep2), one validate refuses is its one line."""
    from titan_hf.matrix_folders import tiny_folder
    from titan_hf.matrix_layouts import COMMON, LAYOUTS, _compose, _refusal

    folder = tiny_folder("gemma", tmp_path / "gemma")  # tied embeddings
    argv = [*COMMON, f"model.hf={folder}", "parallelism=single"]
    for layout, want in (("pp2", "n/a"), ("ep2", "n/a")):
        with pytest.raises(Exception) as exc:
            _compose([*argv[:-1], *LAYOUTS[layout][1]], tmp_path / layout)
        assert _refusal(layout, exc.value) == want, exc.value
    from titan_plugins.errors import ConfigError

    assert _refusal("fsdp2", ConfigError("parallelism.tp=2: x")) == "refused: parallelism.tp=2: x"


@pytest.mark.slow
def test_launch_records_a_failing_job_and_runs_the_rest(tmp_path, monkeypatch):
    """A job that fails inside a rank is its own ``error:`` cell; the jobs after it still
    train (a fresh launch), so one bad type costs its own cells only."""
    import shutil

    from titan_hf.matrix_folders import tiny_folder
    from titan_hf.matrix_layouts import COMMON, _compose
    from titan_hf.matrix_runs import launch_jobs

    folder = tiny_folder("llama", tmp_path / "llama")
    broken = shutil.copytree(folder, tmp_path / "broken")
    bad = _compose([*COMMON, f"model.hf={broken}", "parallelism=single"], tmp_path / "bad")
    good = _compose([*COMMON, f"model.hf={folder}", "parallelism=single"], tmp_path / "good")
    (broken / "model.safetensors").unlink()  # after composing: it fails inside the rank
    out = launch_jobs(tmp_path / "runs", world=1, alone={"bad": bad, "good": good}, timeout=120)
    assert out["bad"].startswith("error: ") and "\n" not in out["bad"], out
    assert isinstance(out["good"], list) and len(out["good"]) == 3, out


@pytest.mark.slow
@pytest.mark.extended
def test_layouts_column(tmp_path):
    """The command with every layout (default): Llama equal on all but ep2 (n/a), OLMoE's
    TP plan leaving its MoE block out (no SP); the per-layout counts in the table."""
    out = tmp_path / "matrix.md"
    assert main(["--types", "llama,olmoe,t5", "--out", str(out), "--work", str(tmp_path / "work"),
                 "--json", str(tmp_path / "rows.json")]) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert rows["llama"]["layouts"] == {"fsdp2": "equal", "fsdp2_tp2": "equal", "pp2": "equal", "ep2": "n/a",
                                        "cp2": "equal"}, rows["llama"]
    assert rows["olmoe"]["layouts"] == {"fsdp2": "equal", "fsdp2_tp2": "equal (no SP)", "pp2": "equal",
                                        "ep2": "equal", "cp2": "equal"}, rows["olmoe"]
    assert "layouts" not in rows["t5"]
    text = out.read_text()
    assert "- ep2: 1 equal, 0 refused, 1 n/a, 0 differ, 0 error" in text
    assert ("| llama | LlamaForCausalLM | yes | equal | 0.0e+00 | equal | equal | equal | equal | equal | equal | n/a "
            "| equal |") in text


# ------------------------------------------------ export, LoRA and generation (matrix_checks)
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """Llama's tiny folder and our model of it (``load_hf_model``, as a matrix row loads it)."""
    from titan_hf.matrix_folders import tiny_folder

    from titan_plugins.hf import load_hf_model

    folder = tiny_folder("llama", tmp_path_factory.mktemp("checks") / "llama")
    return folder, load_hf_model("hf", folder, overrides=["data=synthetic", "data.vocab_size=256"])


def test_equal_row_records_export_lora_and_generation(tmp_path):
    """Llama equal on one rank: its full export (weights moved) loads strictly in
    transformers with our loss, its LoRA adapter loads in peft and its merged folder in
    transformers with our LoRA loss, and greedy decoding gives transformers' tokens."""
    from titan_hf.matrix import CHECKS
    from titan_hf.matrix_checks import CHECKS as RUN

    row = one_rank("llama", tmp_path)
    assert row["status"] == "equal", row
    assert row["checks"] == {"export": "equal", "lora": "equal", "generation": "equal"}, row
    assert CHECKS == RUN
    assert (tmp_path / "checks" / "llama" / "lora" / "hf-adapter" / "adapter_config.json").is_file()


def test_an_export_of_the_source_weights_differs(llama, tmp_path, monkeypatch):
    """An export that writes the folder it read (not our moved weights) is ``differ`` with
    both losses; our model gets its own weights back after the check."""
    import shutil

    from titan_hf.matrix_checks import _loss, export_check

    import titan_plugins.hf as hf

    folder, ours = llama
    before = _loss(ours)
    monkeypatch.setattr(hf, "export_model", lambda model, name, out: shutil.copytree(folder, out))
    cell = export_check(ours, folder, tmp_path / "export")
    assert cell.startswith("differ: transformers' loss ") and " vs ours " in cell, cell
    assert _loss(ours) == before


def test_a_failing_check_is_its_own_cell(llama, tmp_path, monkeypatch):
    """An export that raises is that cell's one line (``refused`` for a ConfigError,
    ``error`` else); the other checks still run."""
    from titan_hf.matrix_checks import _cell_of, export_check, run_checks

    import titan_plugins.hf as hf
    from titan_plugins.errors import ConfigError

    folder, ours = llama

    def broken(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(hf, "export_model", broken)
    cells = run_checks(ours, folder, tmp_path)
    assert cells.pop("export").startswith("error: RuntimeError: boom second line (at tests/test_hf_matrix.py:")
    assert cells == {"generation": "equal", "lora": "equal"}

    def refusing(*args, **kwargs):
        raise ConfigError("out=x: no")

    monkeypatch.setattr(hf, "export_model", refusing)
    assert _cell_of(export_check, ours, folder, tmp_path / "e") == "refused: out=x: no"


def test_lora_without_an_adapter_layout_is_refused(llama, tmp_path, monkeypatch):
    """Adapters the PEFT format has no layout for (experts fused in the folder): the run's
    export writes the merged folder alone (still checked) and the cell is its one line."""
    from titan_hf.matrix_checks import lora_check

    import titan_plugins.export.lora as lora
    from titan_plugins.errors import ConfigError

    def no_layout(*args, **kwargs):
        raise ConfigError("peft: grouped experts x have no per-expert linears: export with --merge")

    monkeypatch.setattr(lora, "check_expert_layout", no_layout)
    folder, _ = llama
    cell = lora_check(folder, tmp_path / "lora")
    assert cell == "refused: peft: grouped experts x have no per-expert linears: export with --merge", cell
    assert (tmp_path / "lora" / "hf" / "config.json").is_file() and not (tmp_path / "lora" / "hf-adapter").exists()


def test_a_kv_cache_that_forgets_its_position_differs(llama, monkeypatch):
    """Decoding whose cache never advances (every new token at rotary position 0) is
    ``differ`` at the first token decoded from the cache."""
    from titan_hf.matrix_checks import generation_check

    from titan_plugins.components.kv_cache import KVCache

    folder, ours = llama
    assert generation_check(ours, folder) == "equal"
    monkeypatch.setattr(KVCache, "advance", lambda self, n: None)
    cell = generation_check(ours, folder)
    assert cell.startswith("differ: first at token 1 ("), cell  # token 0: the prompt's own pass


def test_check_columns_and_resume(tmp_path, monkeypatch, capsys):
    """The three columns and their counts in the table and the summary; ``--resume`` of a
    row written before them runs its type again (keeping its layout cells), not blank."""
    import titan_hf.matrix as matrix

    old = {"qwen2": {"type": "qwen2", "class": "Qwen2ForCausalLM", "builds": True, "status": "equal", "reason": "",
                     "diff": 0.0, "layouts": {"fsdp2": "equal"}},
           "t5": {"type": "t5", "class": "", "builds": None, "status": "refused", "reason": "no"}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    asked = []

    def run_types(types, work, **kwargs):
        asked.extend(types)
        return {t: {**old[t], "layouts": {}, "checks": {"export": "equal", "lora": "refused: no layout",
                                                        "generation": "differ: first at token 2 (5 vs 7)"}}
                for t in types}

    monkeypatch.setattr(matrix, "run_types", run_types)
    monkeypatch.setattr(matrix, "_layout_chunk", lambda *a, **k: None)
    out = tmp_path / "m.md"
    assert main(["--types", "qwen2,t5", "--layouts", "fsdp2", "--resume", str(tmp_path / "old.json"),
                 "--out", str(out), "--json", str(tmp_path / "new.json")]) == 0
    assert asked == ["qwen2"]
    rows = json.loads((tmp_path / "new.json").read_text())
    assert rows["qwen2"]["layouts"] == {"fsdp2": "equal"} and rows["qwen2"]["checks"]["export"] == "equal"
    text = out.read_text()
    assert "| model_type | class | builds | one rank | loss diff | export | lora | generation | fsdp2 |" in text
    assert ("| qwen2 | Qwen2ForCausalLM | yes | equal | 0.0e+00 | equal | refused: no layout | differ: first at "
            "token 2 (5 vs 7) | equal |") in text
    assert "| t5 |  |  | refused: no |  |  |  |  |  |" in text
    assert "- lora: 0 equal, 1 refused, 0 differ, 0 error" in text and "Not yet recorded" not in text
    said = capsys.readouterr().out
    assert "  generation: 0 equal, 0 refused, 1 differ, 0 error" in said
    assert "  generation: qwen2: differ: first at token 2 (5 vs 7)" in said
    text = matrix.render({"qwen2": old["qwen2"]}, [], "c")
    assert "| qwen2 | Qwen2ForCausalLM | yes | equal | 0.0e+00 | not run | not run | not run |" in text
    assert "**No export, LoRA or generation cells for 1 equal types** (qwen2" in text


@pytest.mark.parametrize("model_type", ["param2moe", "laguna"])
def test_lora_adapter_of_a_folder_whose_modules_load_renamed(tmp_path, model_type):
    """Folders whose checkpoint names are not the loaded model's: Param2MoE stores
    ``attention.query_key_value`` that transformers 5 loads as ``self_attn.qkv_proj``
    (peft adapts the loaded modules: named on disk, its adapters were dropped and peft's
    loss was 1.2e-1 off ours); Laguna loads ``shared_expert`` as ``shared_experts`` and
    peft renames a file's keys through the checkpoint conversion, so its keys must keep
    the checkpoint's name (5.4e-2 off). Both equal now: peft's model of the exported
    adapter gives the run's loss."""
    from titan_hf.matrix_checks import lora_check
    from titan_hf.matrix_folders import tiny_folder
    from titan_hf.testing import reference_model

    folder = tiny_folder(model_type, tmp_path / "folder")
    assert lora_check(folder, tmp_path / "lora") == "equal"
    config = json.loads((tmp_path / "lora" / "hf-adapter" / "adapter_config.json").read_text())
    loaded = {n for n, _ in reference_model(folder).named_modules()}
    assert set(config["target_modules"]) <= loaded  # the loaded model's names, every one
