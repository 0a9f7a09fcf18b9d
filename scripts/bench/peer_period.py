#!/usr/bin/env python3
"""Measures how often nvitop-exporter really refreshes its gauges.

nvitop-exporter sets `host_uptime` (seconds since boot, read at update time) on every
update loop, so consecutive distinct values differ by the real loop period — which is
longer than --interval when one loop's NVML calls take longer than the interval.
Polls /metrics every 50 ms for SECONDS and prints the mean period in seconds.

Usage: peer_period.py URL [SECONDS]
"""

import sys
import time
import urllib.request


def main() -> None:
    url = sys.argv[1]
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 4.0
    values = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        for line in body.splitlines():
            if line.startswith("host_uptime") and not line.startswith("host_uptime_"):
                v = float(line.rsplit(" ", 1)[1])
                if not values or v != values[-1]:
                    values.append(v)
                break
        time.sleep(0.05)
    if len(values) < 3:
        print("nan")
        return
    # the first value may predate the poll; use the changes seen
    print(f"{(values[-1] - values[1]) / (len(values) - 2):.3f}")


if __name__ == "__main__":
    main()
