"""Plan a run before renting it: one simulated optimizer step of a config, as rank 0 of any world size.

    python -m lmpretrain.plan configs/llama-1b.yaml --config_file configs/accelerate/fsdp.yaml \\
        --num_processes 64 --num_machines 8 --gpu h100 --json plan.json

`make_plan` loads the config as the recipe does, simulates one step (simulate.py: FakeTensorMode and a
fake process group, memory from torch's MemTracker/FSDPMemTracker, FLOPs from FlopCounterMode, bytes per
collective from a CommDebugMode), times it on a roofline (roofline.py) against a GPU of the table
(lmpretrain/gpus.yaml) and finds the largest micro-batch that fits. docs/planning.md shows the plans.

The pieces live in their modules (planner, simulate, roofline, hardware, launch, collectives); this
package imports none of them, so the recipe's CUDA pre-flight (preflight.py) costs nothing on the CPU.
"""
