// grpcbench for scripts/bench.sh: imgbridge's own unary client in Go, on
// grpc-go at the version containerd v2.4.2 (tests/peers/containerd) links,
// so the calls are framed as ctr's and kubelet's are (see ../README.md).
module imgbridge.test/peers/grpcbench

go 1.26.6

require (
	google.golang.org/grpc v1.83.2
	google.golang.org/protobuf v1.36.12
)

require (
	golang.org/x/net v0.58.0 // indirect
	golang.org/x/sys v0.47.0 // indirect
	golang.org/x/text v0.41.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260526163538-3dc84a4a5aaa // indirect
)
