// The OCI distribution-spec conformance suite for scripts/peers.sh (see
// ../README.md): a main package since 2026 (`conformance`), configured by
// OCI_* environment variables; tests/registry.rs runs it against the
// endpoint. The module has no tags: pinned by its pseudo-version, and it has
// no replace/exclude directives.
module imgbridge.test/peers/conformance

go 1.26.6

tool github.com/opencontainers/distribution-spec/conformance

require (
	github.com/goccy/go-yaml v1.18.0 // indirect
	github.com/opencontainers/distribution-spec/conformance v0.0.0-20260831232431-97274622c111 // indirect
	github.com/opencontainers/distribution-spec/specs-go v0.0.0-20240926185104-8376368dd8aa // indirect
	github.com/opencontainers/go-digest v1.0.0 // indirect
	github.com/opencontainers/image-spec v1.1.1 // indirect
)
