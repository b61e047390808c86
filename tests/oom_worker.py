"""Run recipes/pretrain.py's main() in this process under an address-space limit, then print its peak:

    python tests/oom_worker.py LIMIT_BYTES '["configs/smoke.yaml", "--run.output_dir=...", ...]'

LIMIT_BYTES (0: none) is set with RLIMIT_AS after the imports, so an allocation past it fails for real
(torch's CPU allocator raises "can't allocate memory"). Prints `vm_peak=<bytes>` (VmPeak) at the end.
"""

import json
import resource
import runpy
import sys
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "pretrain.py"


def vm_peak() -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmPeak:"))
    return int(line.split()[1]) * 1024


if __name__ == "__main__":
    main = runpy.run_path(str(RECIPE), run_name="recipe")["main"]
    limit = int(sys.argv[1])
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    main(json.loads(sys.argv[2]))
    print(f"vm_peak={vm_peak()}", flush=True)
