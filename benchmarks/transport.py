"""Transport throughput on loopback: MB/s for 1-64 MiB float32 tensors, beside raw libp2p streams.

    python benchmarks/transport.py [--sizes 1,4,16,64] [--repeats 5] [--json]

Prints a table (or one JSON document with ``--json``). The issue's bar: at least 100 MB/s for 16 MB.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

from p2ptrain.bench.transport import measure_throughput


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,16,64", help="tensor sizes in MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="timed transfers per size (median reported)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    results = measure_throughput([int(s) for s in args.sizes.split(",")], args.repeats)
    if args.json:
        rows = [dataclasses.asdict(r) | {"ratio": round(r.ratio, 3)} for r in results]
        print(json.dumps({"benchmark": "transport_throughput", "unit": "MB/s (1e6 bytes/s)", "results": rows}))
        return
    print(f"{'size MiB':>8} {'transport MB/s':>14} {'raw stream MB/s':>16} {'ratio':>6}")
    for r in results:
        print(f"{r.size_mib:>8} {r.transport_mb_per_s:>14.0f} {r.raw_stream_mb_per_s:>16.0f} {r.ratio:>6.2f}")


if __name__ == "__main__":
    main()
