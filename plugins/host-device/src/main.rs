fn main() {
    rcni_cni::skel::run(&host_device::HostDevice)
}
