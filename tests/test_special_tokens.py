"""Special-token ids come from the tokenizer in use (issue 25, item 3): a model's
``eos_id`` is the tokenizer's EOS id unless stated, and a ``block_causal`` mask that
could not separate documents is one error line before launch, for every model."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from omegaconf import OmegaConf

from titan_plugins.components.attention_masks import AttentionMask
from titan_plugins.data.special_tokens import check_attention_mask, hand_special_tokens
from titan_plugins.data.tokenizer import build_tokenizer
from titan_plugins.errors import ConfigError
from titan_plugins.plugins import get_plugin_manager
from titan_plugins.train.api import prepare_job

SHIPPED = build_tokenizer(OmegaConf.create({"tokenizer": None}))
SHIPPED_EOS, SHIPPED_BOS = SHIPPED.eos_id, SHIPPED.bos_id


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager(strict=True)


@pytest.mark.parametrize("model", ["qwen3", "llama4"])
def test_block_causal_takes_the_tokenizers_eos_id(pm, model) -> None:
    # qwen3's debug flavors kept eos_id=151645 beside a 2048-token vocabulary: no document ended
    _, job, _ = prepare_job([f"model={model}", "model.attn_mask=block_causal"], pm)
    assert job.model.eos_id == SHIPPED_EOS
    assert 0 <= SHIPPED_EOS < job.model.vocab_size


@pytest.mark.parametrize("overrides, message", [
    (["model=qwen3", "model.attn_mask=block_causal", "model.eos_id=151645"],
     "model.eos_id=151645 is outside the vocabulary"),
    (["model=qwen3", "model.attn_mask=block_causal", f"model.eos_id={SHIPPED_BOS}"],
     f"model.eos_id={SHIPPED_BOS} is <\\|bos\\|>, not the EOS id of the shipped tokenizer \\({SHIPPED_EOS}\\)"),
    (["model=llama4", "model.attn_mask=block_causal", f"model.eos_id={SHIPPED_BOS}"], "not the EOS id"),
])
def test_a_mask_that_cannot_take_effect_is_an_error(pm, overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        prepare_job(overrides, pm)


def test_a_stated_eos_id_is_kept(pm) -> None:
    _, job, _ = prepare_job(["model=qwen3", "model.eos_id=7"], pm)
    assert job.model.eos_id == 7  # the user's value; no mask reads it
    newline = SHIPPED.encode("\n")[0]  # an ordinary token as the separator: in the text, so it bites
    _, job, _ = prepare_job(["model=llama4", "model.attn_mask=block_causal", f"model.eos_id={newline}"], pm)
    assert job.model.eos_id == newline


@dataclass
class _AnyModel:  # what a third-party plugin's config may look like
    vocab_size: int = 2048
    eos_id: int = 2047
    attn_mask: AttentionMask = AttentionMask.block_causal


def test_the_check_covers_any_model_config(tmp_path) -> None:
    from tokenizers import Tokenizer, models

    data = OmegaConf.create({"name": "builtin", "tokenizer": None})
    check_attention_mask(_AnyModel(eos_id=SHIPPED_EOS), data)
    check_attention_mask(_AnyModel(eos_id=3, attn_mask=AttentionMask.causal), data)  # unused: fine
    with pytest.raises(ConfigError, match="not the EOS id"):
        check_attention_mask(_AnyModel(eos_id=SHIPPED_BOS), data)
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        check_attention_mask(_AnyModel(eos_id=4096), data)
    bare = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(bare))
    job = OmegaConf.create({"model": {"eos_id": 1, "attn_mask": "block_causal", "hf": None},
                            "data": {"name": "text", "tokenizer": str(bare)}})
    with pytest.raises(ConfigError, match="has no EOS token"):  # the flavor's eos_id would mean nothing
        hand_special_tokens(None, job, OmegaConf.create({"eos_id": "???"}))
    hand_special_tokens(None, job, OmegaConf.create({"eos_id": 1}))  # a separator the user named
    check_attention_mask(_AnyModel(vocab_size=2, eos_id=1), job.data)


def test_special_ids_come_from_what_a_folder_states_before_name_lists(tmp_path) -> None:
    import json

    from tokenizers import Tokenizer, models

    from titan_plugins.data.tokenizer import Tokenizer as TitanTokenizer

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    tok.add_special_tokens(["<doc>", "</doc>", "<|endoftext|>"])  # 2, 3, 4: the last a known name
    tok.save(str(tmp_path / "tokenizer.json"))
    assert TitanTokenizer.load(tmp_path).eos_id == 4  # nothing stated: the name list
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": [3, 4]}))
    loaded = TitanTokenizer.load(tmp_path)
    assert (loaded.bos_id, loaded.eos_id) == (2, 3)  # config.json, as transformers reads it
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    assert TitanTokenizer.load(tmp_path).eos_id == 4  # tokenizer_config.json names it: first


# ------------------------------------------------------------------ packed conversations
def _mask(job) -> str:
    return str(getattr(job.model.attn_mask, "value", job.model.attn_mask))


def _compose(*overrides):
    return prepare_job(list(overrides), get_plugin_manager(strict=True))[1]


def test_packed_chat_gets_block_causal_where_the_model_has_the_option():
    job = _compose("model=qwen3", "data=chat_sample")
    assert _mask(job) == "block_causal" and job.data.chat.pack


def test_packed_chat_pads_rows_for_a_model_without_a_document_mask(capsys):
    job = _compose("model=deepseek_v3", "data=chat_sample")
    assert job.data.chat.pack is False
    assert "rows are padded" in capsys.readouterr().out


def test_packed_chat_with_a_stated_causal_mask_is_one_error():
    with pytest.raises(ConfigError, match=r"model.attn_mask=causal: data.chat.pack=true"):
        _compose("model=qwen3", "data=chat_sample", "model.attn_mask=causal")
    job = _compose("model=qwen3", "data=chat_sample", "model.attn_mask=causal", "data.chat.pack=false")
    assert _mask(job) == "causal"


# ------------------------------------------------------------------ Llama 3.1 Instruct (issue 35.3)
def _llama31_instruct(tmp_path):
    """A tiny Llama 3.1 Instruct folder: config.json's eos_token_id the list of three,
    the tokenizer's EOS <|eot_id|>, the released template."""
    import json
    from pathlib import Path

    import torch
    from token_layouts import make_layout

    transformers = pytest.importorskip("transformers")
    template = (Path(__file__).parent / "data" / "chat" / "llama3_1.jinja").read_text(encoding="utf-8")
    folder = make_layout(tmp_path, "llama3", template=template)
    ids = json.loads((folder / "config.json").read_text())
    vocab = build_tokenizer(OmegaConf.create({"tokenizer": str(folder)})).vocab_size
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, **ids)).save_pretrained(folder)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "Hello!"},
                                             {"role": "assistant", "content": "Hello world."}]}) + "\n")
    return folder, rows, ids


