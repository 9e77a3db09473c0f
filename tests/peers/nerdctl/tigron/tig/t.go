// Package tig is the one package of nerdctl's mod/tigron that nerdctl's
// binary links (cmd/nerdctl/helpers -> pkg/testutil -> tig): the testing.TB
// subset its test helpers accept. Declared here rather than copied; an
// interface compiles to no code of its own.
package tig

// T is what nerdctl's test helpers need of a *testing.T.
type T interface {
	Helper()
	FailNow()
	Fail()
	Log(args ...any)
	Name() string
	TempDir() string
	Skip(args ...any)
}
