"""The released chat templates of six model families (issue 35.4): token ids equal
``apply_chat_template``'s, assistant masks equal hand-checked spans (rendered turn by
turn: none of these has ``{% generation %}`` blocks), a template that rewrites an
earlier turn is one line naming it, and step-1 loss on ``data=chat`` equals
transformers' on the same masks. Templates: tests/data/chat and tests/data/templates
(their README says where each comes from)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from token_layouts import make_layout

from titan_plugins.chat import encode_conversation, load_chat_template
from titan_plugins.data.tokenizer import Tokenizer
from titan_plugins.errors import ConfigError

transformers = pytest.importorskip("transformers")

DATA = Path(__file__).parent / "data"
# template -> (file, token layout, the template's own special tokens, end of an assistant turn)
RELEASED = {
    "qwen3": ("chat/qwen3.jinja", "qwen3", ["<think>", "</think>"], "<|im_end|>"),
    "llama3_1": ("chat/llama3_1.jinja", "llama3", [], "<|eot_id|>"),
    "gemma3": ("templates/gemma3.jinja", "gemma", [], "<end_of_turn>"),
    "phi3_5": ("templates/phi3_5.jinja", "phi3", [], "<|end|>"),
    "deepseek_v3": ("templates/deepseek_v3.jinja", "deepseek_v3", [], "<｜end▁of▁sentence｜>"),
    "mistral": ("templates/mistral_nemo.jinja", "mistral", [], "</s>"),
}
REPLIES = ["Hello! How can I help?", "12 * 7 = 84."]
CONVERSATION = [
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": REPLIES[0]},
    {"role": "user", "content": "What is 12 * 7?"},
    {"role": "assistant", "content": REPLIES[1]},
]
SYSTEM = [{"role": "system", "content": "You are a helpful assistant."}, *CONVERSATION]


def _folder(root: Path, name: str) -> Path:
    file, layout, extra, _ = RELEASED[name]
    return make_layout(root / name, layout, extra_special=extra,
                       template=(DATA / file).read_text(encoding="utf-8"))


def _auto(folder: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(str(folder))


def _hf_ids(hf, messages) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _turns(tok, ids, mask) -> list[str]:
    """The masked tokens, decoded per contiguous run (one run per assistant turn)."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])


def _hand_spans(name: str) -> list[str]:
    end = RELEASED[name][3]
    think = "<think>\n\n</think>\n\n"  # Qwen3 writes an empty think block into the last turn
    return [REPLIES[0] + end, (think if name == "qwen3" else "") + REPLIES[1] + end]


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_ids_equal_apply_chat_template_and_masks_the_hand_checked_spans(tmp_path, name) -> None:
    folder = _folder(tmp_path, name)
    tok, template = Tokenizer.load(folder), load_chat_template(None, folder)
    hf = _auto(folder)
    for messages in (CONVERSATION, SYSTEM) if name != "mistral" else (CONVERSATION,):
        ids, mask = encode_conversation(messages, template, tok)
        assert ids == _hf_ids(hf, messages)
        assert _turns(tok, ids, mask) == _hand_spans(name)
        _, last = encode_conversation(messages, template, tok, train_on="last_assistant")
        assert _turns(tok, ids, last) == _hand_spans(name)[-1:]


def test_a_template_that_rewrites_an_earlier_turn_is_one_line_naming_it(tmp_path) -> None:
    # Mistral-Nemo moves the system message into the LAST user turn: the rendering that
    # ends after turn 1 is no prefix of the whole conversation
    folder = _folder(tmp_path, "mistral")
    with pytest.raises(ConfigError, match=r"^rows.jsonl:3: messages\[2\]: cannot place this assistant turn"):
        encode_conversation(SYSTEM, load_chat_template(None, folder), Tokenizer.load(folder),
                            where="rows.jsonl:3")


# ----------------------------------------------------------- step-1 loss vs transformers
QWEN3 = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rope_theta=10000.0,
             tie_word_embeddings=False)


def _model_folder(tmp_path: Path, name: str) -> Path:
    """A tiny random Qwen3 (transformers) beside the template's tokenizer files."""
    folder = _folder(tmp_path, name)
    tok = Tokenizer.load(folder)
    ids = json.loads((folder / "config.json").read_text())
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(vocab_size=tok.vocab_size, **QWEN3))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update({k: v for k, v in ids.items()})  # the layout's own special-token ids
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_step1_chat_loss_equals_transformers_on_the_same_masks(tmp_path, name) -> None:
    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.data import build_dataloader, build_tokenizer
    from titan_plugins.data.builtin import DATASETS
    from titan_plugins.hf.load import load_hf_weights
    from titan_plugins.loss.token_loss import IGNORE_INDEX
    from titan_plugins.model.lifecycle import build_meta_model
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import prepare_job

    folder = _model_folder(tmp_path, name)
    rows = [CONVERSATION] + ([SYSTEM] if name != "mistral" else [CONVERSATION[:2]])
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    spec, job, _ = prepare_job(["model=qwen3", f"model.hf={folder}", "model.attn_backend=sdpa",
                                "data.name=chat", f"data.path={data}", "data.num_workers=0",
                                "data.chat.pack=false", "training.seq_len=256"], get_plugin_manager())
    tok = build_tokenizer(job.data)
    batch = next(iter(build_dataloader(job.data, tok, dp_rank=0, dp_world=1, local_batch_size=2,
                                       seq_len=256, seed=0, datasets={s.name: s for s in DATASETS})))
    inputs, labels = batch[0], batch[1]
    model = build_meta_model(spec, job)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    load_hf_weights([model], spec, model_config(job.model, spec), folder)
    with torch.no_grad():
        logits = model.eval()(inputs).float()
    ours = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                             ignore_index=IGNORE_INDEX, reduction="sum")
    count = int((labels != IGNORE_INDEX).sum())

    hf_tok, template = _auto(folder), load_chat_template(None, folder)
    hf_model = transformers.Qwen3ForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    theirs, n = torch.zeros((), dtype=torch.float64), 0
    for messages in rows:
        ids = _hf_ids(hf_tok, messages)
        _, mask = encode_conversation(messages, template, Tokenizer.load(folder))
        target = torch.tensor([i if m else IGNORE_INDEX for i, m in zip(ids[1:], mask[1:])])
        with torch.no_grad():
            out = hf_model(torch.tensor([ids[:-1]])).logits[0].float()
        theirs += torch.nn.functional.cross_entropy(out, target, ignore_index=IGNORE_INDEX,
                                                    reduction="sum").double()
        n += int((target != IGNORE_INDEX).sum())
    assert count == n > 0
    assert abs(float(ours) / count - float(theirs) / n) < 1e-5
