fn main() {
    rcni_cni::skel::run(&bandwidth::Bandwidth)
}
