"""docs/OUTPUTS.md is toolcollapse.outputs rendered, and a run with every signal on logs only documented keys."""

import json
from pathlib import Path

import pytest
import torch

from toolcollapse.outputs import RUN_FILES, pattern_regex, render, undocumented

DOC = Path(__file__).resolve().parents[1] / "docs" / "OUTPUTS.md"


def test_the_page_is_the_module_rendered():
    assert DOC.is_file() and DOC.read_text() == render(), \
        "docs/OUTPUTS.md is stale: regenerate it with `python -m toolcollapse.outputs > docs/OUTPUTS.md`"


def test_patterns_match_one_part_a_placeholder():
    assert pattern_regex("probe/<tag>/p@<slot>").fullmatch("probe/tool_call/p@answer_start")
    assert not pattern_regex("probe/<tag>/p@<slot>").fullmatch("probe/content/answer/p@answer_start")
    assert pattern_regex("ctrl/ratio_mean_<group>").fullmatch("ctrl/ratio_mean_other")
    keys = ["step", "probe/im_end/p@answer_end", "error/bad_arguments", "ets/tokens", "adaptive/lr_scale",
            "probe/content/arg_copied/logp", "made_up/key", "probe/tool_call/p@answer_start/extra", "made_up/key"]
    assert undocumented(keys) == ["made_up/key", "probe/tool_call/p@answer_start/extra"]


@pytest.mark.slow
def test_a_run_with_every_signal_on_logs_only_documented_keys(tmp_path, tiny_checkpoint):
    """Two steps of the untrained tiny model (its turns fail, with stray control tokens: unlikelihood has
    tokens to push down, ETS failures to train on) with the probe and validation at step 0, the gradient
    share, the SFT term, unlikelihood, OPS and HBG rows (the expert rows succeed: the groups are
    informative), `rollout.call_end: sampled` (the probe's `miss_after_call`), an ETS + PRS phase after
    step 1, and an alarm on the step counter that fires at step 1, which the adaptive schedule handles
    (rollback to step_000000, LR scale, SFT phase). Keys that hang on what was sampled (`finish/<reason>`,
    `ctrl/<tag>/*`, `sup/unlikelihood`) are checked when they appear, not required."""
    from test_rl import _rl_config

    from toolcollapse.config import load_config
    from toolcollapse.rl import run_rl

    config = _rl_config(tmp_path, tiny_checkpoint, group_size=4)
    cfg = load_config(config, [
        "threads=1", "grpo.steps=2", "grpo.eval_every=2", "grpo.eval_n=2",
        "rollout.max_turns=8", "rollout.max_new_tokens=64", "rollout.call_end=sampled",
        "monitor.probe_every=2", "monitor.probe_size=4", "monitor.grad_share_every=1", "monitor.grad_share_rows=2",
        "monitor.alarm_series=[step]", "monitor.alarm_scale=absolute",
        "supervision.sft_coef=0.5", "supervision.unlikelihood_coef=0.1",
        "supervision.ops.enabled=true", "supervision.hbg.enabled=true", "supervision.hbg.rows=1",
        "supervision.ets.enabled=true", "supervision.ets.every=2", "supervision.ets.window=1",
        "supervision.prs.enabled=true", "supervision.prs.target=correction",
        "supervision.phase.batch_size=4", "supervision.phase.epochs=1", "supervision.adaptive.enabled=true"])
    threads = torch.get_num_threads()
    try:  # one thread: two spin-wait where other jobs hold the cores (here 50 s, not 5)
        run = run_rl(cfg, tmp_path / "run")
    finally:
        torch.set_num_threads(threads)  # as conftest set it, for the tests after this one
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    keys = {k for r in rows for k in r}
    signals = {"probe/tool_call/p@answer_start", "probe/im_end/miss_after_call", "probe/content/answer/logp",
               "val/success", "ctrl/grad_sq_share", "sup/sft_nll", "sup/expert_success", "sup/hinted_success",
               "sup/sft_tokens_total", "ets/tokens", "adaptive/recovery", "adaptive/rollback_to", "adaptive/tokens"}
    assert signals <= keys, f"the run did not exercise {sorted(signals - keys)}"
    assert undocumented(keys) == []
    documented = {path.split("/")[0] for path, _ in RUN_FILES}
    assert sorted(p.name for p in run.iterdir() if p.name not in documented) == []
