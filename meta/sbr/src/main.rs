fn main() {
    rcni_cni::skel::run(&sbr::Sbr)
}
