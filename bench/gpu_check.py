"""GPU check (issue 14): the Hugging Face tier on a GPU, in one short run.

  1. SmolLM2-135M SFT on the GPU in bfloat16 (the smol recipe's 40 steps);
  2. greedy rollouts of it in float32, decoding through `rollout.lean_decode` and through model(...): the
     same tokens and log-probs; then 5 RL steps from it on the GPU in bfloat16: sampled tokens/s, step
     time, peak GPU memory;
  3. the first RL step again in float32, on the GPU and on the CPU, same seed and init:
     rewards must be equal and the losses, the entropy and the probe's miss rate close (float
     rounding differs between the devices). A step whose groups all had equal rewards has a
     policy loss of 0 on any device: the script then says the loss comparison is vacuous.

    python bench/gpu_check.py                      # on a machine with a GPU and toolcollapse[smol]
    python bench/gpu_check.py --device cpu --tiny  # the script's own dry run on a CPU (minutes)

`--tiny` cuts every size (SFT steps, prompts, turns, tokens) so the script can be tried on a CPU;
its figures are then not the check's. Run directories go under --out (runs/gpu_check).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch

from toolcollapse.config import load_config
from toolcollapse.rl import run_rl
from toolcollapse.runtime import read_jsonl
from toolcollapse.sft import run_sft

COMPARED = ("reward_mean", "success", "healthy_rate", "response_tokens", "frac_groups_informative", "loss", "pg_loss",
            "kl_ref", "entropy", "probe/im_end/miss_required")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/gpu_check")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="small sizes, to try the script on a CPU")
    ap.add_argument("--sft-steps", type=int, default=None,
                    help="SFT steps (default: configs/smol/sft.yaml's recipe, 40; its model earns rewards in RL)")
    ap.add_argument("--rl-steps", type=int, default=5)
    args = ap.parse_args()
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        raise SystemExit(f"no GPU visible to torch {torch.__version__} (torch.version.cuda={torch.version.cuda})")
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if gpu else 'cpu'}", flush=True)

    sft_sizes = ["sft.steps=3", "sft.batch_size=2"] if args.tiny else []
    if args.sft_steps is not None:
        sft_sizes.append(f"sft.steps={args.sft_steps}")
    rl_sizes = (["rollout.max_turns=2", "rollout.max_new_tokens=24", "grpo.prompts_per_step=2", "grpo.group_size=2",
                 "grpo.micro_batch_size=2", "monitor.probe_size=4"] if args.tiny else [])
    sft_cfg = load_config("configs/smol/sft.yaml", [f"device={args.device}", "model.dtype=bfloat16", "threads=null",
                                                    "sft.val_every=1000", "sft.log_every=5"] + sft_sizes)
    t0 = time.time()
    sft_dir = run_sft(sft_cfg, out / "sft")
    sft_rows = read_jsonl(sft_dir / "metrics.jsonl")
    sft_s = time.time() - t0
    peak_sft = torch.cuda.max_memory_allocated() / 2**30 if gpu else float("nan")
    print(f"SFT bf16: {sft_cfg.sft.steps} steps x {sft_cfg.sft.batch_size} in {sft_s:.1f} s (load included); "
          f"loss {sft_rows[0]['loss']:.3f} -> {sft_rows[-1]['loss']:.3f}; peak GPU memory {peak_sft:.2f} GiB",
          flush=True)

    def rl(name: str, device: str, dtype: str, steps: int, extra: tuple[str, ...] = ()) -> tuple[list[dict], int]:
        """The run's metrics rows and its rollouts per step."""
        cfg = load_config("configs/smol/rl.yaml", [f"init={sft_dir}", f"device={device}", f"model.dtype={dtype}",
                                                   f"grpo.steps={steps}", "grpo.checkpoint_every=1000",
                                                   "monitor.probe_every=1", *extra] + rl_sizes)
        if device == "cpu":
            cfg = replace(cfg, threads=None)
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        run_rl(cfg, out / name)
        return read_jsonl(out / name / "metrics.jsonl"), cfg.grpo.prompts_per_step * cfg.grpo.group_size

    lean = lean_vs_model(sft_dir, args.device, args.tiny)
    print(f"decoding through lean_decode vs model(...), greedy, float32 on {args.device}: tokens identical "
          f"{lean['tokens_identical']}, max |log-prob diff| {lean['max_logprob_diff']:.3g} "
          f"(lean path taken: {lean['lean_ran']})", flush=True)
    rows, episodes = rl("rl_bf16", args.device, "bfloat16", args.rl_steps)
    peak = torch.cuda.max_memory_allocated() / 2**30 if gpu else float("nan")
    later = rows[1:] or rows  # the first step includes warm-up (kernels, allocator)
    tok_s = sum(r["response_tokens"] * episodes for r in later) / sum(r["seconds_rollout"] for r in later)
    print(f"RL bf16: {len(rows)} steps; step {_mean(later, 'seconds'):.2f} s (rollout "
          f"{_mean(later, 'seconds_rollout'):.2f} s, update {_mean(later, 'seconds_update'):.2f} s) after the first "
          f"({rows[0]['seconds']:.2f} s); sampled {tok_s:.0f} tok/s; peak GPU memory {peak:.2f} GiB; "
          f"reward {[round(r['reward_mean'], 3) for r in rows]}", flush=True)

    no_val = ("grpo.eval_every=0",)  # validation is not compared; on the CPU it would take minutes
    here = rl("rl_fp32_" + args.device, args.device, "float32", 1, no_val)[0][0]
    cpu = rl("rl_fp32_cpu", "cpu", "float32", 1, no_val)[0][0] if gpu else here
    print("first RL step, float32, same seed and init:")
    print(f"  {'metric':30s} {args.device:>12s} {'cpu':>12s} {'|diff|':>10s}")
    for key in COMPARED:
        if key in here and key in cpu:
            print(f"  {key:30s} {here[key]:12.6g} {cpu[key]:12.6g} {abs(here[key] - cpu[key]):10.3g}")
    same = here["reward_mean"] == cpu["reward_mean"] and here["response_tokens"] == cpu["response_tokens"]
    def near(key: str, tol: float) -> bool:  # a key absent on both sides (a skipped step, an empty slot) is no test
        if key not in here and key not in cpu:
            return True
        return key in here and key in cpu and abs(here[key] - cpu[key]) <= tol * max(1.0, abs(cpu[key]))

    close = near("loss", 1e-3) and near("entropy", 1e-3) and near("probe/im_end/miss_required", 1e-3)
    print(f"rewards equal: {same}; loss, entropy and probe close (1e-3): {close}")
    vacuous = cpu.get("frac_groups_informative", 0) == 0 or "loss" not in cpu
    if vacuous:
        print("the loss comparison is vacuous: no group had a reward spread, so the policy loss is 0 on any device "
              "(the entropy and the probe still compare the forwards)")
    (out / "summary.json").write_text(json.dumps({
        "device": args.device, "tiny": args.tiny, "sft_seconds": sft_s, "sft_peak_gib": peak_sft,
        "rl_step_seconds": _mean(later, "seconds"), "rl_sampled_tok_s": tok_s, "rl_peak_gib": peak,
        "first_step": {"here": {k: here.get(k) for k in COMPARED}, "cpu": {k: cpu.get(k) for k in COMPARED}},
        "rewards_equal": same, "close": close, "loss_comparison_vacuous": vacuous, "lean_decode": lean}, indent=2))


