//go:build tools

// Package flannel pins the flannel release the Kubernetes lab runs beside
// rcni (scripts/flannel-build builds flanneld and install-conf from it into
// a cache outside the repository). The build tag keeps it out of every
// build: it only makes `go mod tidy` keep the release and its commands'
// dependencies in go.mod and go.sum.
package flannel

import (
	_ "github.com/flannel-io/flannel"
	_ "github.com/flannel-io/flannel/cmd/install_conf"
)
