fn main() {
    rcni_cni::skel::run(&host_local::HostLocal)
}
