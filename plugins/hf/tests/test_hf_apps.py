"""The core's tools on ``model=hf`` (issue 38.3), each against transformers.

One ``titan-run`` from a tiny random Mistral folder whose ``tokenizer_config.json``
carries its own chat template trains ``data=chat`` with validation and a checkpoint
(exported with ``checkpoint.export_hf``); the other tools read that run:

- step-1 loss equals transformers' on the ids and assistant masks transformers itself
  gives for those conversations (``apply_chat_template(..., return_assistant_tokens_mask=True)``:
  the template has ``{% generation %}`` blocks and a header of its own, so a template
  other than the folder's would not match);
- the last validation loss equals transformers' on the held-out rows, on the export;
- ``titan-generate RUN --chat`` prints transformers' greedy reply (KV cache on);
- ``titan-eval`` on the core's local lm-eval task: every log-likelihood equals
  transformers', and the scores are theirs.

Extended (launches of their own): ``titan-compare`` of one rank against ``fsdp2``
(PASS), and a Hydra multirun (``-m``) over ``training.compile=false,true`` (inductor on
CPU) whose compiled job trains like the eager one.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
api = pytest.importorskip("titan_plugins.train.api")

from titan_hf.testing import reference_model, save_folder  # noqa: E402

from titan_plugins.data.tokenizer import ASSETS  # noqa: E402
from titan_plugins.loss.token_loss import IGNORE_INDEX  # noqa: E402

TRAIN_ROWS, HELD_OUT = ASSETS / "chat_sample.jsonl", ASSETS / "chat_sample_val.jsonl"
# ChatML with "<role> says:" headers (no shipped template renders that) and
# {% generation %} around each reply and its end-of-turn token.
TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant says:\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + ' says:\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant says:\\n' }}{%- endif %}"
)
SEQ_LEN = 128  # the tiny flavors' max_position_embeddings
COMMON = ["model=hf", "data=chat", f"data.path={TRAIN_ROWS}", f"training.seq_len={SEQ_LEN}",
          "training.local_batch_size=2", "training.lr=1e-3", "training.warmup_steps=0",
          "training.deterministic=true", "metrics.tensorboard=false"]
ENV = {"TITAN_CPU_PEAK_TFLOPS": "off", "OMP_NUM_THREADS": "1"}  # no matmul probe per launch
TIMEOUT = 300
EVAL_TASKS = Path(__file__).resolve().parents[3] / "tests" / "data" / "eval_task"


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    """A private scratch directory: pytest's numbered tmp dirs are pruned by other pytest
    sessions running at the same time, under a launched run."""
    path = Path(tempfile.mkdtemp(prefix="titan-hf-apps-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def folder(work: Path) -> Path:
    """Tiny random Mistral (vocab 2048) beside the shipped chat tokenizer and TEMPLATE."""
    out = save_folder("tiny_mistral", work / "mistral", vocab_size=2048, bos_token_id=None,
                      eos_token_id=2047, pad_token_id=None)  # 2047: <|im_end|>
    (out / "tokenizer.json").write_bytes((ASSETS / "chat_tokenizer" / "tokenizer.json").read_bytes())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>", "chat_template": TEMPLATE}))
    return out


@pytest.fixture(scope="module")
def trained(work: Path, folder: Path) -> Any:
    """Two steps of data=chat with validation after each, a checkpoint and an export."""
    result = api.run([*COMMON, f"model.hf={folder}", "training.steps=2", "validation.enabled=true",
                      f"validation.path={HELD_OUT}", "validation.every=1", "validation.steps=1",
                      "checkpoint.enabled=true", "checkpoint.export_hf=true"],
                     run_dir=work / "run", timeout=TIMEOUT, env=ENV)
    assert result.ok, f"{result.error}\n{result.stderr[-3000:]}"
    assert len(result.losses) == 2
    return result


# ----------------------------------------------------------------- references
def _hf_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _hf_conversations(path: Path, tok: Any) -> list[tuple[list[int], list[int]]]:
    """transformers' ids and assistant masks of each conversation of ``path``, in order."""
    out = []
    for line in path.read_text().splitlines():
        enc = tok.apply_chat_template(json.loads(line)["messages"], tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        out.append((list(enc["input_ids"]), list(enc["assistant_masks"])))
    return out


def _batches(result: Any, validation: bool, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The run's first ``n`` (inputs, labels) batches of one rank, rebuilt from its config."""
    from titan_plugins.data import build_dataloader, build_tokenizer
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.validation import validation_data_config
    from titan_plugins.train.worker import load_job

    job = load_job(result.run_dir / "config.yaml")
    data = validation_data_config(job) if validation else job.data
    rows = iter(build_dataloader(data, build_tokenizer(data), dp_rank=0, dp_world=1,
                                 local_batch_size=int(job.training.local_batch_size),
                                 seq_len=int(job.training.seq_len), seed=int(job.training.seed),
                                 datasets=get_plugin_manager().datasets()))
    return [next(rows)[:2] for _ in range(n)]


def _hf_masked_loss(model: torch.nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                    path: Path, tok: Any) -> tuple[float, int]:
    """Token-mean cross-entropy of transformers' ``model`` over the conversations the
    batches' rows hold, each from transformers' own ids and assistant mask (truncated to
    ``SEQ_LEN`` positions, unpadded), and the number of targets. A row matching no
    conversation of ``path`` fails: the run rendered another template."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    convs = _hf_conversations(path, tok)
    for inputs, labels in batches:
        for row, row_labels in zip(inputs.tolist(), labels.tolist(), strict=True):
            match = None
            for ids, mask in convs:
                n = min(len(ids) - 1, SEQ_LEN)
                want = [t if m else IGNORE_INDEX for t, m in zip(ids[1:n + 1], mask[1:n + 1])]
                if row[:n] == ids[:n] and row_labels == want + [IGNORE_INDEX] * (SEQ_LEN - n):
                    match = (ids[:n], want)
                    break
            assert match is not None, f"a row is no conversation of {path.name} under the folder's template"
            with torch.no_grad():
                logits = model(torch.tensor([match[0]])).logits[0].double()
            target = torch.tensor(match[1])
            total += torch.nn.functional.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="sum")
            count += int((target != IGNORE_INDEX).sum())
    assert count > 0
    return float(total) / count, count


def _validations(run_dir: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {r["validation_step"]: r for r in records if "validation_step" in r}


def _export(result: Any) -> torch.nn.Module:
    """The run's export (``<run_dir>/hf``), loaded strictly by transformers."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(result.run_dir / "hf", output_loading_info=True,
                                                       attn_implementation="sdpa", dtype=torch.float32)
    assert not any(info.values()), info
    return model.eval()


# ----------------------------------------------------------------- the run
@pytest.mark.slow
def test_chat_step1_loss_equals_transformers_on_the_folders_template_and_masks(trained, folder):
    tok = _hf_tokenizer(folder)
    assert tok.chat_template == TEMPLATE
    want, count = _hf_masked_loss(reference_model(folder), _batches(trained, False, 1), TRAIN_ROWS, tok)
    print(f"step-1 loss {trained.losses[0]:.7f}, transformers {want:.7f} on {count} assistant tokens")
    assert abs(trained.losses[0] - want) <= 1e-5, (trained.losses[0], want)
    assert trained.losses[1] != trained.losses[0]  # it trained


@pytest.mark.slow
def test_validation_loss_equals_transformers_on_the_export(trained, folder):
    records = _validations(trained.run_dir)
    assert sorted(records) == [1, 2]
    want, count = _hf_masked_loss(_export(trained), _batches(trained, True, 1), HELD_OUT, _hf_tokenizer(folder))
    got = records[2]
    print(f"validation loss {got['loss']:.7f}, transformers on the export {want:.7f} ({count} tokens)")
    assert abs(got["loss"] - want) <= 1e-5, (got, want)
    assert got["tokens"] == count
    assert records[1]["loss"] != got["loss"]  # the weights moved between the two


@pytest.mark.slow
def test_titan_generate_chat_reply_equals_transformers_greedy(trained, folder, capsys):
    from titan_plugins.cli.generate import main as generate_main
    from titan_plugins.data.tokenizer import Tokenizer

    question, n = "What does the assert statement do?", 12
    assert generate_main([str(trained.run_dir), "--chat", question, "--max-new-tokens", str(n),
                          "--ignore-eos"]) == 0
    got = capsys.readouterr().out
    prompt = _hf_tokenizer(folder).apply_chat_template([{"role": "user", "content": question}],
                                                       add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"]
    with torch.no_grad():
        ids = _export(trained).generate(torch.tensor([list(prompt)]), max_new_tokens=n, min_new_tokens=n,
                                        do_sample=False, eos_token_id=None)[0, len(prompt):].tolist()
    assert len(ids) == n
    assert got == Tokenizer.load(folder).decode(ids) + "\n", (got, ids)


@pytest.mark.slow
def test_titan_eval_scores_equal_transformers(trained, folder, capsys, monkeypatch):
    pytest.importorskip("lm_eval")
    if not EVAL_TASKS.is_dir():
        pytest.skip("the core's tests/data/eval_task is not beside this plugin")
    from titan_plugins.cli.eval import main as eval_main
    from titan_plugins.generate import lm_eval_adapter

    seen: list[tuple[tuple[str, str], tuple[float, bool]]] = []
    scored = lm_eval_adapter.TitanLM.loglikelihood

    def recording(self, requests):  # what lm-eval asked and what the model answered
        out = scored(self, requests)
        seen.extend(zip((r.args for r in requests), out, strict=True))
        return out

    monkeypatch.setattr(lm_eval_adapter.TitanLM, "loglikelihood", recording)
    assert eval_main([str(trained.run_dir), "--tasks-dir", str(EVAL_TASKS), "--tasks", "titan_heldout"]) == 0
    scores = json.loads(capsys.readouterr().out)["results"]["titan_heldout"]
    assert seen

    tok, model = _hf_tokenizer(folder), _export(trained)
    for (context, continuation), (ll, greedy) in seen:
        ctx = tok(context)["input_ids"]
        cont = tok(continuation, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logits = model(ids[:, :-1]).logits[0, -len(cont):].double()
        target = torch.tensor(cont)
        want = float(torch.log_softmax(logits, -1).gather(1, target[:, None]).sum())
        assert abs(ll - want) <= 1e-4, (context, continuation, ll, want)
        assert greedy == bool((logits.argmax(-1) == target).all())
    lls = [ll for _, (ll, _) in seen]
    assert scores["perplexity,none"] == pytest.approx(math.exp(-sum(lls) / len(lls)), rel=1e-9)
    assert scores["acc,none"] == pytest.approx(sum(g for _, (_, g) in seen) / len(seen), abs=1e-12)


# ----------------------------------------------------------------- launches of their own
@pytest.mark.slow
@pytest.mark.extended
def test_titan_compare_one_rank_against_fsdp2_passes(work, folder, capsys, monkeypatch):
    """The masked chat loss and the gradient norm under fsdp2 (the test side's batch
    halved to keep the global batch) within the tolerance policy over 3 steps."""
    from titan_plugins.cli.compare import main as compare_main

    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    side = " ".join([*COMMON, f"model.hf={folder}"])
    rc = compare_main(["--baseline", f"{side} parallelism=single", "--test", f"{side} parallelism=fsdp2",
                       "--steps", "3", "--workdir", str(work / "compare")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.rstrip().splitlines()[-1] == "PASS", out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 3] * 2, out  # loss and grad norm, every step
    print(out)


@pytest.mark.skipif(
    not any(map(shutil.which, (os.environ.get("CXX", "g++"), "g++", "clang++", "c++"))),
    reason="torch.compile's CPU backend needs a C++ compiler",
)
@pytest.mark.slow
@pytest.mark.extended
def test_multirun_sweep_over_compile_trains_like_eager(work, folder):
    """``titan-run -m ... training.compile=false,true``: two jobs, one table; the compiled
    decoder layers (inductor kernels written) give the eager losses within the parity
    tolerance."""
    from titan_plugins.compare.tolerances import LOSS_PARITY
    from titan_plugins.train.run_files import read_result

    sweep, cache = work / "sweep", work / "inductor-cache"
    proc = subprocess.run(
        [sys.executable, "-m", "titan_plugins.cli.run", "-m", *COMMON, f"model.hf={folder}",
         "training.steps=2", "training.compile=false,true", f"hydra.sweep.dir={sweep}"],
        env={**os.environ, **ENV, "TORCHINDUCTOR_CACHE_DIR": str(cache)},
        capture_output=True, text=True, timeout=2 * TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "2 jobs, 0 failed" in proc.stdout, proc.stdout
    from omegaconf import OmegaConf

    # one directory per job right under the sweep's (the paths in the overrides do not nest it)
    jobs = {bool(OmegaConf.load(c).training.compile): read_result(c.parent) for c in sweep.glob("*/config.yaml")}
    assert sorted(jobs) == [False, True], sorted(p.relative_to(sweep) for p in sweep.rglob("config.yaml"))
    assert any(cache.rglob("*.py")), "inductor wrote no kernels: the layers were not compiled"
    eager, compiled = jobs[False].losses, jobs[True].losses
    assert len(eager) == 2 and eager[0] != eager[1]
    print(f"eager {eager}, compiled {compiled}")
    assert compiled == pytest.approx(eager, rel=LOSS_PARITY.rtol, abs=LOSS_PARITY.atol)
