"""What rank 0's console says: units (global tokens/s, TFLOP/s per rank), step i/N,
MFU never above 100%, the header's data/tokenizer/lr/peak rows and the last validation
loss in the summary."""

from __future__ import annotations

from omegaconf import OmegaConf

from titan_plugins.train.metrics import ConsoleSink
from titan_plugins.train.peak import mfu_percent
from titan_plugins.train.run_report import (
    RunStats,
    _data_text,
    _schedule_text,
    header_lines,
    summary_lines,
)


def test_mfu_is_never_above_100_percent():
    assert mfu_percent(0.5, 1.0) == 50.0
    assert mfu_percent(1.0, 1.0) == 100.0
    assert mfu_percent(2.76, 1.0) is None  # a peak probed under load: not credible
    assert mfu_percent(1.0, None) is None and mfu_percent(1.0, 0.0) is None


def test_step_line_says_step_of_total_and_the_units(capsys):
    job = OmegaConf.create({"metrics": {"console": True, "log_freq": 1}, "training": {"steps": 120}})
    metrics = {"loss": 2.5, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 12345.0, "tflops": 0.25,
               "memory_gib": 1.5, "mfu": 12.5}
    ConsoleSink().titan_on_step_end(step=7, metrics=metrics, job_config=job, rank=0)
    line = capsys.readouterr().out
    assert line.startswith("step   7/120 | loss 2.5000")
    assert "tok/s (all ranks) 12,345" in line and "TFLOP/s per rank 0.250" in line and "MFU 12.5%" in line


def test_header_names_data_tokenizer_schedule_and_peak():
    training = OmegaConf.create({"lr": 3e-4, "warmup_steps": 10, "decay": "cosine", "min_lr_ratio": 0.1})
    data = OmegaConf.create({"name": "jsonl", "path": "notes.jsonl"})
    header = "\n".join(header_lines(
        model="qwen3", flavor="debugmodel", params_total=10, params_active=10, world="1 rank",
        meshes="single rank", device="cpu", precision="fp32", global_batch_seqs=2, seq_len=8, steps=3,
        start_step=0, run_dir="r", tensorboard=None, metrics_jsonl=None, data=_data_text(data),
        tokenizer="tok.json, vocab 2,048", schedule=_schedule_text(training), peak="0.2 TFLOP/s per rank"))
    assert "data        jsonl (notes.jsonl)" in header
    assert "tokenizer   tok.json, vocab 2,048" in header
    assert "lr          0.0003, warmup 10 steps, cosine decay to 3e-05" in header
    assert "peak        0.2 TFLOP/s per rank" in header
    mix = OmegaConf.create({"name": "mix", "mix": [{"name": "jsonl", "path": "a", "weight": 2}]})
    assert _data_text(mix) == "mix of jsonl:a x2"


def test_summary_carries_the_last_validation_loss():
    stats = RunStats(start_time=0.0)
    stats.update(1, {"loss": 3.0, "tokens_per_s": 10.0, "step_time_s": 1.0}, now=1.0, total_steps=1)
    stats.validation = (1, 2.75)
    summary = "\n".join(summary_lines(stats, 2.0, memory_kind="max RSS", checkpoint=None))
    assert "validation  loss 2.7500 at step 1" in summary
    assert "10 tokens/s, all ranks" in summary


def test_profiler_messages_do_not_break_up_the_step_lines(tmp_path, capfd):
    from titan_plugins.train.profiling import StepProfiler

    job = OmegaConf.create({"profiling": {"enabled": True, "memory_snapshot": False, "start_step": 1,
                                          "steps": 1, "record_shapes": False, "profile_memory": False,
                                          "with_stack": False}})
    prof = StepProfiler(job, str(tmp_path), rank=0, device_type="cpu")  # starts before step 1
    prof.step(1)  # stops after step 1
    err = capfd.readouterr().err
    assert "profiler_st" not in err  # kineto's start/stop lines
    assert list((tmp_path / "profile").glob("rank0.*.pt.trace.json"))
    assert "profiler_start" in (tmp_path / "profile" / "kineto_rank0.log").read_text()
