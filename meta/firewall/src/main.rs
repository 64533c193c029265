fn main() {
    rcni_cni::skel::run(&firewall::Firewall)
}
