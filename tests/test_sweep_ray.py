"""The Ray backend runs a sweep's grid as the local pool does: the same runs, in the same run
directories, with the same metrics (a local Ray the test starts). Skipped where Ray is absent."""

import pytest
import yaml

from test_rl import TIMING_KEYS
from toolcollapse.runtime import read_jsonl
from toolcollapse.sweep import load_sweep, run_sweep

SMALL = {"world.n_train": 40, "world.n_test": 4, "world.n_ood": 4, "grpo.steps": 2, "grpo.prompts_per_step": 2,
         "grpo.group_size": 2, "grpo.checkpoint_every": 1, "monitor.probe_every": 1, "monitor.probe_size": 2,
         "monitor.grad_share_every": 0, "rollout.max_turns": 2, "rollout.max_new_tokens": 12}


def _metrics(run_dir):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_jsonl(run_dir / "metrics.jsonl")]


@pytest.mark.slow
def test_the_ray_backend_runs_the_grid_as_the_local_pool_does(tmp_path, answering_checkpoint):
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'toolcollapse[ray]'")
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({
        "base": "configs/tiny_rl.yaml", "init": str(answering_checkpoint), "seeds": [0], "workers": 1,
        "out_dir": str(tmp_path / "local"), "overrides": {**SMALL, "grpo.format_reward": 0.5},
        "eval_n": 4, "settings": {"hot": {"grpo.lr": 1e-3}, "cold": {"grpo.lr": 1e-5}}}))
    local, local_specs = load_sweep(path)
    run_sweep(local, local_specs, on_done=lambda _: None)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        on_ray, ray_specs = load_sweep(path, [f"out_dir={tmp_path / 'ray'}", "backend=ray"])
        done = []
        run_sweep(on_ray, ray_specs, on_done=done.append)
    finally:
        ray.shutdown()
    assert sorted(done) == sorted([str(s.run_dir) for s in ray_specs] + [f"eval of {answering_checkpoint}"])
    for a, b in zip(local_specs, ray_specs):
        assert b.run_dir == tmp_path / "ray" / a.setting / "seed0"
        assert _metrics(a.run_dir) == _metrics(b.run_dir) and len(_metrics(b.run_dir)) == 2
        evals = [read_jsonl(s.run_dir / "checkpoints" / "step_000002" / "eval" / "test.jsonl") for s in (a, b)]
        assert [r["success"] for r in evals[0]] == [r["success"] for r in evals[1]]
