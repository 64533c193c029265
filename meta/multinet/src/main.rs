fn main() {
    rcni_cni::skel::run(&multinet::Multinet)
}
