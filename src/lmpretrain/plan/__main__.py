"""python -m lmpretrain.plan CONFIG [--config_file ACCELERATE_YAML] [--num_processes N] [--num_machines M]
[--gpu NAME|FILE] [--memory_fraction 0.9] [--json PATH] [--sections NAME,...] [--section.field=value ...]"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import sys
from pathlib import Path

from lmpretrain.config import Config, load_config, read_config_file
from lmpretrain.errors import ConfigError, UserError
from lmpretrain.plan.hardware import PlanError, load_gpu
from lmpretrain.plan.launch import read_launch
from lmpretrain.plan.planner import format_plan, make_plan


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one message, exit 2, like every other bad input (not usage + error)
        raise PlanError(f"{message} (python -m lmpretrain.plan --help)")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m lmpretrain.plan", description=__doc__, allow_abbrev=False)
    p.add_argument("config")
    p.add_argument("--config_file", help="accelerate launch config (default: one process)")
    p.add_argument("--num_processes", type=int, help="total processes (GPUs) over all machines")
    p.add_argument("--num_machines", type=int)
    p.add_argument("--gpu", default="h100", help="a key of src/lmpretrain/gpus.yaml or a YAML file")
    p.add_argument("--memory_fraction", type=float, default=0.9)
    p.add_argument("--json", help="write the plan's numbers here")
    p.add_argument(
        "--sections",
        default="",
        help="a fork's own config sections in CONFIG (its recipe's cli(sections=...)), comma-separated: read as "
        "given, not simulated",
    )
    return p


def _check_overrides(overrides: list[str], options: list[str]) -> None:
    """Config overrides name a section (--section.field=value); anything else is a mistyped planner option."""
    for arg in overrides:
        key = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if key and "." not in key:
            near = difflib.get_close_matches(f"--{key}", options, n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]}?" if near else f"; the planner's options: {', '.join(options)}"
            raise PlanError(
                f"unknown option --{key}{hint} (config overrides look like --section.field=value)"
            )


def _fork_sections_hint(config: str) -> list[str]:
    """What to do about the config's top-level sections that are not lmpretrain's: a fork's are named."""
    try:
        data = read_config_file(Path(config))
    except ConfigError:
        return []
    builtin = {f.name for f in dataclasses.fields(Config)}
    unknown = [k for k, v in data.items() if k not in builtin and isinstance(v, dict)]
    if not unknown:
        return []
    names = ",".join(unknown)
    return [
        f"config sections {names} are not lmpretrain's; a fork's own (its recipe's cli(sections=...)) are read "
        f"with --sections {names}"
    ]


def main(argv: list[str]) -> int:
    cli = parser()
    try:
        args, overrides = cli.parse_known_args(argv)
        _check_overrides(overrides, [o for a in cli._actions for o in a.option_strings if o.startswith("--")])
        gpu = load_gpu(args.gpu)
        launch = read_launch(args.config_file, args.num_processes, args.num_machines)
        sections = {name: dict for name in args.sections.split(",") if name}
        try:
            cfg = load_config([args.config, *overrides], sections=sections)
        except ConfigError as err:
            raise ConfigError(err.problems + _fork_sections_hint(args.config), source=args.config) from None
        plan = make_plan(cfg, launch, gpu, args.memory_fraction)
    except UserError as err:
        print(f"[lmpretrain] plan: {err}", file=sys.stderr)
        return err.exit_code
    print(format_plan(plan))
    if args.json:
        Path(args.json).write_text(json.dumps(plan.to_json(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
