"""BOS/EOS/pad as transformers applies them (issue 35.1): the ids a released folder's
tokenizer gives and adds, on five layouts, equal ``AutoTokenizer``'s on the same files."""

from __future__ import annotations

import json
import warnings

import pytest
from token_layouts import LAYOUTS, make_layout

from titan_plugins.data.tokenizer import Tokenizer

TEXT = "Hello world, the capital of France is Paris."


def _auto(folder):
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_ids_and_what_a_text_gets_equal_transformers(tmp_path, layout) -> None:
    folder = make_layout(tmp_path, layout)
    ours, hf = Tokenizer.load(folder), _auto(folder)
    # what a text (and so a packed document's start, a prompt) gets
    assert ours.encode_text(TEXT) == hf(TEXT).input_ids
    expect = LAYOUTS[layout]["expect"]
    assert [ours.tok.id_to_token(i) for i in ours.prefix] == expect["adds"]
    assert ours.bos_id == (hf.bos_token_id if expect["adds"] else -1)
    assert ours.bos_token_id == (-1 if hf.bos_token_id is None else hf.bos_token_id)
    assert ours.eos_id == hf.eos_token_id
    assert ours.stated_pad_id == (-1 if hf.pad_token_id is None else hf.pad_token_id)
    for kind in ("bos", "eos", "pad"):
        want = expect[kind]
        got = getattr(ours, f"{kind}_token_id" if kind == "bos" else "stated_pad_id" if kind == "pad"
                      else "eos_id")
        assert got == (ours.tok.token_to_id(want) if want else -1), kind


def test_qwen3_config_bos_is_not_used_when_the_tokenizer_has_none(tmp_path) -> None:
    folder = make_layout(tmp_path, "qwen3")
    assert json.loads((folder / "config.json").read_text())["bos_token_id"] is not None
    tok = Tokenizer.load(folder)
    assert tok.bos_id == -1 and tok.prefix == ()  # documents and prompts start with the text


def test_add_bos_token_without_a_post_processor_adds_nothing_as_transformers_5(tmp_path) -> None:
    # transformers 5 pops add_bos_token/add_eos_token when tokenizer.json exists: the
    # post-processor alone decides (measured); a folder that disagrees follows it
    folder = make_layout(tmp_path, "mistral", tokenizer_config={"add_eos_token": True})
    data = json.loads((folder / "tokenizer.json").read_text())
    data["post_processor"] = None
    (folder / "tokenizer.json").write_text(json.dumps(data))
    ours, hf = Tokenizer.load(folder), _auto(folder)
    assert ours.encode_text(TEXT) == hf(TEXT).input_ids == ours.encode(TEXT)
    assert ours.bos_token_id == hf.bos_token_id and ours.bos_id == -1


def test_config_ids_only_where_the_tokenizer_says_nothing(tmp_path) -> None:
    folder = make_layout(tmp_path, "llama3")
    cfg = json.loads((folder / "config.json").read_text())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["eos_token"]  # a tokenizer_config.json that names no EOS
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.load(folder)
    assert tok.eos_id == cfg["eos_token_id"][0]  # the tokenizer names none: config.json's first
    assert list(tok.eos_ids) == cfg["eos_token_id"]


def test_a_bare_tokenizer_json_keeps_the_projects_names(tmp_path) -> None:
    from titan_plugins.data.tokenizer import DEFAULT_TOKENIZER

    tok = Tokenizer.load(DEFAULT_TOKENIZER)
    assert tok.tok.id_to_token(tok.bos_id) == "<|bos|>" and tok.tok.id_to_token(tok.eos_id) == "<|eos|>"
    assert tok.prefix == (tok.bos_id,)


def test_generation_stops_at_every_eos_the_folder_lists() -> None:
    # Llama 3.1 / Qwen3 generation_config.json end generation with several ids, as
    # transformers' generate does: any of them ends a row (filled with it after)
    import torch

    from titan_plugins.generate.sampling import SamplingConfig, generate

    class Writes(torch.nn.Module):
        def forward(self, tokens, cache=None):  # row 0 writes 7 then 3, row 1 always 3
            logits = torch.zeros(*tokens.shape, 12)
            logits[0, -1, 7 if tokens.shape[1] == 2 else 3] = 1.0
            logits[1, -1, 3] = 1.0
            return logits

    out = generate(Writes(), torch.zeros(2, 2, dtype=torch.long),
                   SamplingConfig(max_new_tokens=5, eos_id=9, stop_ids=(7,), use_cache=False))
    assert out[0].tolist() == [7, 9, 9, 9, 9]  # stopped at 7, then filled with the EOS
    assert out[1].tolist() == [3] * 5


def test_qwen3_moe_text_rows_and_step1_loss_equal_transformers(tmp_path) -> None:
    """Issue 35.2, the tokens: a Qwen3-MoE folder's text rows start as transformers'
    ``tokenizer(text)`` (no BOS: config.json's bos_token_id is not added) and the step-1
    loss on them equals ``Qwen3MoeForCausalLM``'s."""
    import torch

    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.data import build_dataloader, build_tokenizer
    from titan_plugins.data.builtin import DATASETS
    from titan_plugins.hf.load import load_hf_weights
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import prepare_job

    transformers = pytest.importorskip("transformers")
    folder = make_layout(tmp_path, "qwen3")
    ids = json.loads((folder / "config.json").read_text())
    vocab = Tokenizer.load(folder).vocab_size
    torch.manual_seed(0)
    ref = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False, **ids))
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.2)
    ref.save_pretrained(folder)
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": TEXT * 3}) + "\n")
    seq = 24
    spec, job, _ = prepare_job(["model=qwen3", f"model.hf={folder}", "model.attn_backend=sdpa",
                                "data.name=jsonl", f"data.path={docs}", "data.num_workers=0",
                                f"training.seq_len={seq}"], get_plugin_manager())
    tok = build_tokenizer(job.data)
    batch = next(iter(build_dataloader(job.data, tok, dp_rank=0, dp_world=1, local_batch_size=1, seq_len=seq,
                                       seed=0, datasets={s.name: s for s in DATASETS})))
    hf_ids = _auto(folder)(TEXT * 3).input_ids
    assert batch[0][0].tolist() == hf_ids[:seq]  # the document starts as tokenizer(text): no BOS
    cfg = model_config(job.model, spec)
    ours = spec.load("build")(cfg)
    with torch.no_grad():
        ours.init_weights()
    load_hf_weights([ours], spec, cfg, folder)
    with torch.no_grad():
        mine = torch.nn.functional.cross_entropy(ours.eval()(batch[0]).flatten(0, 1), batch[1].flatten())
        theirs = ref.eval()(batch[0]).logits
        theirs = torch.nn.functional.cross_entropy(theirs.flatten(0, 1), batch[1].flatten())
    assert abs(float(mine) - float(theirs)) < 1e-5
