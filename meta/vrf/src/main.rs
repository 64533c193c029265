fn main() {
    rcni_cni::skel::run(&vrf::Vrf)
}
