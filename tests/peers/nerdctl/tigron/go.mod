// A stand-in for nerdctl's nested module mod/tigron (see ../go.mod): same
// module path and the same requirements, so module resolution is unchanged.
module github.com/containerd/nerdctl/mod/tigron

go 1.23.0

require (
	github.com/creack/pty v1.1.24
	go.uber.org/goleak v1.3.0
	golang.org/x/sync v0.13.0
	golang.org/x/term v0.30.0
	golang.org/x/text v0.24.0
)

require golang.org/x/sys v0.31.0 // indirect
