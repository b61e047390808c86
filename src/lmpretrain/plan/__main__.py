"""python -m lmpretrain.plan CONFIG [--config_file ACCELERATE_YAML] [--num_processes N] [--num_machines M]
[--gpu NAME|FILE] [--memory_fraction 0.9] [--json PATH] [--section.field=value ...]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lmpretrain.config import load_config
from lmpretrain.errors import UserError
from lmpretrain.plan.hardware import load_gpu
from lmpretrain.plan.launch import read_launch
from lmpretrain.plan.planner import format_plan, make_plan


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmpretrain.plan", description=__doc__)
    parser.add_argument("config")
    parser.add_argument("--config_file", help="accelerate launch config (default: one process)")
    parser.add_argument("--num_processes", type=int, help="total processes (GPUs) over all machines")
    parser.add_argument("--num_machines", type=int)
    parser.add_argument("--gpu", default="h100", help="a key of src/lmpretrain/plan/gpus.yaml or a YAML file")
    parser.add_argument("--memory_fraction", type=float, default=0.9)
    parser.add_argument("--json", help="write the plan's numbers here")
    args, overrides = parser.parse_known_args(argv)
    try:
        gpu = load_gpu(args.gpu)
        launch = read_launch(args.config_file, args.num_processes, args.num_machines)
        cfg = load_config([args.config, *overrides])
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
