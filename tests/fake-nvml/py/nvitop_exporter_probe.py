"""Runs nvitop-exporter (pip install nvitop-exporter) in-process against the fake
for a few seconds, scrapes it once, and reports which NVML symbols it looked up
and which were missing. Run through run-pynvml-check.sh's setup, e.g.:

    LD_LIBRARY_PATH=<dir with libnvidia-ml.so.1> FAKE_NVML_TRACE=errors \\
        python3 nvitop_exporter_probe.py

FAKE_NVML_TRACE=errors adds the library's own log of calls that returned errors."""

import collections
import sys
import threading
import time
import urllib.request

import pynvml

looked_up = collections.Counter()
missing = set()
_orig = pynvml._nvmlGetFunctionPointer


def _traced(name):
    looked_up[name] += 1
    try:
        return _orig(name)
    except pynvml.NVMLError:
        missing.add(name)
        raise


pynvml._nvmlGetFunctionPointer = _traced

from nvitop_exporter import cli  # noqa: E402  (after the hook)

PORT = 18765
sys.argv = ["nvitop-exporter", "--port", str(PORT), "--interval", "0.5"]
threading.Thread(target=cli.main, daemon=True).start()
time.sleep(4)
body = urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics").read().decode()
series = [line for line in body.splitlines() if line and not line.startswith("#")]
print(f"series: {len(series)}")
for line in series:
    if line.startswith(("gpu_utilization", "gpu_memory_used", "gpu_power_usage")):
        print(" ", line)
print("missing symbols:", sorted(missing))
print("functions used:", sorted(looked_up))
