// etcd for the Kubernetes lab: the release's own server, built from its Go
// module (go.etcd.io/etcd/server/v3) by scripts/k8s-build. Nothing here but
// the entry point etcd's own cmd uses.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
