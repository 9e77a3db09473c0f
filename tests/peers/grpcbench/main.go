// grpcbench: unary containerd calls through grpc-go, the client stack of
// kubelet, ctr and buildkit, for scripts/bench.sh. It measures what those
// clients see through each socket, as examples/bench_client.rs does for
// imgbridge's own Rust client (same interleaving, same output line).
//
//	grpcbench --sockets A,B,... --calls N --warmup W --block K
//
// Version calls, interleaved across the sockets in blocks of K calls per
// socket; prints one line per socket:
//
//	unary socket=A calls=N p50_us=.. p90_us=.. p99_us=.. mean_us=..
package main

import (
	"context"
	"flag"
	"fmt"
	"math"
	"os"
	"sort"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/emptypb"
)

// The reply (containerd's VersionResponse) is read into Empty: its fields
// are kept as unknown ones, the decode is the same work.
const method = "/containerd.services.version.v1.Version/Version"

func main() {
	sockets := flag.String("sockets", "", "comma-separated Unix sockets")
	calls := flag.Int("calls", 5000, "measured calls per socket")
	warmup := flag.Int("warmup", 200, "unmeasured calls per socket first")
	block := flag.Int("block", 20, "calls per socket in a row")
	flag.Parse()
	if *sockets == "" || *block < 1 {
		fmt.Fprintln(os.Stderr, "usage: grpcbench --sockets A,B --calls N --warmup W --block K")
		os.Exit(2)
	}
	paths := strings.Split(*sockets, ",")
	conns := make([]*grpc.ClientConn, len(paths))
	for i, p := range paths {
		// As containerd's client dials: a unix:// target, no TLS.
		c, err := grpc.NewClient("unix://"+p, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			fmt.Fprintf(os.Stderr, "dial %s: %v\n", p, err)
			os.Exit(1)
		}
		conns[i] = c
	}
	ctx := context.Background()
	total := *warmup + *calls
	samples := make([][]float64, len(paths))
	in, out := &emptypb.Empty{}, &emptypb.Empty{}
	for first := 0; first < total; first += *block {
		for s, c := range conns {
			for k := first; k < total && k < first+*block; k++ {
				t := time.Now()
				if err := c.Invoke(ctx, method, in, out); err != nil {
					fmt.Fprintf(os.Stderr, "Version via %s: %v\n", paths[s], err)
					os.Exit(1)
				}
				if k >= *warmup {
					samples[s] = append(samples[s], float64(time.Since(t).Nanoseconds())/1e3)
				}
			}
		}
	}
	for s, v := range samples {
		sort.Float64s(v)
		sum := 0.0
		for _, x := range v {
			sum += x
		}
		fmt.Printf("unary socket=%s calls=%d p50_us=%.1f p90_us=%.1f p99_us=%.1f mean_us=%.1f\n",
			paths[s], len(v), pct(v, 0.50), pct(v, 0.90), pct(v, 0.99), sum/float64(len(v)))
	}
}

// pct is the sample at rank round((n-1)·p), as bench_client's percentile.
func pct(sorted []float64, p float64) float64 {
	return sorted[int(math.Round(float64(len(sorted)-1)*p))]
}
