#!/usr/bin/env python3
"""A real OTLP peer for Apron's POST /v1/metrics: the OpenTelemetry Python SDK with its
OTLP/HTTP (protobuf) exporter, exporting dcgm-exporter-named gauges as an OpenTelemetry
Collector would forward them from a dcgm-exporter scrape.

    python3 tests/otlp/send_dcgm.py ENDPOINT TOKEN VALUE...

Exports once per VALUE (DCGM_FI_DEV_GPU_UTIL of GPU "GPU-OTLP" at that percent, 1 GiB
framebuffer in use), one second apart; exits non-zero if an export fails.
"""

import sys
import time

from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricExportResult
from opentelemetry.sdk.resources import Resource


def main() -> int:
    endpoint, token, values = sys.argv[1], sys.argv[2], [float(v) for v in sys.argv[3:]]
    exporter = OTLPMetricExporter(endpoint=endpoint, headers={"Authorization": f"Bearer {token}"})
    reader = InMemoryMetricReader()
    provider = MeterProvider(resource=Resource.create({"host.name": "otlp-node"}), metric_readers=[reader])
    meter = provider.get_meter("dcgm-exporter-via-collector")
    attrs = {"gpu": "0", "UUID": "GPU-OTLP", "modelName": "NVIDIA H100 80GB HBM3", "pod": "train-x", "namespace": "ml"}
    current = {"v": 0.0}
    meter.create_observable_gauge("DCGM_FI_DEV_GPU_UTIL", callbacks=[lambda _o: [Observation(current["v"], attrs)]])
    meter.create_observable_gauge("DCGM_FI_DEV_FB_USED", callbacks=[lambda _o: [Observation(1024, attrs)]])
    for i, v in enumerate(values):
        if i:
            time.sleep(1.0)
        current["v"] = v
        data = reader.get_metrics_data()
        result = exporter.export(data)
        if result != MetricExportResult.SUCCESS:
            print(f"export {i} failed: {result}", file=sys.stderr)
            return 1
        print(f"exported {v}")
    exporter.shutdown()
    provider.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
