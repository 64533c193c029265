// libcni-client: a real runtime client built against libcni v1.1.2
// (Debian 12's version, pinned in go.mod), so conformance tests can check that our
// plugins and our cnitool's cache behave as libcni expects.
//
// Usage: libcni-client add|check|del <confdir> <network> <netns> <containerID> <ifname> <cachedir>
// CNI_PATH gives the plugin directories; CAP_ARGS, if set, is a JSON object of
// capability arguments (as a runtime passes portMappings or pod annotations).
// ADD prints the result JSON.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"github.com/containernetworking/cni/libcni"
)

func main() {
	if len(os.Args) != 8 {
		fmt.Fprintln(os.Stderr, "usage: libcni-client add|check|del <confdir> <network> <netns> <containerID> <ifname> <cachedir>")
		os.Exit(2)
	}
	cmd, confdir, network, netns, cid, ifname, cachedir := os.Args[1], os.Args[2], os.Args[3], os.Args[4], os.Args[5], os.Args[6], os.Args[7]
	list, err := libcni.LoadConfList(confdir, network)
	if err != nil {
		fmt.Fprintln(os.Stderr, "load:", err)
		os.Exit(1)
	}
	cninet := libcni.NewCNIConfigWithCacheDir(filepath.SplitList(os.Getenv("CNI_PATH")), cachedir, nil)
	rt := &libcni.RuntimeConf{ContainerID: cid, NetNS: netns, IfName: ifname}
	if s := os.Getenv("CAP_ARGS"); s != "" {
		if err := json.Unmarshal([]byte(s), &rt.CapabilityArgs); err != nil {
			fmt.Fprintln(os.Stderr, "CAP_ARGS:", err)
			os.Exit(2)
		}
	}
	ctx := context.Background()
	switch cmd {
	case "add":
		res, err := cninet.AddNetworkList(ctx, list, rt)
		if err != nil {
			fmt.Fprintln(os.Stderr, "add:", err)
			os.Exit(1)
		}
		if err := res.Print(); err != nil {
			os.Exit(1)
		}
	case "check":
		if err := cninet.CheckNetworkList(ctx, list, rt); err != nil {
			fmt.Fprintln(os.Stderr, "check:", err)
			os.Exit(1)
		}
	case "del":
		if err := cninet.DelNetworkList(ctx, list, rt); err != nil {
			fmt.Fprintln(os.Stderr, "del:", err)
			os.Exit(1)
		}
	default:
		fmt.Fprintln(os.Stderr, "unknown command", cmd)
		os.Exit(2)
	}
}
