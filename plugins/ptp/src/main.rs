fn main() {
    rcni_cni::skel::run(&ptp::Ptp)
}
