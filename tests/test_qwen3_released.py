"""Qwen3 and Qwen3-MoE folders laid out like the released ones (issue 35.1, 35.2).

The tokenizer adds no BOS although config.json names ``bos_token_id``
(``token_layouts``' ``qwen3``: ``bos_token: null``; generation_config.json ends
generation at ``<|im_end|>`` or ``<|endoftext|>``). On tiny random models written by
transformers into such a folder: a Qwen3-MoE run through ``titan-run`` has transformers'
step-1 loss, ``titan-generate`` gives ``generate``'s greedy ids, and the lm-eval adapter
scores as lm-eval's own Hugging Face model does, with contexts that start as the
tokenizer's ``tokenizer(text)`` (no BOS). Nothing is downloaded.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from token_layouts import make_layout

from titan_plugins.data.tokenizer import Tokenizer
from titan_plugins.loss.token_loss import IGNORE_INDEX

transformers = pytest.importorskip("transformers")

TEXTS = [
    "What is the capital of France? The capital of France is Paris.",
    "Hello world, this is a test of the tokenizer.",
    "You are a helpful assistant. Answer briefly and clearly.",
    "Waves fold into foam, the tide keeps its slow time. 12 * 7 = 84.",
]
SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rope_theta=10000.0,
             tie_word_embeddings=False)
# the released Qwen3-MoE routing and layer schedule (every block MoE, top-k renormalised)
MOE = dict(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
           decoder_sparse_step=1, mlp_only_layers=[])


def _auto_tokenizer(folder: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(str(folder))


def released_folder(root: Path, moe: bool) -> Path:
    """A tiny random Qwen3 / Qwen3-MoE saved by transformers beside the released
    layout's tokenizer files; config.json and generation_config.json carry its ids."""
    folder = make_layout(root, "qwen3")
    ids = json.loads((folder / "config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    vocab = Tokenizer.load(folder).vocab_size
    torch.manual_seed(0)
    if moe:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            vocab_size=vocab, **SMALL, **MOE, **ids))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(vocab_size=vocab, **SMALL, **ids))
    with torch.no_grad():  # random (not the near-zero init) so every weight matters
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    saved = json.loads((folder / "generation_config.json").read_text())  # save_pretrained's, from config.json
    (folder / "generation_config.json").write_text(json.dumps({**saved, **generation}))
    assert json.loads((folder / "config.json").read_text())["bos_token_id"] == ids["bos_token_id"]
    return folder


def _hf_model(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


# ------------------------------------------------------------ training (titan-run)
def _run_overrides(folder: Path, docs: Path, *extra: str) -> list[str]:
    return ["model=qwen3", f"model.hf={folder}", "model.attn_backend=sdpa", "data.name=jsonl",
            f"data.path={docs}", "data.num_workers=0", "training.seq_len=32", "metrics.tensorboard=false",
            *extra]


def _docs(tmp_path: Path) -> Path:
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 3))
    return docs


def _step1_batches(overrides: list[str], dp_world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each data-parallel rank's first batch, built as the trainer builds its loader."""
    from titan_plugins.data import build_dataloader, build_tokenizer
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import prepare_job

    pm = get_plugin_manager()
    _, job, _ = prepare_job(overrides, pm)
    tok = build_tokenizer(job.data)
    return [next(iter(build_dataloader(
        job.data, tok, dp_rank=rank, dp_world=dp_world, local_batch_size=int(job.training.local_batch_size),
        seq_len=int(job.training.seq_len), seed=int(job.training.seed), datasets=pm.datasets())))[:2]
        for rank in range(dp_world)]


def _hf_loss(folder: Path, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """transformers' mean loss over every unmasked label of the global batch."""
    model = _hf_model(folder)
    total, count = 0.0, 0
    for inputs, labels in batches:
        with torch.no_grad():
            logits = model(inputs).logits.double()
        total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                         ignore_index=IGNORE_INDEX, reduction="sum"))
        count += int((labels != IGNORE_INDEX).sum())
    return total / count


