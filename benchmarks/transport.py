"""Transport throughput on loopback: MB/s for 1-64 MiB float32 tensors, beside one persistent raw libp2p
stream, interleaved (see p2ptrain/bench/transport.py).

    python benchmarks/transport.py [--sizes 1,4,16,64] [--repeats 15] [--json]

Prints a table (or one JSON document with ``--json``). Issue 13's bar: 1 MiB messages at >= 0.9 of the raw
stream's throughput.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

from p2ptrain.bench.transport import measure_throughput, throughput_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,16,64", help="tensor sizes in MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds per size and pattern (median)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    results = measure_throughput([int(s) for s in args.sizes.split(",")], args.repeats)
    if args.json:
        rows = [dataclasses.asdict(r) | {"ratio": round(r.ratio, 3)} for r in results]
        print(json.dumps({"benchmark": "transport_throughput", "unit": "MB/s (1e6 bytes/s)", "results": rows}))
        return
    print(throughput_table(results))


if __name__ == "__main__":
    main()
