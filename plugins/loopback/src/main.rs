fn main() {
    rcni_cni::skel::run(&loopback::Loopback)
}
