#!/usr/bin/env python3
"""Summarises a callgrind output file without callgrind_annotate's formatting:

  total Ir, Ir per ELF object (self cost: the agent binary, the fake libnvidia-ml,
  libc, ...), the inclusive Ir of calls that cross into each object from another
  (for libnvidia_ml.so: everything the fake driver costs, its libc calls included),
  and the inclusive Ir of the agent's per-group sampler entry points.

Usage: callgrind_costs.py callgrind.out.PID[.N]
Prints `key value` lines (machine-readable) followed by a top-function table.

Format: https://valgrind.org/docs/manual/cl-format.html. Self cost is every cost line
that does not follow a `calls=` line; a `calls=` line's following cost line is the
inclusive cost of that call, which is added to the caller's inclusive cost (calls of a
function to itself are skipped so recursion is not counted twice).
"""

import collections
import re
import sys

# Group -> substring of the demangled function whose inclusive cost is the group's work.
# memory, power, thermal, clocks, pcie and nvlink share one function (their per-GPU
# read functions are fn pointers that all demangle to `FnOnce::call_once`), so they are
# reported together as per_device_sample.
ENTRY_POINTS = [
    ("utilization", "UtilizationSampler as apron_agent::sampler::Sampler>::sample"),
    ("gpm", "GpmSampler as apron_agent::sampler::Sampler>::sample"),
    ("health", "HealthSampler as apron_agent::sampler::Sampler>::sample"),
    ("processes", "ProcessesSampler as apron_agent::sampler::Sampler>::sample"),
    ("per_device_sample", "PerDevice<S> as apron_agent::sampler::Sampler>::sample"),
    ("aggregation_on_tick", "runtime::Aggregation::on_tick"),
    ("aggregation_emit", "runtime::Aggregation::emit"),
    ("aggregator_add", "window::Aggregator::add"),
    ("aggregator_close_due", "window::Aggregator::close_due"),
    ("aggregation_thread", "runtime::Aggregation::run"),
    ("scrape_encode", "exposition::"),
]

NAME_RE = re.compile(r"^\((\d+)\)(?: (.*))?$")


def main() -> None:
    path = sys.argv[1]
    names: dict[str, dict[str, str]] = collections.defaultdict(dict)

    def resolve(kind: str, value: str) -> str:
        m = NAME_RE.match(value)
        if not m:
            return value
        ident, name = m.group(1), m.group(2)
        table = names[kind]
        if name is not None:
            table[ident] = name
        return table.get(ident, f"({ident})")

    self_cost: collections.Counter = collections.Counter()
    incl_calls: collections.Counter = collections.Counter()
    obj_of_fn: dict[str, str] = {}
    by_object: collections.Counter = collections.Counter()
    into_object: collections.Counter = collections.Counter()
    ob = fn = "?"
    cfn = cob = None
    after_calls = False
    totals = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            c = line[0]
            if c.isdigit() or c in "+-*":
                parts = line.split()
                ir = int(parts[1]) if len(parts) > 1 else 0
                if after_calls:
                    if cfn != fn:
                        incl_calls[fn] += ir
                    if cob is not None and cob != ob:
                        into_object[cob] += ir
                    after_calls = False
                    cob = None
                else:
                    self_cost[fn] += ir
                    by_object[ob] += ir
                continue
            if line.startswith(("totals:", "summary:")):
                totals = int(line.split()[1])
                continue
            if "=" not in line:
                continue
            key, value = line.split("=", 1)
            if key == "ob":
                ob = resolve("ob", value)
            elif key == "fn":
                # fn and cfn share one name table
                fn = resolve("fn", value)
                obj_of_fn.setdefault(fn, ob)
                cfn = None
            elif key == "cfn":
                cfn = resolve("fn", value)
            elif key == "cob":
                cob = resolve("ob", value)
            elif key in ("fl", "fi", "fe", "cfi", "cfl"):
                resolve("fl", value)
            elif key == "calls":
                after_calls = True
    total = sum(self_cost.values())
    print(f"total_ir {total}")
    if totals is not None:
        print(f"totals_line_ir {totals}")
    for obj, ir in by_object.most_common():
        print(f"object_ir {ir} {obj}")
    for obj, ir in into_object.most_common():
        print(f"calls_into_object_ir {ir} {obj}")
    inclusive = {f: self_cost[f] + incl_calls[f] for f in set(self_cost) | set(incl_calls)}
    for group, needle in ENTRY_POINTS:
        matches = [f for f in inclusive if needle in f]
        if group == "scrape_encode":
            # the outermost exposition function: the Collector impl's encode
            matches = [f for f in matches if "Collector>::encode" in f]
        ir = sum(inclusive[f] for f in matches)
        print(f"entry_ir {group} {ir} {len(matches)}")
    print()
    print("top functions by inclusive Ir (agent binary and fake library):")
    for f, ir in sorted(inclusive.items(), key=lambda kv: -kv[1])[:40]:
        print(f"  {ir:>14,d} {100.0 * ir / max(total, 1):6.2f}%  {f[:150]}")


if __name__ == "__main__":
    main()