def test_llama31_instruct_chat_launches_with_the_end_of_turn_id(pm, tmp_path) -> None:
    folder, rows, ids = _llama31_instruct(tmp_path)
    eot = ids["eos_token_id"][2]
    assert isinstance(ids["eos_token_id"], list) and ids["eos_token_id"][0] != eot
    _, job, _ = prepare_job(["model=llama3", f"model.hf={folder}", "data.name=chat", f"data.path={rows}",
                             "training.seq_len=32"], pm)
    assert str(job.model.attn_mask) == "block_causal" and job.model.eos_id == eot  # <|eot_id|>
    # a user's model.eos_id still wins, and is still checked
    with pytest.raises(ConfigError, match=r"is <\|end_of_text\|>, not the EOS id"):
        prepare_job(["model=llama3", f"model.hf={folder}", "data.name=chat", f"data.path={rows}",
                     "training.seq_len=32", f"model.eos_id={ids['eos_token_id'][0]}"], pm)


def test_llama31_export_keeps_the_eos_list_and_adds_no_pad(pm, tmp_path) -> None:
    """An export writes the source's special-token fields unchanged: config.json's and
    generation_config.json's EOS lists stay lists, and no pad_token_id appears that the
    source folder did not have (issue 35.3, 35.6)."""
    import json

    import torch

    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.hf.export import export_folder
    from titan_plugins.hf.load import load_hf_weights

    folder, rows, ids = _llama31_instruct(tmp_path)
    spec, job, _ = prepare_job(["model=llama3", f"model.hf={folder}", "data.name=chat", f"data.path={rows}",
                                "training.seq_len=32"], pm)
    cfg = model_config(job.model, spec)
    model = spec.load("build")(cfg)
    with torch.no_grad():
        model.init_weights()
    load_hf_weights([model], spec, cfg, folder)
    out = export_folder(spec, cfg, job, model.state_dict(), tmp_path / "exported")
    for name in ("config.json", "generation_config.json"):
        source, written = (json.loads((d / name).read_text()) for d in (folder, out))
        assert written["eos_token_id"] == source["eos_token_id"] == ids["eos_token_id"], name
        assert "pad_token_id" not in written or written["pad_token_id"] == source.get("pad_token_id"), name
        assert written.get("bos_token_id") == source.get("bos_token_id"), name
