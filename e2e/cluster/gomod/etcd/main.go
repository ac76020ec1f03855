// Command etcd wraps etcd's own entry point so the e2e cluster can build etcd 3.6 from the Go
// module proxy, pinned by this module's go.sum, without downloading release tarballs.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
