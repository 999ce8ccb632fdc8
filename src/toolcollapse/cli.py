"""Command line: `toolcollapse sft | eval`.

The CLI only parses arguments, builds the validated config and calls one library
function; a bad config or a missing path exits with status 2 before any work.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from toolcollapse.config import SPLITS, ConfigError, RunConfig, load_config


def _add_config_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--config", required=required, help="experiment YAML (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set sft.lr=3e-4 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toolcollapse", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("sft", help="train a model from scratch on oracle trajectories")
    _add_config_args(p, required=True)
    p.add_argument("--out", help="checkpoint directory (default: <out_dir>/sft)")

    p = sub.add_parser("eval", help="run the multi-turn loop on a split and score it")
    p.add_argument("checkpoint", help="checkpoint directory written by `toolcollapse sft`")
    p.add_argument("--split", choices=SPLITS, help="default: the config's eval.split (test)")
    p.add_argument("--n", type=int, dest="n_tasks", help="evaluate the first N tasks of the split")
    p.add_argument("--sample", action="store_true", help="sample (rollout.temperature) instead of greedy")
    p.add_argument("--out", help="per-task JSONL (default: CHECKPOINT/eval/<split>.jsonl)")
    _add_config_args(p, required=False)
    return parser


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
        overrides.append("eval.greedy=false")
    return load_config(source, overrides)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "sft":
            cfg = load_config(args.config, args.overrides)
        else:
            cfg = _eval_config(args)
    except ConfigError as err:
        print(f"toolcollapse: error: {err}", file=sys.stderr)
        return 2

    if args.command == "sft":
        from toolcollapse.sft import run_sft

        run_sft(cfg, args.out)
    elif args.command == "eval":
        from toolcollapse.evaluate import format_summary, run_eval

        summary = run_eval(args.checkpoint, cfg, args.out)
        print(format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
