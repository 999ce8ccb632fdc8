"""Command line: `toolcollapse sft | eval | rl | sweep | study | report | diagnose | probe | world`.

The CLI only parses arguments, builds the validated config and calls one library
function; a bad config or a missing path exits with status 2 before any work. Each command imports its
library module inside its function, the only such imports in the package: `--help` and a refused config
answer in a tenth of a second, without loading torch or transformers (seconds).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from toolcollapse.config import SPLITS, ConfigError, MonitorConfig, RunConfig, load_config, rl_start_problems
from toolcollapse.runtime import NotTextError


def _add_config_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--config", required=required, help="experiment YAML (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set sft.lr=3e-4 (repeatable)")


def _add_backend_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("local", "ray"), help="where the runs go: a local process pool "
                   "(default) or a Ray cluster (ray_address in the file; none: a local Ray); same as --set backend=...")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toolcollapse", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("sft", help="train a model (from scratch, or a pretrained model.source) on oracle "
                       "trajectories", description="Takes a run config (configs/tiny.yaml, configs/smol/sft.yaml); "
                       "writes a checkpoint to --out: the weights (save_pretrained), the tokenizer, toolcollapse.yaml "
                       "(the config), metrics.jsonl (loss and validation) and the SFT_COMPLETE marker (docs/OUTPUTS.md).")
    _add_config_args(p, required=True)
    p.add_argument("--out", help="checkpoint directory (default: <out_dir>/sft)")
    p.add_argument("--overwrite", action="store_true", help="replace the run already in that directory")

    p = sub.add_parser("rl", help="GRPO from a checkpoint, or continue a run with --resume",
                       description="Takes a run config and a checkpoint (--init, or the config's init); writes the "
                       "run directory: config.yaml, metrics.jsonl (one row a step), samples.jsonl, alarms.jsonl, "
                       "checkpoints/step_NNNNNN/ (each one `eval` reads), tb/ (docs/OUTPUTS.md). SIGTERM or Ctrl-C "
                       "saves a checkpoint after the step; --resume continues.")
    _add_config_args(p, required=False)
    p.add_argument("--init", help="checkpoint to start from (and to use as the KL reference)")
    p.add_argument("--out", help="run directory (default: <out_dir>/rl)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    p.add_argument("--allow-change", metavar="KEY[,KEY]", help="with --resume: config keys that may differ from the "
                   "ones the checkpoint was saved with (edited in RUN_DIR/config.yaml); any other difference is refused")
    p.add_argument("--overwrite", action="store_true", help="replace the run already in the run directory")

    p = sub.add_parser("sweep", help="run a sweep file (settings x seeds) and print the collapse table",
                       description="Takes a sweep YAML; writes <out_dir>/<setting>/seed<N>/ (an rl run directory "
                       "each) and prints the collapse table. Run it again to finish an interrupted sweep.")
    p.add_argument("sweep_file", help="sweep YAML (see configs/study/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a sweep field, e.g. --set workers=1")
    p.add_argument("--summary-only", action="store_true", help="print the table of the runs already there")
    p.add_argument("--only", metavar="SETTING[,SETTING]", help="run (and tabulate) these settings only; "
                   "the others' runs stay as they are")
    _add_backend_arg(p)

    p = sub.add_parser("study", help="the whole study: SFT (or reuse it), the sweep, the evaluations, the report; "
                       "run it again to finish an interrupted one",
                       description="Takes a study YAML; writes the start's SFT checkpoint (init, when missing), "
                       "<out_dir>/start/eval/, a run directory per setting and seed with its final checkpoint's "
                       "eval/, selection.json (the tries chosen on val), provenance.json and <out_dir>/report/ "
                       "(report.md, report.html, figures/; docs/OUTPUTS.md).")
    p.add_argument("study_file", help="study YAML (configs/study/quick.yaml, paper.yaml, full.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a study field, e.g. --set workers=1")
    _add_backend_arg(p)

    p = sub.add_parser("report", help="the report (tables, figures, findings checklist) of a study's runs")
    p.add_argument("path", help="a study or sweep YAML, or a study's output directory")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a study field, e.g. --set 'seeds=[1]' (a report of one seed's runs)")
    p.add_argument("--out", help="where report.md, report.html and figures/ go (default: <out_dir>/report)")

    p = sub.add_parser("diagnose", help="alarms, collapse step and figures of a run; the lead-time table of a "
                       "sweep; four-state rates of another trainer's dumped rollouts")
    p.add_argument("path", help="a run directory (ours, or a TRL GRPOTrainer output directory with the "
                                "ControlTokenCallback's logs), a sweep YAML (configs/study/), or a dump of rollouts "
                                "(JSONL of conversations, TRL completions table, verl rollout dump)")
    p.add_argument("--tokenizer", help="a dump's tokenizer: a local directory (e.g. the policy checkpoint)")
    p.add_argument("--format", dest="dump_format", default="auto", choices=("auto", "conversations", "trl", "verl"),
                   help="a dump's format (default: detected from its fields)")
    p.add_argument("--tools", help="a dump's tool specs (JSON list): enables the unknown-tool and argument checks")
    p.add_argument("--batch-size", type=int, help="a dump without steps: rollouts per step (default: one step)")
    p.add_argument("--out", help="where summary.json and the figures go (default: RUN_DIR/diagnose)")
    p.add_argument("--no-figures", action="store_true", help="skip the PNG figures")
    p.add_argument("--baseline-warmup", type=int, default=None,
                   help="warm-up (observations) of the detectors on the baseline series (default 5)")

    p = sub.add_parser("probe", help="what the monitor's probe set would watch in your own conversations",
                       description="Takes JSON-lines chat conversations ({\"messages\": [...]}, assistant "
                       "tool_calls and tool messages; toolcollapse.conversations) and the policy's tokenizer; "
                       "prints the probe's positions per slot and content kind (the alarms' inputs). Writes "
                       "nothing. examples/trl_grpo.py --probe-data FILE builds the same probe.")
    p.add_argument("conversations", help="a JSON-lines file of conversations")
    p.add_argument("--tokenizer", required=True, help="the policy's tokenizer directory (a checkpoint)")
    p.add_argument("--size", type=int, default=MonitorConfig.probe_size,
                   help=f"conversations in the probe (monitor.probe_size, default {MonitorConfig.probe_size})")

    p = sub.add_parser("world", help="describe the environment and replay its oracle trajectories")
    p.add_argument("--show", type=int, default=1, help="print N example tasks of each split")
    _add_config_args(p, required=False)

    p = sub.add_parser("eval", help="run the multi-turn loop on a split and score it")
    p.add_argument("checkpoint", help="a checkpoint directory: `toolcollapse sft`'s output, an RL run's "
                   "checkpoints/step_000100, or any local HF model with our chat tags")
    p.add_argument("--split", choices=SPLITS, help="default: the config's eval.split (test)")
    p.add_argument("--n", type=int, dest="n_tasks", help="evaluate the first N tasks of the split")
    p.add_argument("--sample", nargs="?", type=_positive, const=1, metavar="K",
                   help="sample K episodes per task (default 1) at rollout.temperature instead of greedy")
    p.add_argument("--out", help="per-task JSONL (default: CHECKPOINT/eval/<split>.jsonl)")
    _add_config_args(p, required=False)
    return parser


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of samples >= 1, got {text!r}")
    return int(text)


def _eval_config(args: argparse.Namespace) -> RunConfig:
    ckpt = Path(args.checkpoint)
    if not ckpt.is_dir():
        raise ConfigError(f"checkpoint directory not found: {ckpt}")
    saved = ckpt / "toolcollapse.yaml"
    source = args.config or (saved if saved.is_file() else None)
    overrides = list(args.overrides)
    if args.split:
        overrides.append(f"eval.split={args.split}")
    if args.n_tasks is not None:
        overrides.append(f"eval.n_tasks={args.n_tasks}")
    if args.sample:
        overrides += ["eval.greedy=false", f"eval.samples={args.sample}"]
    return load_config(source, overrides)


def _rl_config(args: argparse.Namespace) -> tuple[RunConfig, Path]:
    if args.resume:
        if args.config or args.init or args.overwrite:
            raise ConfigError("--resume continues a run with its saved config; drop --config, --init and --overwrite")
        run_dir = Path(args.resume)
        from toolcollapse.rundir import resume_config

        cfg = resume_config(run_dir)
        if args.overrides:
            raise ConfigError("--resume takes no --set: the run continues with the config it started with")
        from toolcollapse.rundir import check_run_start

        check_run_start(cfg, run_dir, resume=True, overwrite=False, allow_change=_allowed(args))
        return cfg, run_dir
    if not args.config:
        raise ConfigError("rl needs --config (or --resume RUN_DIR)")
    overrides = list(args.overrides) + ([f"init={args.init}"] if args.init else [])
    cfg = load_config(args.config, overrides)
    if cfg.init is None:
        raise ConfigError("rl needs a starting checkpoint: --init CHECKPOINT (or init: in the config)")
    if not (Path(cfg.init) / "config.json").is_file():
        raise ConfigError(f"init checkpoint not found: {cfg.init} (no config.json there)")
    run_dir = Path(args.out) if args.out else Path(cfg.out_dir) / "rl"
    problems = rl_start_problems(cfg)  # before rundir's imports (torch, transformers: seconds)
    if problems:
        raise ConfigError(problems[0])
    from toolcollapse.rundir import check_run_start

    check_run_start(cfg, run_dir, resume=False, overwrite=args.overwrite)
    return cfg, run_dir


def _allowed(args: argparse.Namespace) -> list[str]:
    return [k.strip() for k in (args.allow_change or "").split(",") if k.strip()]


def _describe_world(cfg: RunConfig, show: int) -> None:
    from collections import Counter

    from toolcollapse.chat import render_text
    from toolcollapse.envs import make_env
    from toolcollapse.evaluate import replay_references

    env = make_env(cfg)
    for split in env.splits:
        if split in getattr(env, "carved", ()):  # train tasks past the SFT pool (replayed with train)
            try:
                print(f"{split}: {len(env.tasks(split))} train tasks past world.sft_pool={cfg.world.sft_pool}")
            except ConfigError as err:
                print(f"{split}: none ({err})")
            continue
        tasks = env.tasks(split)
        replay = replay_references(env, tasks, split, cfg.rollout.call_end)
        calls = Counter(t.meta.get("n_calls") for t in tasks)
        print(f"{split}: {len(tasks)} tasks, calls per task {dict(sorted(calls.items()))}; oracle replay: "
              f"success {replay.success_rate:.1%}, healthy turns {replay.healthy_rate:.1%} "
              f"({replay.n_turns} turns, {len(replay.failures)} failures)")
        for task in tasks[:show]:
            text = render_text(list(task.prompt[1:]) + list(task.reference))
            print("    " + text.replace("\n", "\n    "))


def _diagnose(args: argparse.Namespace) -> int:
    from toolcollapse import diagnose

    path = Path(args.path)
    if path.is_dir() and any((path / f).is_file() for f in ("metrics.jsonl", "config.yaml", "monitor.jsonl")):
        d = diagnose.diagnose_run(path, args.out, figures=not args.no_figures)
        print(diagnose.format_run(d))
        out = Path(args.out) if args.out else path / "diagnose"
        figures = sorted(p.name for p in out.glob("*.png")) if not args.no_figures else []
        print(f"wrote {out}/summary.json" + (f" and {', '.join(figures)}" if figures else ""))
    elif path.suffix in (".yaml", ".yml"):
        from toolcollapse.sweep import load_sweep

        _, specs = load_sweep(path)
        print(diagnose.format_sweep(specs, args.baseline_warmup or diagnose.BASELINE_WARMUP))
    elif path.exists():
        if not args.tokenizer:
            raise ConfigError(f"{path} is not a run directory; as a dump of rollouts it needs the tokenizer it was "
                              f"sampled with: --tokenizer DIR")
        if not Path(args.tokenizer).is_dir():
            raise ConfigError(f"tokenizer directory not found: {args.tokenizer}")
        print(diagnose.autopsy_dump(path, args.tokenizer, args.dump_format, args.tools, args.batch_size, args.out,
                                    figures=not args.no_figures))
    else:
        raise ConfigError(f"not found: {path} (expected a run directory, a sweep YAML or a dump file)")
    return 0


def _probe(args: argparse.Namespace) -> int:
    from toolcollapse.chat import CONTROL_TAGS
    from toolcollapse.conversations import conversation_probe, describe_probe, read_conversations
    from toolcollapse.model import load_tokenizer

    if not Path(args.tokenizer).is_dir():
        raise ConfigError(f"tokenizer directory not found: {args.tokenizer}")
    conversations = read_conversations(args.conversations)
    tokenizer = load_tokenizer(args.tokenizer)
    missing = [t for t in CONTROL_TAGS if t not in tokenizer.get_vocab()]
    if missing:  # as ready_for_chatml adds them to the policy (here to the tokenizer alone: nothing is saved)
        tokenizer.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
        print(f"the tokenizer lacks {' '.join(missing)}: added here as ready_for_chatml would add them to the policy")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    probe = conversation_probe(conversations, tokenizer, MonitorConfig(probe_size=args.size))
    print(f"{args.conversations}: {len(conversations)} conversations")
    print("\n".join(describe_probe(probe)))
    return 0


def _with_backend(args: argparse.Namespace) -> list[str]:
    return list(args.overrides) + ([f"backend={args.backend}"] if args.backend else [])


def _prepare(args: argparse.Namespace) -> Callable[[], None]:
    """Validate everything the command needs -- config, paths, packages, its output directory --
    and return the work itself; a ConfigError here means nothing was done."""
    if args.command == "sweep":
        from toolcollapse.sweep import eval_splits, load_sweep, run_sweep
        from toolcollapse.sweep_table import format_method_table, format_table, start_success, summarize_runs

        from toolcollapse.study import StudyConfig

        sweep, specs = load_sweep(args.sweep_file, _with_backend(args), cls=StudyConfig)  # a study file's grid too
        tried = [name for name, sets in sweep.settings.items() if isinstance(sets, dict) and "tries" in sets]
        if tried and not args.summary_only:
            raise ConfigError(f"settings {', '.join(tried)} have tries, which `toolcollapse study "
                              f"{args.sweep_file}` chooses on {sweep.select_split} and then runs; a sweep would "
                              "run only their first seed and no control that matches them")
        if args.only:
            chosen = args.only.split(",")
            unknown = sorted(set(chosen) - {s.setting for s in specs})
            if unknown:
                raise ConfigError(f"--only: {unknown[0]!r} is not a setting of {args.sweep_file}")
            specs = [s for s in specs if s.setting in chosen]

        def run_and_summarize() -> None:
            if not args.summary_only:
                run_sweep(sweep, specs)
            rows = summarize_runs(sweep, specs)
            print(format_table(rows))
            print()
            print(format_method_table(rows, eval_splits(sweep), start_success(sweep)))
        return run_and_summarize
    if args.command == "study":
        from toolcollapse.study import plan_study, run_study

        plan = plan_study(args.study_file, _with_backend(args))
        return lambda: run_study(plan)
    if args.command == "report":
        from toolcollapse.study import report

        return lambda: print(f"wrote {report(args.path, args.overrides, args.out)} and report.html")
    if args.command == "rl":
        cfg, run_dir = _rl_config(args)
    elif args.command == "eval":
        cfg = _eval_config(args)
    else:
        cfg = load_config(args.config, args.overrides)
    if args.command == "sft":
        from toolcollapse.runtime import check_new_run_dir, check_writable, lock_dir

        out = Path(args.out) if args.out else Path(cfg.out_dir) / "sft"
        lock_dir(out, "sft run")  # before --overwrite may clear anything; held until the process ends
        check_new_run_dir(out, args.overwrite, "sft")
        check_writable(out, 64 << 20)
    from toolcollapse.envs import check_env
    from toolcollapse.sources import check_lora, check_source

    check_env(cfg)  # a missing package, model or data
    check_lora(cfg.model.lora)
    from toolcollapse.model import resolve_device

    resolve_device(cfg.device)  # a GPU asked for that is not there
    if args.command == "sft":
        from toolcollapse.sft import run_sft

        check_source(cfg.model.source)
        return lambda: run_sft(cfg, args.out, overwrite=args.overwrite)
    if args.command == "rl":
        from toolcollapse.rl import run_rl

        return lambda: run_rl(cfg, run_dir, resume=bool(args.resume), overwrite=args.overwrite,
                              allow_change=_allowed(args))
    if args.command == "eval":
        from toolcollapse.evaluate import format_summary, run_eval

        return lambda: print(format_summary(run_eval(args.checkpoint, cfg, args.out)))
    return lambda: _describe_world(cfg, args.show)


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # SIGTERM outside a run's loop: end cleanly (finally blocks, no traceback)


def main(argv: list[str] | None = None) -> int:
    import signal

    args = build_parser().parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        work = {"diagnose": lambda: _diagnose(args), "probe": lambda: _probe(args)}.get(args.command) or _prepare(args)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards" bars on every checkpoint
        work()  # a corrupt checkpoint found while loading is a ConfigError too (model.CheckpointError)
    except (ConfigError, NotTextError) as err:
        print(f"toolcollapse: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("toolcollapse: interrupted (a run continues from its last checkpoint with --resume; a study or sweep "
              "with the same command)", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
