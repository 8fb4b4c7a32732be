"""Resuming with another ``training.steps`` continues on the new schedule at once."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from titan_plugins.model.optimizer import build_lr_scheduler, build_optimizer, lr_lambda, resync_lr


def _training(steps: int):
    return OmegaConf.create({"lr": 1e-3, "weight_decay": 0.0, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
                             "warmup_steps": 2, "steps": steps, "decay": "linear", "min_lr_ratio": 0.0})


def _run(steps: int, n: int):
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model, _training(steps))
    sched = build_lr_scheduler(opt, _training(steps))
    for _ in range(n):
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def test_resume_with_more_steps_uses_the_new_schedule_on_the_first_step():
    _, old_opt, old_sched = _run(steps=10, n=6)
    model, opt, sched = _run(steps=40, n=0)
    opt.load_state_dict(old_opt.state_dict())  # carries the old schedule's lr for step 6
    sched.load_state_dict(old_sched.state_dict())
    stale = opt.param_groups[0]["lr"]
    resync_lr(sched)
    expected = 1e-3 * lr_lambda(6, _training(40))
    assert stale == pytest.approx(1e-3 * lr_lambda(6, _training(10)))
    assert stale != pytest.approx(expected)  # the jump the resync removes
    assert opt.param_groups[0]["lr"] == pytest.approx(expected)
    assert sched.get_last_lr()[0] == pytest.approx(expected)
    sched.step()  # and the schedule continues from there
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * lr_lambda(7, _training(40)))
