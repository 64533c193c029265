fn main() {
    rcni_cni::skel::run(&bridge::Bridge)
}
