"""Loads the fake through NVIDIA's own Python bindings (nvidia-ml-py, module
pynvml), an ABI check independent of the Rust bindings. Run it with
run-pynvml-check.sh, which puts a libnvidia-ml.so.1 symlink on LD_LIBRARY_PATH."""

import time

import pynvml as n


def main():
    n.nvmlInit()
    assert n.nvmlSystemGetDriverVersion() == "570.172.08"
    count = n.nvmlDeviceGetCount()
    assert count == 2, count
    for i in range(count):
        h = n.nvmlDeviceGetHandleByIndex(i)
        name = n.nvmlDeviceGetName(h)
        util = n.nvmlDeviceGetUtilizationRates(h)
        mem = n.nvmlDeviceGetMemoryInfo(h)
        mem2 = n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)
        assert name == "NVIDIA H100 80GB HBM3", name
        assert 0 <= util.gpu <= 100 and 0 <= util.memory <= 100
        assert mem.total == 81559 * 2**20 and mem.used == mem2.used + mem2.reserved
        _, samples = n.nvmlDeviceGetSamples(h, n.NVML_GPU_UTILIZATION_SAMPLES, 0)
        assert samples and all(0 < s.sampleValue.uiVal <= 100 for s in samples)
        procs = n.nvmlDeviceGetComputeRunningProcesses(h)
        putil = n.nvmlDeviceGetProcessUtilization(h, 0)
        assert {p.pid for p in putil} <= {p.pid for p in procs}
        fv = n.nvmlDeviceGetFieldValues(h, [n.NVML_FI_DEV_MEMORY_TEMP, (n.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0xFFFFFFFF)])
        assert all(v.nvmlReturn == 0 for v in fv)
        print(f"{i} {name} util={util.gpu}/{util.memory} used={mem.used >> 20} MiB "
              f"samples={len(samples)} procs={[p.pid for p in procs]}")
    # GPM through pynvml's own struct layout.
    h = n.nvmlDeviceGetHandleByIndex(0)
    assert n.nvmlGpmQueryDeviceSupport(h).isSupportedDevice == 1
    s1 = n.nvmlGpmSampleGet(h, n.nvmlGpmSampleAlloc())
    time.sleep(0.3)
    s2 = n.nvmlGpmSampleGet(h, n.nvmlGpmSampleAlloc())
    req = n.c_nvmlGpmMetricsGet_t()
    req.version = n.NVML_GPM_METRICS_GET_VERSION
    req.numMetrics = 2
    req.sample1, req.sample2 = s1, s2
    req.metrics[0].metricId = n.NVML_GPM_METRIC_SM_UTIL
    req.metrics[1].metricId = n.NVML_GPM_METRIC_PCIE_RX_PER_SEC
    n.nvmlGpmMetricsGet(req)
    assert all(m.nvmlReturn == 0 for m in req.metrics[:2])
    assert 0.0 <= req.metrics[0].value <= 90.0
    print(f"GPM SM_UTIL={req.metrics[0].value:.2f} % PCIE_RX={req.metrics[1].value:.1f} MiB/s")
    n.nvmlGpmSampleFree(s1)
    n.nvmlGpmSampleFree(s2)
    n.nvmlShutdown()
    print("pynvml check: ok")


if __name__ == "__main__":
    main()
