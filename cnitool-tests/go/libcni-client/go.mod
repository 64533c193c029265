module rcni.dev/cnitool-tests/libcni-client

go 1.19

// Debian 12's golang-github-appc-cni-dev, which the tests were written
// against: its libcni writes the result cache in place (podman_chain.rs).
require github.com/containernetworking/cni v1.1.2
