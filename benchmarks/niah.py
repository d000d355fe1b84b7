"""Needle-in-a-haystack through the reference decoder: ``benchmarks.quality`` with ``--tasks niah``.

    python -m benchmarks.niah --methods am-highest-attn-fast,kvzip --ratios 0.1,0.05,0.02 \
        --instances 12 --out benchmarks/results/niah.json

Kept for the commands quoted in benchmarks/README.md; every flag of ``benchmarks.quality`` applies.
"""

from __future__ import annotations

from benchmarks.quality import RESULTS, main

if __name__ == "__main__":
    main(tasks="niah", out=str(RESULTS / "niah.json"))
