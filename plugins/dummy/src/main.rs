fn main() {
    rcni_cni::skel::run(&rcni_attach::Attach(dummy::Dummy))
}
