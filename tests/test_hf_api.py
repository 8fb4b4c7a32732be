"""The public Hugging Face API (``titan_plugins.hf``): load a folder into a plugin's
model on one rank or a given mesh, export a live model; on the GPT-2 example and a
tiny random transformers model saved locally."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from titan_plugins.errors import ConfigError  # noqa: E402
from titan_plugins.hf import export_model, load_hf_model  # noqa: E402

VOCAB = 80


def _gpt2_folder(path):
    from titan_plugins.plugins import get_plugin_manager

    if "gpt2" not in get_plugin_manager().models():
        pytest.skip("the gpt2 example plugin is not installed")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32,
                                  tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ref = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.2)
    ref.save_pretrained(path)
    return ref


def _tokens():
    return torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))


def test_importing_the_api_package_imports_no_torch():
    code = ("import sys, titan_plugins.hf, titan_plugins.hf.config; "
            "assert 'torch' not in sys.modules; from titan_plugins.hf import load_hf_model; "
            "assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_export_writes_tokenizer_files_only_when_a_tokenizer_is_known(tmp_path):
    _gpt2_folder(tmp_path / "hf")
    model = load_hf_model("gpt2", tmp_path / "hf")
    bare = export_model(model, "gpt2", tmp_path / "bare")  # the folder has no tokenizer: none written
    assert not (bare / "tokenizer.json").exists() and not (bare / "tokenizer_config.json").exists()
    assert (bare / "generation_config.json").is_file()

    from titan_plugins.data.tokenizer import DEFAULT_TOKENIZER  # a real tokenizer.json

    with_tok = export_model(model, "gpt2", tmp_path / "tok", tokenizer=DEFAULT_TOKENIZER)
    assert (with_tok / "tokenizer.json").read_bytes() == DEFAULT_TOKENIZER.read_bytes()
    assert json.loads((with_tok / "tokenizer_config.json").read_text())["tokenizer_class"]
    with pytest.raises(ConfigError, match=r"^tokenizer=.*: no tokenizer\.json there"):
        export_model(model, "gpt2", tmp_path / "x", tokenizer=tmp_path / "nothing")


def test_export_of_a_model_built_by_hand_needs_its_config(tmp_path):
    _gpt2_folder(tmp_path / "hf")
    model = load_hf_model("gpt2", tmp_path / "hf")
    bare = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match=r"^export_model: give config= \(an instance of GPT2Config\)"):
        export_model(bare, "gpt2", tmp_path / "out")
    # a model with its config attribute needs nothing else (no source folder: config_to_hf alone)
    out = export_model(model, "gpt2", tmp_path / "out", source=None)
    assert json.loads((out / "config.json").read_text())["n_layer"] == 2


def test_bad_input_is_one_line(tmp_path):
    from titan_plugins.distributed.parallel_dims import ParallelDims

    with pytest.raises(ConfigError, match=r"^model\.hf=.*: no such folder"):
        load_hf_model("gpt2", tmp_path / "missing")
    _gpt2_folder(tmp_path / "hf")
    with pytest.raises(ConfigError, match=r"^parallelism: pp=2: load_hf_model returns one module"):
        load_hf_model("gpt2", tmp_path / "hf", parallelism=ParallelDims(1, 1, 1, 2, 1, 1, 2))
    with pytest.raises(ConfigError, match=r"^parallelism: its meshes are not built"):
        load_hf_model("gpt2", tmp_path / "hf", parallelism=ParallelDims(1, 2, 1, 1, 1, 1, 2))
    with pytest.raises(ConfigError, match=r"overrides='model.n_layers=1': give a list"):
        load_hf_model("gpt2", tmp_path / "hf", overrides="model.n_layers=1")


def _tp_rank(rank: int, world: int, folder: str, out: str) -> dict:
    """Every rank: the model under tp=2 from the folder (DTensors, each rank reading its
    slices), its logits, then export_model (rank 0 writes)."""
    from torch.distributed.tensor import DTensor

    from titan_plugins.config.schema import ParallelismConfig
    from titan_plugins.distributed.parallel_dims import ParallelDims

    dims = ParallelDims.from_config(ParallelismConfig(tp=2), world)
    dims.build_meshes("cpu")
    model = load_hf_model("gpt2", folder, parallelism=dims)
    sharded = [k for k, v in model.state_dict().items() if isinstance(v, DTensor)]
    with torch.no_grad():
        logits = model(_tokens())
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    written = export_model(model, "gpt2", out)
    return {"logits": logits.tolist(), "sharded": len(sharded), "written": str(written)}


@pytest.mark.slow
def test_tp_mesh_load_and_export_equal_one_rank(tmp_path):
    from titan_plugins.testing.gloo import run_ranks

    ref = _gpt2_folder(tmp_path / "hf")
    results = run_ranks(_tp_rank, 2, str(tmp_path / "hf"), str(tmp_path / "out"), timeout=300)
    with torch.no_grad():
        want = ref(_tokens()).logits
    for got in results:
        assert got["sharded"] > 0 and got["written"] == str((tmp_path / "out").resolve())
        assert (torch.tensor(got["logits"]) - want).abs().max().item() <= 1e-5
    again = load_hf_model("gpt2", tmp_path / "out")  # the TP export is the model
    with torch.no_grad():
        assert (again(_tokens()) - want).abs().max().item() <= 1e-5