def _step_losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "step" in r]


def _check_rows_start_without_bos(folder: Path, batches) -> None:
    """Rows are the documents as ``tokenizer(text)`` gives them, each ended by the EOS:
    config.json's bos_token_id (<|endoftext|>) appears nowhere."""
    hf_tok = _auto_tokenizer(folder)
    bos = json.loads((folder / "config.json").read_text())["bos_token_id"]
    stream = [i for t in TEXTS * 3 for i in [*hf_tok(t).input_ids, hf_tok.eos_token_id]]
    assert hf_tok.bos_token_id is None and stream[0] != bos
    inputs = batches[0][0]
    assert inputs[0].tolist() == stream[:inputs.shape[1]]  # the first row starts the file
    assert all(bos not in b[0] for b in batches)


@pytest.mark.slow  # a one-rank training run in a subprocess (~15 s)
def test_qwen3_moe_released_layout_step1_loss_through_titan_run(tmp_path) -> None:
    """Issue 35.2: ``titan-run`` from a released-layout Qwen3-MoE folder; the step-1 loss
    equals ``Qwen3MoeForCausalLM``'s on the same rows (fp32, within 1e-5)."""
    from titan_plugins.train.api import run

    folder = released_folder(tmp_path, moe=True)
    overrides = _run_overrides(folder, _docs(tmp_path), "training.local_batch_size=2")
    result = run([*overrides, "training.steps=1"], run_dir=tmp_path / "run", timeout=300)
    assert result.returncode == 0, f"{result.error}\n{result.stderr[-3000:]}"
    batches = _step1_batches(overrides, 1)
    _check_rows_start_without_bos(folder, batches)
    (loss,) = _step_losses(tmp_path / "run")
    want = _hf_loss(folder, batches)
    assert abs(loss - want) <= 1e-5, (loss, want)


@pytest.mark.slow
@pytest.mark.extended  # two training runs (2 ranks with EP, then 1 rank) and both export routes (~90 s)
def test_qwen3_moe_expert_parallel_run_and_its_export_equal_transformers(tmp_path) -> None:
    """Issue 35.2 under EP (experts split over 2 ranks): the step-1 loss equals
    transformers' on the same global batch and the one-rank run's; both exports (whose
    experts were gathered from two ranks) are the trained model in transformers."""
    from titan_plugins.testing.hf_check import check_export_is_trained_model
    from titan_plugins.train.api import run

    folder = released_folder(tmp_path, moe=True)
    # The kit checks the export's generation_config.json against the source's config.json,
    # which for the released Qwen3 files differ (eos 151645 vs [151645, 151643]): here
    # config.json lists both too, so that check still compares like with like.
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    (folder / "config.json").write_text(json.dumps(config))
    overrides = _run_overrides(folder, _docs(tmp_path))
    got = check_export_is_trained_model("qwen3", folder, tmp_path / "ep", [*overrides, "parallelism=fsdp2_ep2"],
                                        hf_attn="eager")
    assert got["logits_diff"] <= 1e-5 and got["loss_diff"] <= 1e-5, got
    batches = _step1_batches([*overrides, "training.local_batch_size=2"], 2)  # as the run's 2 ranks
    _check_rows_start_without_bos(folder, batches)
    ep_loss = _step_losses(tmp_path / "ep" / "run")[0]
    want = _hf_loss(folder, batches)
    result = run([*overrides, "training.local_batch_size=4", "training.steps=1"], run_dir=tmp_path / "one",
                 timeout=300)
    assert result.returncode == 0, f"{result.error}\n{result.stderr[-3000:]}"
    (one_loss,) = _step_losses(tmp_path / "one")
    assert abs(ep_loss - want) <= 1e-5 and abs(one_loss - ep_loss) <= 1e-5, (ep_loss, one_loss, want)


