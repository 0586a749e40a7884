"""The host time of an eager INT8 call (`bench_launch_overhead.py`, kernels excluded) on this checkout's code against
another checkout's (an earlier commit), the two run alternately in fresh processes, so that a slow spell of a
shared machine hits both alike; the median of each call's chosen-config figure over the alternations.

    .venv/bin/python bench/bench_launch_overhead_ab.py --before /path/to/checkout [--runs 7] [--out FILE]

The other checkout runs this checkout's `bench_launch_overhead.py` (copied there for the run), so both sides
measure alike; it needs this checkout's .venv and ComfyUI (linked there when missing).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "bench"))

from common import write_table  # noqa: E402

BENCH = "bench/bench_launch_overhead.py"
RUN_NAME = "launch_overhead_ab_run"
CHOSEN_COLUMN = "chosen config (us)"


def _chosen_figures(checkout: Path, calls: int) -> dict[str, float]:
    """One run of the bench in `checkout`: {call: chosen-config us} from the table it writes."""
    subprocess.run([str(REPO_ROOT / ".venv" / "bin" / "python"), BENCH, "--calls", str(calls), "--rounds", "1",
                    "--out", RUN_NAME], cwd=checkout, check=True, capture_output=True)  # fmt: skip
    table = checkout / "bench" / "results" / f"{RUN_NAME}.md"
    lines = [line for line in table.read_text().splitlines() if line.startswith("|")]
    table.unlink()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    column = header.index(CHOSEN_COLUMN)
    figures = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == len(header):
            figures[cells[0]] = float(cells[column])
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the earlier code")
    parser.add_argument("--label", default=None, help="how the table names the earlier code (default: its commit)")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10000)
    parser.add_argument("--out", default="launch_overhead_ab")
    args = parser.parse_args()
    before = args.before.resolve()
    shutil.copy(REPO_ROOT / BENCH, before / BENCH)
    for shared in (".venv", ".comfyui"):
        if not (before / shared).exists():
            (before / shared).symlink_to(REPO_ROOT / shared)
    label = args.label or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=before, capture_output=True,
                                         text=True).stdout.strip()  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for _ in range(args.runs):
        runs["before"].append(_chosen_figures(before, args.calls))
        runs["after"].append(_chosen_figures(REPO_ROOT, args.calls))
    rows = []
    for call in runs["before"][0]:
        earlier, now = (statistics.median(run[call] for run in runs[side]) for side in ("before", "after"))
        rows.append([call, f"{earlier:.1f}", f"{now:.1f}", f"{earlier / now:.2f}x"])
    sys.path.insert(0, str(REPO_ROOT))
    from harness.comfy_host import load_pack

    load_pack()
    from common import cpu_line

    write_table(args.out, f"Host time of an eager INT8 call, kernels excluded: {label} against this commit",
                ["call", f"{label} (us)", "this commit (us)", "ratio"], rows,
                [f"Machine: {cpu_line()}.",
                 f"bench/bench_launch_overhead.py's chosen-config figure per call (the JIT launch replaced by a "
                 f"stand-in that works out the grid; no GPU), median over {args.runs} runs of each side, the two "
                 f"run alternately in fresh processes, {args.calls} calls per run."])
    return 0


if __name__ == "__main__":
    sys.exit(main())