def lean_vs_model(checkpoint: Path, device: str, tiny: bool) -> dict:
    """Greedy rollouts of the SFT model in float32 on `device` with decoding through `rollout.lean_decode`
    and through model(...): the same tokens and log-probs (bit for bit on the CPU, tested)."""
    from toolcollapse import rollout
    from toolcollapse.envs import make_env
    from toolcollapse.evaluate import sampling_params
    from toolcollapse.model import load_model, load_tokenizer, place

    cfg = load_config("configs/smol/rl.yaml", [f"init={checkpoint}", f"device={device}"]
                      + (["rollout.max_turns=2", "rollout.max_new_tokens=24"] if tiny else []))
    model, env = place(load_model(checkpoint).eval(), torch.device(device)), make_env(cfg)
    engine = rollout.RolloutEngine(model, load_tokenizer(checkpoint), env)
    tasks = env.tasks("test")[:2 if tiny else 8]
    runs, took = {}, False
    for lean in (True, False):
        engine.lean_decoding = lean
        runs[lean] = engine.generate(tasks, sampling_params(cfg, greedy=True), group_size=2)
        took = took or engine.lean  # the lean run's decoding went through lean_decode
    diff = max((abs(a - b) for x, y in zip(runs[True], runs[False]) for a, b in zip(x.logprobs, y.logprobs)),
               default=0.0)
    return {"tokens_identical": [e.tokens for e in runs[True]] == [e.tokens for e in runs[False]],
            "max_logprob_diff": diff, "lean_ran": took}


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


if __name__ == "__main__":
    main()
