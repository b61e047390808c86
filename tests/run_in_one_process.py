"""Run recipes/pretrain.py's main() once per argument list, all in this one process:

    python tests/run_in_one_process.py '["configs/a.yaml", "--run.output_dir=..."]' '[...]' ...

Each run is the recipe exactly as `python recipes/pretrain.py ARGS` runs it, minus the interpreter
start-up and imports (most of a tiny run's time), which is what lets one test train many model types.
Before each run a line `=== run N` is printed, after it `=== ok N` or `=== failed N: <error>`.
"""

import json
import runpy
import sys
import traceback
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "pretrain.py"

if __name__ == "__main__":
    main = runpy.run_path(str(RECIPE), run_name="recipe")["main"]
    for i, arg in enumerate(sys.argv[1:]):
        print(f"=== run {i}", flush=True)
        try:
            main(json.loads(arg))
        except Exception as err:  # noqa: BLE001 - reported per run, so one failure hides no other
            traceback.print_exc()
            print(f"=== failed {i}: {type(err).__name__}: {err}", flush=True)
        else:
            print(f"=== ok {i}", flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
