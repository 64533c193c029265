// Package e2e is a slim Kubernetes e2e.test: upstream's test/e2e suite
// setup (test/e2e/e2e_test.go and e2e.go at the release testing/k8s/go.mod
// pins) with only the network and NetworkPolicy specs linked in, the way
// Calico builds its own. Importing k8s.io/kubernetes/test/e2e itself would
// link every suite, so the little setup it does is copied here.
//
// scripts/k8s-build builds it with `go test -c` into the cache as e2e.test;
// it is run like upstream's, e.g.
//
//	e2e.test --kubeconfig=KUBECONFIG -ginkgo.focus='\[sig-network\]'
//
// test/e2e/network imports test/e2e/apps (which imports scheduling and
// common/...), so their specs are registered too; focus or label-filter
// selects. Left out: the cloud providers (gce, aws, ...; "local" and
// "skeleton" remain), the logcheck invariants and upstream's extras for
// GCE, log dumps and progress reports (rejected below rather than ignored).
package e2e

import (
	"context"
	"flag"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/gomega"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	clientset "k8s.io/client-go/kubernetes"
	"k8s.io/component-base/logs"
	"k8s.io/component-base/version"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/test/e2e/framework"
	"k8s.io/kubernetes/test/e2e/framework/config"
	e2edebug "k8s.io/kubernetes/test/e2e/framework/debug"
	e2ekubectl "k8s.io/kubernetes/test/e2e/framework/kubectl"
	e2enode "k8s.io/kubernetes/test/e2e/framework/node"
	e2epod "k8s.io/kubernetes/test/e2e/framework/pod"
	"k8s.io/kubernetes/test/e2e/framework/testfiles"
	e2etestingmanifests "k8s.io/kubernetes/test/e2e/testing-manifests"
	utilnet "k8s.io/utils/net"

	// The specs.
	_ "k8s.io/kubernetes/test/e2e/network"
	_ "k8s.io/kubernetes/test/e2e/network/netpol"

	// As upstream's: define and freeze the feature constants, reconfigure
	// the framework, klog's flags (-v ...) on the command line, gomega's
	// formatting of Kubernetes objects.
	_ "k8s.io/component-base/logs/testinit"
	_ "k8s.io/kubernetes/test/e2e/feature"
	_ "k8s.io/kubernetes/test/e2e/framework/debug/init"
	_ "k8s.io/kubernetes/test/e2e/framework/metrics/init"
	_ "k8s.io/kubernetes/test/e2e/framework/node/init"
	_ "k8s.io/kubernetes/test/utils/ktesting/format"
)

// Flags the framework registers whose work lives in upstream's test/e2e
// package (or needs the repository's cluster/ scripts) and is not copied.
var unsupported = []string{"prepull-images", "gather-suite-metrics-at-teardown",
	"progress-report-url", "spec-dump"}

func TestMain(m *testing.M) {
	showVersion := flag.Bool("version", false, "Displays version information.")
	config.CopyFlags(config.Flags, flag.CommandLine)
	framework.RegisterCommonFlags(flag.CommandLine)
	framework.RegisterClusterFlags(flag.CommandLine)
	flag.Parse()
	if *showVersion {
		fmt.Printf("%s\n", version.Get())
		os.Exit(0)
	}
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "unknown additional command line arguments: %s\n", flag.Args())
		os.Exit(1)
	}
	for _, name := range unsupported {
		if f := flag.Lookup(name); f.Value.String() != f.DefValue {
			fmt.Fprintf(os.Stderr, "--%s is not supported by this slim e2e.test\n", name)
			os.Exit(1)
		}
	}
	// Linked in anyway (test/utils/image reads it); some apps specs read it.
	testfiles.AddFileSource(e2etestingmanifests.GetE2ETestingManifestsFS())
	// Lists specs/labels/images and exits if asked (-list-tests, ...).
	framework.AfterReadingAllFlags(&framework.TestContext)
	os.Exit(m.Run())
}

// TestE2E is upstream's RunE2ETests.
func TestE2E(t *testing.T) {
	// InitLogs turns contextual logging off; upstream turns it back on.
	logs.InitLogs()
	defer logs.FlushLogs()
	klog.EnableContextualLogging(true)
	gomega.RegisterFailHandler(framework.Fail)
	suiteConfig, reporterConfig := framework.CreateGinkgoConfig()
	klog.Infof("Starting e2e run %q on Ginkgo node %d", framework.RunID, suiteConfig.ParallelProcess)
	ginkgo.RunSpecs(t, "Kubernetes e2e suite", suiteConfig, reporterConfig)
}

