fn main() {
    rcni_cni::skel::run(&vlan::Vlan)
}
