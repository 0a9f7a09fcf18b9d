#!/usr/bin/env python3
"""Measures how often nvitop-exporter really refreshes its gauges.

nvitop-exporter sets `host_uptime` (seconds since boot, read at update time) on every
update loop, so consecutive distinct values differ by the real loop period — which is
longer than --interval when one loop's NVML calls take longer than the interval.
Polls /metrics every 50 ms for SECONDS and prints the mean period in seconds, then,
on a second line, the range of `gpu_utilization` seen per GPU index (to check that the
peer reads real, changing per-GPU values from the fake).

Usage: peer_period.py URL [SECONDS]
"""

import collections
import re
import sys
import time
import urllib.request


def main() -> None:
    url = sys.argv[1]
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 4.0
    values = []
    util = collections.defaultdict(list)
    uptime = re.compile(r"^host_uptime(_Second)?[{ ]")
    gpu = re.compile(r'^gpu_utilization(_Percentage)?{.*index="([^"]+)"')
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        for line in body.splitlines():
            if uptime.match(line):
                v = float(line.rsplit(" ", 1)[1])
                if not values or v != values[-1]:
                    values.append(v)
            elif m := gpu.match(line):
                util[m.group(2)].append(float(line.rsplit(" ", 1)[1]))
        time.sleep(0.05)
    # the first value may predate the poll; use the changes seen
    print(f"{(values[-1] - values[1]) / (len(values) - 2):.3f}" if len(values) >= 3 else "nan")
    print(" ".join(f"gpu{i}:{min(v):g}-{max(v):g}" for i, v in sorted(util.items(), key=lambda kv: int(kv[0]))))


if __name__ == "__main__":
    main()