// Upstream's setupSuite (once, on Ginkgo node 1) and setupSuitePerGinkgoNode.
var _ = ginkgo.SynchronizedBeforeSuite(func(ctx context.Context) []byte {
	c, err := framework.LoadClientset()
	framework.ExpectNoError(err, "Error loading client")
	if framework.TestContext.CleanStart {
		deleted, err := framework.DeleteNamespaces(ctx, c, nil, []string{metav1.NamespaceSystem,
			metav1.NamespaceDefault, metav1.NamespacePublic, v1.NamespaceNodeLease})
		framework.ExpectNoError(err, "deleting orphaned namespaces")
		framework.ExpectNoError(framework.WaitForNamespacesDeleted(ctx, c, deleted, 15*time.Minute))
	}
	timeouts := framework.NewTimeoutContext()
	framework.ExpectNoError(e2enode.WaitForAllNodesSchedulable(ctx, c, timeouts.NodeSchedulable))
	if framework.TestContext.CloudConfig.NumNodes == framework.DefaultNumNodes {
		nodes, err := e2enode.GetReadySchedulableNodes(ctx, c)
		framework.ExpectNoError(err)
		framework.TestContext.CloudConfig.NumNodes = len(nodes.Items)
	}
	// Tests assume the cluster's own pods (DNS, the CNI's daemons) are up.
	if err := e2epod.WaitForAlmostAllPodsReady(ctx, c, metav1.NamespaceSystem, framework.TestContext.MinStartupPods,
		framework.TestContext.AllowedNotReadyNodes, timeouts.SystemPodsStartup); err != nil {
		e2edebug.DumpAllNamespaceInfo(ctx, c, metav1.NamespaceSystem)
		e2ekubectl.LogFailedContainers(ctx, c, metav1.NamespaceSystem, framework.Logf)
		framework.Failf("Error waiting for all pods to be running and ready: %v", err)
	}
	if err := waitForDaemonSets(ctx, c, int32(framework.TestContext.AllowedNotReadyNodes),
		timeouts.SystemDaemonsetStartup); err != nil {
		framework.Logf("WARNING: Waiting for all daemonsets to be ready failed: %v", err)
	}
	framework.Logf("e2e test version: %s", version.Get().GitVersion)
	if v, err := c.Discovery().ServerVersion(); err == nil {
		framework.Logf("kube-apiserver version: %s", v.GitVersion)
	}
	return nil
}, func(ctx context.Context, _ []byte) {
	// The cluster's primary IP family (the kubernetes service's), which
	// the IPv4-only-looking network tests adapt to.
	c, err := framework.LoadClientset()
	framework.ExpectNoError(err, "Error loading client")
	svc, err := c.CoreV1().Services(metav1.NamespaceDefault).Get(ctx, "kubernetes", metav1.GetOptions{})
	framework.ExpectNoError(err, "Failed to get kubernetes service ClusterIP")
	framework.TestContext.IPFamily = "ipv4"
	if utilnet.IsIPv6String(svc.Spec.ClusterIP) {
		framework.TestContext.IPFamily = "ipv6"
	}
	framework.Logf("Cluster IP family: %s", framework.TestContext.IPFamily)
})

// waitForDaemonSets waits until kube-system's daemonsets have all but
// allowedNotReady pods ready (returns at once for -1), as upstream's does.
func waitForDaemonSets(ctx context.Context, c clientset.Interface, allowedNotReady int32, timeout time.Duration) error {
	if allowedNotReady == -1 {
		return nil
	}
	return wait.PollUntilContextTimeout(ctx, framework.Poll, timeout, true, func(ctx context.Context) (bool, error) {
		list, err := c.AppsV1().DaemonSets(metav1.NamespaceSystem).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		for _, ds := range list.Items {
			if ds.Status.DesiredNumberScheduled-ds.Status.NumberReady > allowedNotReady {
				framework.Logf("daemonset %s: %d/%d pods ready", ds.Name, ds.Status.NumberReady,
					ds.Status.DesiredNumberScheduled)
				return false, nil
			}
		}
		return true, nil
	})
}
