//go:build tools

// Package upstream pins the reference plugins' module at the release whose
// own Go test suites run against rcni's binaries (scripts/upstream-suite
// builds them with `go test -c` into a cache outside the repository). The
// build tag keeps it out of every build: it only makes `go mod tidy` keep
// the release, its packages' dependencies and their tests' in go.mod and
// go.sum.
package upstream

import _ "github.com/containernetworking/plugins/plugins/ipam/dhcp"
