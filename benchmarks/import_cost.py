"""What ``import zerokit`` costs over ``import torch``: CPU time (user + system), wall time and
peak resident memory of a fresh interpreter, the median of several runs taken in turn (each
pair back to back, so a loaded machine slows both alike).

    python benchmarks/import_cost.py --runs 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

_REPORT = (
    "; import resource as r; u = r.getrusage(r.RUSAGE_SELF); "
    "print(u.ru_utime + u.ru_stime, u.ru_maxrss)"
)
IMPORTS = ("import torch", "import torch, zerokit")


def one_run(code: str) -> tuple[float, float, float]:
    """(CPU seconds, wall seconds, peak RSS in MiB) of ``python -c code``."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code + _REPORT], capture_output=True, text=True, check=True
    )
    cpu, rss_kib = done.stdout.split()[-2:]
    return float(cpu), time.perf_counter() - start, int(rss_kib) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each import (default 5)")
    args = parser.parse_args()
    runs: dict[str, list[tuple[float, float, float]]] = {code: [] for code in IMPORTS}
    for _ in range(args.runs):
        for code in IMPORTS:
            runs[code].append(one_run(code))
    median = {c: [statistics.median(r[k] for r in runs[c]) for k in range(3)] for c in IMPORTS}
    for code in IMPORTS:
        cpu, wall, rss = median[code]
        print(f"{code:24} cpu {cpu:5.2f} s   wall {wall:5.2f} s   peak RSS {rss:4.0f} MiB")
    (cpu0, wall0, rss0), (cpu1, wall1, rss1) = median[IMPORTS[0]], median[IMPORTS[1]]
    print(
        f"{'zerokit over torch':24} cpu {cpu1 - cpu0:+5.2f} s   wall {wall1 - wall0:+5.2f} s"
        f"   peak RSS {rss1 - rss0:+4.0f} MiB"
    )


if __name__ == "__main__":
    main()
