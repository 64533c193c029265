// CoreDNS for the Kubernetes lab: the release kubeadm deploys as the
// cluster's DNS, built from its Go module (github.com/coredns/coredns) by
// scripts/k8s-build. The same main as upstream's coredns.go: its full plugin
// set (core/plugin), then coremain.Run.
package main

import (
	_ "github.com/coredns/coredns/core/plugin" // Plug in CoreDNS.
	"github.com/coredns/coredns/coremain"
)

func main() {
	coremain.Run()
}
