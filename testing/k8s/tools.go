//go:build tools

// Package k8s pins the Kubernetes release the lab runs (scripts/k8s-build
// builds these commands from it into a cache outside the repository). The
// build tag keeps it out of every build: it only makes `go mod tidy` keep
// the release and its commands' dependencies in go.mod and go.sum.
package k8s

import (
	_ "github.com/onsi/ginkgo/v2/ginkgo"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/test/images/agnhost"
)
