#!/usr/bin/env python3
"""Unary containerd calls through Python grpcio (Debian's python3-grpcio),
for scripts/bench.sh: what a Python client sees through each socket, as
examples/bench_client.rs (Rust) and tests/peers/grpcbench (grpc-go) measure
for theirs, with the same interleaving and the same output line.

    grpcbench.py --sockets A,B,... --calls N --warmup W --block K

Version calls, interleaved across the sockets in blocks of K calls per
socket; prints per socket:
    unary socket=A calls=N p50_us=.. p90_us=.. p99_us=.. mean_us=..
"""
import argparse
import sys
import time

import grpc

# containerd's Version takes google.protobuf.Empty (no bytes) and the reply
# is kept as bytes: no generated stubs needed, the framing is the same.
METHOD = "/containerd.services.version.v1.Version/Version"


def pct(sorted_v, p):
    """The sample at rank round((n-1)·p), as bench_client's percentile."""
    return sorted_v[int(round((len(sorted_v) - 1) * p))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sockets", required=True)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--block", type=int, default=20)
    a = ap.parse_args()
    paths = a.sockets.split(",")
    calls = []
    for p in paths:
        ch = grpc.insecure_channel("unix://" + p)
        calls.append(
            ch.unary_unary(
                METHOD,
                request_serializer=lambda _: b"",
                response_deserializer=lambda b: b,
            )
        )
    total = a.warmup + a.calls
    samples = [[] for _ in paths]
    for first in range(0, total, a.block):
        for s, call in enumerate(calls):
            for k in range(first, min(total, first + a.block)):
                t = time.perf_counter_ns()
                try:
                    call(None, timeout=10)
                except grpc.RpcError as e:
                    print(f"Version via {paths[s]}: {e}", file=sys.stderr)
                    sys.exit(1)
                if k >= a.warmup:
                    samples[s].append((time.perf_counter_ns() - t) / 1e3)
    for s, v in enumerate(samples):
        v.sort()
        print(
            f"unary socket={paths[s]} calls={len(v)} p50_us={pct(v, 0.50):.1f} "
            f"p90_us={pct(v, 0.90):.1f} p99_us={pct(v, 0.99):.1f} mean_us={sum(v) / len(v):.1f}"
        )


if __name__ == "__main__":
    main()
