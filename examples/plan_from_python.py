"""``reshard plan`` from Python: what a layout change costs on a described
cluster, for reshard and for gather-and-broadcast, before renting the GPUs.

    python examples/plan_from_python.py
"""

from __future__ import annotations

import sys

from reshard.costmodel.report import plan_report


def main() -> int:
    # Llama-3-8B trained with FSDP over 16 GPUs, served by 4 vLLM replicas of TP=4, on DGX H100 nodes.
    report = plan_report(model="llama3-8b", trainer="fsdp=16", engine="tp=4,dp=4", cluster="dgx-h100")
    print(report.table())
    d = report.data  # the same numbers as `reshard plan --json`
    print(
        f"OK: reshard is estimated {d['speedup']:.1f}x faster than gather-and-broadcast for this layout change, "
        f"moving {d['reshard']['network_bytes'] / 1e9:.1f} GB over the network instead of "
        f"{d['gather_broadcast']['network_bytes'] / 1e9:.1f} GB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
