fn main() {
    rcni_cni::skel::run(&portmap::Portmap)
}
