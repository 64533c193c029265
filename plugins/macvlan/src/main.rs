fn main() {
    rcni_cni::skel::run(&rcni_attach::Attach(macvlan::Macvlan))
}
