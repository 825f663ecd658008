"""The loop's policy: the one "every N steps" rule against base_train.py's four conditions (written out
here as nanochat writes them), the timed steps, the loop state's round trip through a checkpoint's meta."""

import json

import pytest

from jaxchat.checkpoint.meta import CheckpointMismatchError
from jaxchat.train.settings import RunSettings
from jaxchat.train.loop import TIMING_WARMUP_STEPS, LoopPolicy, LoopState, timed_steps


def nanochat_due(kind: str, step: int, last_step: bool, every: int, resume_step: int | None) -> bool:
    """base_train.py's conditions (scripts/base_train.py at nanochat bdcc030), with a resumed run skipping
    at its first step what the run that saved that step did before saving: evaluation (which comes first),
    CORE and samples (which it also did, right after the save)."""
    if kind == "eval":
        return every > 0 and (last_step or step % every == 0) and step != resume_step
    if kind == "save":
        return last_step or (step > 0 and step != resume_step and every > 0 and step % every == 0)
    return every > 0 and (last_step or (step > 0 and step % every == 0)) and step != resume_step


@pytest.mark.parametrize("every", [-1, 1, 3, 5])
@pytest.mark.parametrize("resume_step", [None, 3, 4])
def test_every_rule_is_base_trains_four_conditions(every, resume_step):
    num_iterations = 10
    settings = RunSettings(eval_every=every, save_every=every, core_metric_every=every, sample_every=every,
                           num_iterations=num_iterations)
    policy = LoopPolicy.from_settings(settings, start_step=resume_step or 0)
    rules = {"eval": policy.eval, "save": policy.save, "core": policy.core, "sample": policy.sample}
    for step in range(resume_step or 0, num_iterations + 1):
        last_step = step == num_iterations
        for kind, rule in rules.items():
            assert policy.due(rule, step, last_step) == nanochat_due(kind, step, last_step, every, resume_step), \
                (kind, step)


def test_the_untrained_model_is_evaluated_and_only_evaluated_at_step_0():
    policy = LoopPolicy.from_settings(RunSettings(eval_every=5, save_every=5, core_metric_every=5, sample_every=5),
                                      start_step=0)
    assert [policy.due(rule, 0, False) for rule in (policy.eval, policy.save, policy.core, policy.sample)] == \
        [True, False, False, False]


def test_timed_steps_leave_out_the_first_ones():
    # steps 0..10 compile and warm up (base_train.py times `step > 10`): 11 steps untimed
    assert TIMING_WARMUP_STEPS == 10
    assert [timed_steps(n) for n in (0, 1, 11, 12, 40)] == [0, 0, 0, 1, 29]


def test_loop_state_round_trips_through_json_meta():
    state = LoopState(step=7, val_bpb=1.25, min_val_bpb=1.125, smooth_train_loss=3.5, total_training_time=2.0)
    meta = json.loads(json.dumps(state.to_meta()))
    assert LoopState.from_meta(meta) == state
    assert meta["step"] == 7 and meta["val_bpb"] == 1.25  # nanochat's top-level fields


@pytest.mark.parametrize("drop, lacks", [("loop_state", "lacks loop_state,"),
                                         ("smooth_train_loss", "lacks loop_state.smooth_train_loss,")])
def test_a_meta_without_the_loop_state_is_one_line_naming_the_file(drop, lacks):
    meta = json.loads(json.dumps(LoopState(step=7).to_meta()))
    del (meta if drop == "loop_state" else meta["loop_state"])[drop]
    with pytest.raises(CheckpointMismatchError) as info:
        LoopState.from_meta(meta, where="run/7/meta/metadata")
    message = str(info.value)
    assert message.startswith(f"run/7/meta/metadata {lacks} the training loop's state") and "\n" not in message
    assert "restore that file, resume another step (--resume-from-step N), or start a new run from these weights " \
           "with --init-from <that step's directory> --model-tag <a new tag>" in message
