// Test vectors for rcni's Go net/rpc (gob) codec: the exact bytes the
// reference dhcp plugin and daemon put on the socket, made with the types
// they use (skel.CmdArgs as copied below, types100.Result) and Go's own net/rpc gob codec
// framing (a Request or Response, then the body, on one gob.Encoder).
//
// Not built by cargo. To regenerate (see README.md beside this file):
// copy it into a checkout of containernetworking/plugins at a tag, as
// gobgen/main.go, and run `go run -mod=vendor ./gobgen SCENARIO > FILE`.
// Each scenario runs in a fresh process, so type ids start at 65 as in a
// plugin process's first call.
package main

import (
	"bufio"
	"encoding/gob"
	"errors"
	"net"
	"net/rpc"
	"os"
	"reflect"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
)

func must(err error) {
	if err != nil {
		panic(err)
	}
}

func ipnet(s string) net.IPNet {
	ip, n, err := net.ParseCIDR(s)
	must(err)
	if v4 := ip.To4(); v4 != nil {
		ip = v4
	}
	return net.IPNet{IP: ip, Mask: n.Mask}
}

func main() {
	w := bufio.NewWriter(os.Stdout)
	defer w.Flush()
	enc := gob.NewEncoder(w)
	// skel.CmdArgs of the two releases, copied field for field (skel
	// itself needs a newer Go than Debian's to build); gob names a type by
	// its bare name, so a local CmdArgs is the same on the wire.
	type CmdArgs struct {
		ContainerID   string
		Netns         string
		IfName        string
		Args          string
		Path          string
		NetnsOverride string // cni v1.2.0+ (plugins v1.5.0+)
		StdinData     []byte
	}
	args := &CmdArgs{
		ContainerID: "c1",
		Netns:       "/run/netns/pod",
		IfName:      "eth0",
		Args:        "IgnoreUnknown=1;K8S_POD_NAME=web-0",
		Path:        "/opt/cni/bin",
		StdinData:   []byte(`{"cniVersion":"1.0.0","name":"n","type":"bridge","ipam":{"type":"dhcp"}}`),
	}
	switch os.Args[1] {
	case "allocate-request":
		// Seq 0 is the client's first call (net/rpc counts from 0).
		must(enc.Encode(&rpc.Request{ServiceMethod: "DHCP.Allocate", Seq: 0}))
		must(enc.Encode(args))
	case "allocate-request-v1.1.1":
		type CmdArgs struct {
			ContainerID string
			Netns       string
			IfName      string
			Args        string
			Path        string
			StdinData   []byte
		}
		must(enc.Encode(&rpc.Request{ServiceMethod: "DHCP.Allocate", Seq: 0}))
		must(enc.Encode(&CmdArgs{args.ContainerID, args.Netns, args.IfName, args.Args, args.Path, args.StdinData}))
	case "two-requests":
		// A second call on the same connection: no type definitions again.
		must(enc.Encode(&rpc.Request{ServiceMethod: "DHCP.Allocate", Seq: 0}))
		must(enc.Encode(args))
		must(enc.Encode(&rpc.Request{ServiceMethod: "DHCP.Release", Seq: 1}))
		must(enc.Encode(args))
	case "allocate-reply":
		r := &current.Result{}
		r.IPs = []*current.IPConfig{{Address: ipnet("10.77.0.57/24"), Gateway: net.IPv4(10, 77, 0, 1).To4()}}
		r.Routes = []*types.Route{
			{Dst: ipnet("192.168.50.0/24"), GW: net.IPv4(10, 77, 0, 254).To4()},
			{Dst: ipnet("0.0.0.0/0"), GW: net.IPv4(10, 77, 0, 1).To4()},
		}
		setOnLink(r)
		must(enc.Encode(&rpc.Response{ServiceMethod: "DHCP.Allocate", Seq: 0}))
		must(enc.Encode(r))
	case "release-reply":
		must(enc.Encode(&rpc.Response{ServiceMethod: "DHCP.Release", Seq: 0}))
		must(enc.Encode(&struct{}{}))
	case "error-reply":
		// What the server sends when the method fails: the error text and
		// an empty struct as the body (net/rpc's invalidRequest).
		must(enc.Encode(&rpc.Response{ServiceMethod: "DHCP.Allocate", Seq: 0, Error: errors.New("no more tries").Error()}))
		must(enc.Encode(struct{}{}))
	default:
		panic("unknown scenario " + os.Args[1])
	}
}

// An option-121 route via 0.0.0.0 first: v1.8.0+ give it scope link
// (types.Route has Scope since cni v1.1.0; 1.1.1's has only Dst and GW).
func setOnLink(r *current.Result) {
	rt := &types.Route{Dst: ipnet("10.99.0.0/16"), GW: net.IP{0, 0, 0, 0}}
	if f := reflect.ValueOf(rt).Elem().FieldByName("Scope"); f.IsValid() {
		scope := 253 // RT_SCOPE_LINK
		f.Set(reflect.ValueOf(&scope))
	}
	r.Routes = append([]*types.Route{rt}, r.Routes...)
}
