//go:build tools

// Package upstream pins the reference plugins' module at the release whose
// own Go test suites run against rcni's binaries (scripts/upstream-suite
// builds them with `go test -c` into a cache outside the repository). The
// build tag keeps it out of every build: it only makes `go mod tidy` keep
// the release, its packages' dependencies and their tests' in go.mod and
// go.sum.
package upstream

import (
	_ "github.com/containernetworking/cni/cnitool"
	// The suites' packages, the echo server and client the portmap suite
	// builds, and the plugins run as the reference's binaries
	// (scripts/upstream-suite --reference, scripts/k8s-e2e --config
	// reference).
	_ "github.com/containernetworking/plugins/pkg/testutils/echo/client"
	_ "github.com/containernetworking/plugins/pkg/testutils/echo/server"
	_ "github.com/containernetworking/plugins/plugins/ipam/dhcp"
	_ "github.com/containernetworking/plugins/plugins/ipam/host-local"
	_ "github.com/containernetworking/plugins/plugins/ipam/static"
	_ "github.com/containernetworking/plugins/plugins/main/bridge"
	_ "github.com/containernetworking/plugins/plugins/main/dummy"
	_ "github.com/containernetworking/plugins/plugins/main/host-device"
	_ "github.com/containernetworking/plugins/plugins/main/ipvlan"
	_ "github.com/containernetworking/plugins/plugins/main/loopback"
	_ "github.com/containernetworking/plugins/plugins/main/macvlan"
	_ "github.com/containernetworking/plugins/plugins/main/ptp"
	_ "github.com/containernetworking/plugins/plugins/main/tap"
	_ "github.com/containernetworking/plugins/plugins/main/vlan"
	_ "github.com/containernetworking/plugins/plugins/meta/bandwidth"
	_ "github.com/containernetworking/plugins/plugins/meta/firewall"
	_ "github.com/containernetworking/plugins/plugins/meta/portmap"
	_ "github.com/containernetworking/plugins/plugins/meta/sbr"
	_ "github.com/containernetworking/plugins/plugins/meta/tuning"
	_ "github.com/containernetworking/plugins/plugins/meta/vrf"
)