# ------------------------------------------------------------ titan-generate
def _stop_after_three(folder: Path, prompt: list[int], stop: int) -> None:
    """Make greedy decoding end at ``stop`` (the second EOS generation_config.json lists,
    not the tokenizer's): its output row becomes a 1.05x copy of the token transformers
    picks third, so the stop wins there (the logit is positive) and nowhere before."""
    model = _hf_model(folder)
    free = model.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False, eos_token_id=None,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    with torch.no_grad():
        model.lm_head.weight[stop] = 1.05 * model.lm_head.weight[free[2]]
    model.save_pretrained(folder)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_titan_generate_greedy_ids_equal_transformers_generate(tmp_path, monkeypatch, capsys, moe) -> None:
    """Issue 35.1/35.2: the prompt is ``tokenizer(text)`` (no BOS), the greedy ids are
    ``generate``'s and decoding stops at the same id (generation_config.json's EOS list)."""
    import titan_plugins.generate.sampling as sampling
    from titan_plugins.cli.generate import main

    folder = released_folder(tmp_path, moe)
    hf_tok = _auto_tokenizer(folder)
    prompt = hf_tok(TEXTS[0]).input_ids
    stops = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    assert hf_tok.eos_token_id == stops[0] and len(stops) == 2
    _stop_after_three(folder, prompt, stops[1])

    seen = []
    real = sampling.generate

    def recording(model, ids, cfg):
        out = real(model, ids, cfg)
        seen.append((ids[0].tolist(), out[0].tolist(), cfg.stops()))
        return out

    monkeypatch.setattr(sampling, "generate", recording)
    capsys.readouterr()
    assert main(["--hf", str(folder), "--model", "qwen3", "--prompt", TEXTS[0], "--max-new-tokens", "8"]) == 0
    (ours_prompt, ours_new, ours_stops), = seen

    model = _hf_model(folder)
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                            attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0].tolist()
    assert ours_prompt == prompt  # no BOS: config.json's bos_token_id is not the tokenizer's
    assert sorted(ours_stops) == sorted(model.generation_config.eos_token_id) == sorted(stops)
    assert ours_prompt + ours_new == theirs
    assert theirs[-1] == stops[1] and len(ours_new) == 3  # the stop was reached and honoured


# ------------------------------------------------------------ the lm-eval adapter
def test_lm_eval_adapter_scores_as_lm_evals_hf_model(tmp_path) -> None:
    """Issue 35.1: the adapter's contexts start as ``tokenizer(text)`` (no BOS), an empty
    context follows lm-eval's prefix token (the EOS, Qwen3 having no BOS), and the
    log-likelihoods equal lm-eval's ``HFLM`` on transformers' model (within 1e-5)."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from titan_plugins.generate.lm_eval_adapter import TitanLM
    from titan_plugins.generate.load import load_hf

    folder = released_folder(tmp_path, moe=False)
    hf_tok = _auto_tokenizer(folder)
    loaded = load_hf(folder, "qwen3", torch.device("cpu"))
    seen = []
    forward = loaded.model.forward

    def recording(tokens, *args, **kwargs):
        seen.append(tokens[0].tolist())
        return forward(tokens, *args, **kwargs)

    loaded.model.forward = recording
    ours = TitanLM(loaded.model, loaded.tokenizer, 64, torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = HFLM(pretrained=_hf_model(folder), tokenizer=hf_tok, batch_size=1, max_length=64)
    pairs = [("The capital of France is", " Paris."), ("Hello world,", " this is a test"), ("", "Hello world")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    got, want = ours.loglikelihood(requests), theirs.loglikelihood(requests)

    context = hf_tok(pairs[0][0]).input_ids
    assert seen[0][:len(context)] == context and seen[0][0] != hf_tok.convert_tokens_to_ids("<|endoftext|>")
    assert seen[2][0] == theirs.prefix_token_id == hf_tok.eos_token_id  # an empty context's prefix
    for (g, g_greedy), (w, w_greedy) in zip(got, want, strict=True):
        assert abs(g - w) <= 1e-5 and g_greedy == w_greedy, (got, want)
